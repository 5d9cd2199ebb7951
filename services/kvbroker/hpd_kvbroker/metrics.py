"""Prometheus metrics of the KV broker (served by `hpd_common.metrics.serve_metrics`).

Counters count what this replica did; summed over replicas they count each event once,
because every change is made by exactly one replica's script.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from hpd_common.kvformat import Verdict
from hpd_kvbroker.domain import Session, SessionState

SESSIONS = Counter(
    "hpd_kv_sessions_total",
    "Session state changes made by this replica, by the state entered (NEGOTIATED = opened).",
    ["state"],
)
OPEN_SESSIONS = Gauge(
    "hpd_kv_sessions_open", "Open (non-terminal) sessions in the store at the last sweep."
)
SESSION_BYTES = Counter(
    "hpd_kv_session_bytes_total",
    "KV bytes of ended sessions: moved (COMPLETE) or stranded (bytes done when FAILED, "
    "EXPIRED or ABORTED).",
    ["state"],
)
SESSION_SECONDS = Histogram(
    "hpd_kv_session_duration_seconds",
    "Time from open to the terminal state.",
    ["state"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
EXPIRIES = Counter(
    "hpd_kv_session_expiries_total",
    "Sessions this replica expired, by reason (deadline_exceeded, session_lease_expired).",
    ["reason"],
)
NEGOTIATIONS = Counter(
    "hpd_kv_negotiations_total",
    "Negotiations answered (Negotiate and OpenSession), by verdict.",
    ["verdict"],
)
MATRIX_PAIRS = Gauge("hpd_kv_matrix_pairs", "Prefill x decode pairs in the matrix, all models.")


_ENTERED = {state: SESSIONS.labels(state=state.value) for state in SessionState}
_ENDS = [state for state in SessionState if state.terminal]
_ENDED_BYTES = {state: SESSION_BYTES.labels(state=state.value) for state in _ENDS}
_ENDED_SECONDS = {state: SESSION_SECONDS.labels(state=state.value) for state in _ENDS}
_VERDICTS = {v: NEGOTIATIONS.labels(verdict=v.value) for v in Verdict}


def observe_negotiation(verdict: Verdict) -> None:
    _VERDICTS[verdict].inc()


def observe_change(s: Session) -> None:
    """Counts one state change this replica made (the session as it is after it)."""
    _ENTERED[s.state].inc()
    if not s.state.terminal:
        return
    _ENDED_BYTES[s.state].inc(s.bytes_done)
    _ENDED_SECONDS[s.state].observe(max(0, s.updated_ms - s.created_ms) / 1000)
    if s.state.value == "EXPIRED":
        EXPIRIES.labels(reason=s.reason).inc()
