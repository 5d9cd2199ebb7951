"""The gateway counts a prompt with its local tokenizer once per request: a completions
prompt is encoded once (its ids are its count and its prefix hashes), a chat is counted
(only the engine applies its template, so there are no ids)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, cast

from hpd_gateway.control_client import ControlPlane
from hpd_gateway.engine_client import EngineHttp
from hpd_gateway.metrics import GatewayMetrics
from hpd_gateway.protocol import CHAT, COMPLETIONS, parse_request
from hpd_gateway.service import Gateway
from hpd_gateway.tokens import LocalTokenizers


class _Fleet:
    def tokenizer_endpoints(self, model: str) -> list[str]:
        return ["127.0.0.1:1"]  # never called: the local tokenizer counts


class _CountingTokenizers:
    """LocalTokenizers' interface; counts the encodings it is asked for."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __contains__(self, model: str) -> bool:
        return True

    def ids(self, model: str, body: Mapping[str, Any]) -> list[int] | None:
        self.calls.append("ids")
        return None if "messages" in body else [7] * len(str(body["prompt"]).split())

    def count(self, model: str, body: Mapping[str, Any]) -> int:
        self.calls.append("count")
        return 11


def _gateway(tok: _CountingTokenizers) -> Gateway:
    return Gateway(
        cast(ControlPlane, _Fleet()), EngineHttp(), GatewayMetrics(),
        tokenizers=cast(LocalTokenizers, tok),
    )  # fmt: skip


async def test_a_completions_prompt_is_encoded_once() -> None:
    tok = _CountingTokenizers()
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 4}
    req = parse_request(COMPLETIONS, json.dumps(body).encode())
    count, ids = await _gateway(tok)._count_tokens(req)
    assert (count, ids) == (3, [7, 7, 7])
    assert tok.calls == ["ids"]


async def test_a_chat_is_counted_without_ids() -> None:
    tok = _CountingTokenizers()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    req = parse_request(CHAT, json.dumps(body).encode())
    assert await _gateway(tok)._count_tokens(req) == (11, None)
    assert tok.calls == ["ids", "count"]
