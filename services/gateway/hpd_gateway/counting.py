"""Step 1 of a request (``service.py``): count the prompt's tokens.

With the model's tokenizer when the gateway has it (``tokens.py``; a body past
``TOKENIZE_OFF_LOOP_BYTES`` on a worker thread), from the token ids themselves when the
prompt is ids, else with an engine's ``/tokenize`` (a decode-capable worker of the model
first, at most three asked). A model no worker serves is 404 before anything is scheduled.
"""

from __future__ import annotations

import asyncio

from .control_client import ControlPlane
from .engine_client import EngineHttp, Hop, UpstreamError
from .metrics import GatewayMetrics
from .protocol import ClientRequest, GatewayError
from .tokens import LocalTokenizers, prompt_token_ids

__all__ = ["TOKENIZE_OFF_LOOP_BYTES", "TOKENIZE_TIMEOUT_S", "PromptCounting"]

TOKENIZE_TIMEOUT_S = 2.0
"""Counting tokens is milliseconds of work: an engine that takes longer is stuck or
overloaded, and the next one is asked."""
TOKENIZE_OFF_LOOP_BYTES = 16 << 10
"""A prompt in a body past this is tokenized on a worker thread. Below it, encoding takes
well under a millisecond, less than the thread hop costs; a 4 MiB prompt takes the best part
of a second, which every stream on the event loop would otherwise wait out."""
_TOKENIZE = Hop("tokenize")  # an engine's /tokenize (the request has no id there yet)


class PromptCounting:
    """The gateway's token counting (module docstring), a part of :class:`Gateway`."""

    control: ControlPlane
    engines: EngineHttp
    metrics: GatewayMetrics
    tokenizers: LocalTokenizers | None

    async def _count_tokens(self, req: ClientRequest) -> tuple[int, list[int] | None]:
        """The prompt's token count and, when known exactly, its token ids."""
        endpoints = self.control.tokenizer_endpoints(req.model)
        ids = prompt_token_ids(req.body) if endpoints else None
        if ids is not None:  # token ids: counted as sent, no tokenizer and no round trip
            return len(ids), ids
        if endpoints and self.tokenizers is not None and req.model in self.tokenizers:
            if req.body_bytes > TOKENIZE_OFF_LOOP_BYTES:  # the streams keep flowing meanwhile
                return await asyncio.to_thread(self._local_count, req)
            return self._local_count(req)
        if not endpoints:
            raise GatewayError(
                404, f"the model {req.model!r} has no worker in the fleet",
                code="model_not_found", param="model",
            )  # fmt: skip
        last: UpstreamError | None = None
        for ep in endpoints[:3]:
            try:
                got = await self.engines.post_json(
                    ep, "/tokenize", req.prompt_for_tokenize(), TOKENIZE_TIMEOUT_S, _TOKENIZE
                )
                count = got.get("count") if isinstance(got, dict) else None
                if isinstance(count, int) and count >= 0:
                    ids = got.get("tokens") if isinstance(got, dict) else None
                    ok = isinstance(ids, list) and all(isinstance(t, int) for t in ids)
                    return count, (ids if ok else None)
                last = UpstreamError("bad_reply", ep, "no count in /tokenize")
            except UpstreamError as exc:
                if not exc.retryable:
                    raise GatewayError(400, exc.detail, code="invalid_value") from exc
                last = exc
            self.metrics.upstream_errors.labels(ep, last.cause).inc()
        raise GatewayError(
            502, f"no engine could count the prompt's tokens ({last})", type_="server_error",
            code="upstream_error",
        )  # fmt: skip

    def _local_count(self, req: ClientRequest) -> tuple[int, list[int] | None]:
        assert self.tokenizers is not None
        # a completions prompt is encoded once: its ids are its count
        ids = self.tokenizers.ids(req.model, req.body)
        if ids is not None:
            return len(ids), ids
        return self.tokenizers.count(req.model, req.body), None
