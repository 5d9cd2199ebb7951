"""A scheduler plan as the gateway runs it: ordered steps, primary first. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Outcome", "Plan", "Step"]

TRANSFER = "transfer"
RECOMPUTE = "recompute"
SAME_POOL = "same_pool"


@dataclass(frozen=True, slots=True)
class Step:
    """One way to serve the request. ``prefill_*`` is empty unless ``mode`` is TRANSFER;
    an endpoint is empty when the plan named only the worker (a fallback step: the gateway
    resolves it from its fleet view at the time the step runs)."""

    mode: str
    decode_worker: str
    decode_endpoint: str = ""
    prefill_worker: str = ""
    prefill_endpoint: str = ""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Plan:
    """The scheduler's answer: steps in the order to try them, and the primary's session."""

    request_id: str
    steps: tuple[Step, ...]
    session_id: str = ""
    kv_bytes: int = 0
    record_id: str = ""


@dataclass(slots=True)
class Outcome:
    """What really happened, for ReportOutcome and the gateway's metrics."""

    success: bool = False
    mode: str = ""
    error_class: str = ""
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    prefill_ms: float = 0.0
    tokenize_ms: float = 0.0  # counting the prompt's tokens (local tokenizer or /tokenize)
    schedule_ms: float = 0.0  # the Schedule call(s), a re-plan's included
    output_tokens: int = 0
    fallbacks: int = 0
    status: int = 200
    failed_workers: list[str] = field(default_factory=list)  # whose steps failed, in order
