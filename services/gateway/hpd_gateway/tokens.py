"""Counting a prompt's tokens in the gateway, with the model's own tokenizer.

A count from the engine's ``/tokenize`` costs one more HTTP round trip to a busy engine on
every request; with the model's ``tokenizer.json`` (``--tokenizer model=folder``) the
gateway counts in microseconds. Completions count exactly (a string prompt is encoded, a
token-id prompt is its length). Chat counts the messages' text plus a fixed allowance per
message for the template's role markers (``CHAT_TOKENS_PER_MESSAGE``), an estimate within a
few tokens of the engine's count, which is all the scheduler needs to size the KV and the
prefill.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TOKENS_PER_MESSAGE", "LocalTokenizers", "prompt_token_ids"]

CHAT_TOKENS_PER_MESSAGE = 4
"""Role markers and separators a chat template adds per message (Llama-3: 4 to 5)."""


def prompt_token_ids(body: Mapping[str, Any]) -> list[int] | None:
    """A checked completions body's prompt when it is token ids (counted as sent, no
    tokenizer needed); None for text and chat."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return [int(t) for t in prompt]
    return None


GIL_FREE_CHARS = 4096
"""Texts longer than this are encoded with ``encode_batch``, which releases the GIL while it
runs (``encode`` holds it): on the gateway's worker thread, the event loop keeps serving
streams meanwhile. Shorter ones take ``encode``, which skips the batch's thread pool."""


def _encode(tok: Any, text: str, special: bool) -> list[int]:
    if len(text) > GIL_FREE_CHARS:
        return list(tok.encode_batch([text], add_special_tokens=special)[0].ids)
    return list(tok.encode(text, add_special_tokens=special).ids)


class LocalTokenizers:
    """``model id -> tokenizer`` loaded from folders holding ``tokenizer.json``."""

    def __init__(self, folders: Mapping[str, str]) -> None:
        self._tok: dict[str, Any] = {}
        if not folders:
            return
        from tokenizers import Tokenizer

        for model, folder in folders.items():
            path = Path(folder) / "tokenizer.json"
            try:
                self._tok[model] = Tokenizer.from_file(str(path))
            except Exception as exc:  # the library raises its own exception types
                raise ValueError(f"tokenizer for {model!r}: cannot load {path}: {exc}") from exc

    def __contains__(self, model: str) -> bool:
        return model in self._tok

    def ids(self, model: str, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids as the engine will see them, for a completions body
        (text or token ids); None for chat, whose template only the engine applies."""
        if "messages" in body:
            return None
        ids = prompt_token_ids(body)
        if ids is not None:
            return ids
        prompt = body["prompt"]
        text = prompt[0] if isinstance(prompt, list) else prompt
        return _encode(self._tok[model], str(text), True)

    def count(self, model: str, body: Mapping[str, Any]) -> int:
        """Prompt tokens of a checked completions or chat body."""
        ids = self.ids(model, body)
        if ids is not None:  # completions: exact
            return len(ids)
        tok = self._tok[model]
        total = 0
        for m in body["messages"]:
            content = m.get("content")
            if isinstance(content, list):  # parts: count their text
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            total += len(_encode(tok, str(content or ""), False))
            total += CHAT_TOKENS_PER_MESSAGE
        return total
