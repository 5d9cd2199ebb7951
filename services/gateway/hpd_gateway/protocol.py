"""The OpenAI wire protocol as the gateway speaks it, and vLLM's P/D hand-off. Pure.

* :func:`parse_request` checks a client body and answers :class:`BadRequest` naming the
  field (the OpenAI error shape's ``param``); fields it does not know pass through to the
  engine untouched, so engine extensions (``ignore_eos``, ``return_token_ids``, ...) work.
* :func:`prefill_body` / :func:`decode_body` are vLLM's NIXL hand-off: prefill gets the
  same prompt with one output token, no stream and ``kv_transfer_params:
  {"do_remote_decode": true}``; decode gets the client's body with the parameters the
  prefill returned, unchanged.
* :func:`error_body` is OpenAI's error shape; :class:`GatewayError` carries an HTTP status
  (and ``Retry-After`` seconds) to the one place that answers errors.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BadRequest",
    "ClientRequest",
    "GatewayError",
    "decode_body",
    "error_body",
    "parse_request",
    "prefill_body",
    "sse_event",
]

COMPLETIONS = "completions"
CHAT = "chat"
MAX_TOKENS_LIMIT = 1 << 20


class GatewayError(Exception):
    """An answer to the client other than 200: status, OpenAI error type and code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str = "",
        param: str | None = None,
        retry_after_s: int = 0,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code or str(status)
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


class BadRequest(GatewayError):
    """400 naming the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(400, f"{param}: {message}", param=param, code="invalid_value")


def error_body(message: str, type_: str, code: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse_event(payload: Mapping[str, Any] | str) -> bytes:
    """One server-sent event carrying ``payload`` (JSON, or a literal like ``[DONE]``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """A checked client request: which endpoint, the body as sent, the fields we read."""

    kind: str  # COMPLETIONS or CHAT
    body: Mapping[str, Any]
    model: str
    stream: bool
    max_tokens: int  # 0 when the client left it to the engine
    include_usage: bool
    body_bytes: int = 0  # the body's size as sent

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == CHAT else "/v1/completions"

    def prompt_for_tokenize(self) -> dict[str, Any]:
        """The body of the engine's ``/tokenize`` for this prompt."""
        if self.kind == CHAT:
            return {"model": self.model, "messages": self.body["messages"]}
        return {"model": self.model, "prompt": self.body["prompt"]}


def _int_field(body: Mapping[str, Any], key: str, low: int, high: int) -> int | None:
    if key not in body or body[key] is None:
        return None
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(key, f"must be an integer, got {type(v).__name__}")
    if not low <= v <= high:
        raise BadRequest(key, f"must be in [{low}, {high}], got {v}")
    return v


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt", "must not be empty")
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            return
        if len(prompt) == 1 and isinstance(prompt[0], str) and prompt[0]:
            return
        raise BadRequest("prompt", "must be a string, a list of token ids or a list of one string")
    raise BadRequest("prompt", "must be a non-empty string or list of token ids")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}]", "must be an object")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise BadRequest(f"messages[{i}].role", "is required")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(f"messages[{i}].content", "must be a string or a list of parts")


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate


def _check_encodable(value: Any, where: str) -> None:
    """400 for a string holding a lone surrogate (JSON may escape one; UTF-8 cannot hold it,
    so no tokenizer or engine can take it)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadRequest(where, "holds a lone UTF-16 surrogate, which is not text") from exc
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_encodable(k, where)
            _check_encodable(v, f"{where}.{k}" if where != "body" else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_encodable(v, f"{where}[{i}]")


def parse_request(kind: str, raw: bytes) -> ClientRequest:
    """Check a client body for ``kind`` (module docstring); BadRequest naming the field."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest("body", f"is not valid JSON ({exc})") from exc
    except RecursionError as exc:
        raise BadRequest("body", "is nested too deeply") from exc
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    if _SURROGATE.search(raw):  # only then is the walk worth its cost
        _check_encodable(body, "body")
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise BadRequest("model", "is required (a model id from GET /v1/models)")
    if kind == CHAT:
        _check_messages(body.get("messages"))
    else:
        if "prompt" not in body:
            raise BadRequest("prompt", "is required")
        _check_prompt(body["prompt"])
    max_tokens = _int_field(body, "max_tokens", 1, MAX_TOKENS_LIMIT)
    if kind == CHAT:
        mct = _int_field(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT)
        max_tokens = mct if mct is not None else max_tokens
    n = _int_field(body, "n", 1, 1_000)
    if n is not None and n != 1:
        raise BadRequest("n", "only 1 is supported through the gateway")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("stream", "must be true or false")
    for key in ("temperature", "top_p"):
        v = body.get(key)
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
        ):
            raise BadRequest(key, "must be a finite number")
    if "kv_transfer_params" in body:
        raise BadRequest("kv_transfer_params", "is set by the gateway, not by clients")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequest("stream_options", "must be an object")
    include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
    model = model.strip()
    body = {**body, "model": model}  # the engines get the id that was counted and scheduled
    return ClientRequest(kind, body, model, stream, max_tokens or 0, include_usage, len(raw))


def prefill_body(req: ClientRequest) -> dict[str, Any]:
    """The prefill half of vLLM's NIXL hand-off: one token, no stream, KV kept for decode."""
    body = dict(req.body)
    body.pop("stream_options", None)
    body.pop("min_tokens", None)  # the prefill makes one token; decode honours the minimum
    body.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    if req.kind == CHAT:
        body["max_completion_tokens"] = 1
    return body


def decode_body(req: ClientRequest, kv_transfer_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The client's body for the decode worker, with the prefill's parameters when the KV
    is to be pulled; streamed responses also carry usage (the gateway counts tokens)."""
    body = dict(req.body)
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    if req.stream:
        opts = dict(body.get("stream_options") or {})
        opts["include_usage"] = True
        body["stream_options"] = opts
    return body


def strip_usage_chunk(event: Mapping[str, Any], client_wants_usage: bool) -> bool:
    """True when this streamed chunk is the usage-only chunk the client did not ask for."""
    return not client_wants_usage and not event.get("choices") and "usage" in event
