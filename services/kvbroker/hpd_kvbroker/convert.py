"""Protobuf <-> broker domain. The only broker module besides `api` that sees protobuf."""

from __future__ import annotations

import functools
import math

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import kvbroker_pb2 as k
from hpd_common.errors import InvalidArgument
from hpd_common.kvformat import KvFormat, Negotiation, Verdict
from hpd_kvbroker.domain import Session, SessionState
from hpd_kvbroker.identity import Caller
from hpd_kvbroker.matrix import MatrixView
from hpd_registry.convert import kv_format_from_pb, kv_format_to_pb

VERDICT_TO_PB = {
    Verdict.COMPATIBLE: k.COMPATIBILITY_VERDICT_COMPATIBLE,
    Verdict.CONVERTIBLE: k.COMPATIBILITY_VERDICT_CONVERTIBLE,
    Verdict.INCOMPATIBLE: k.COMPATIBILITY_VERDICT_INCOMPATIBLE,
}
STATE_TO_PB = {
    SessionState.NEGOTIATED: k.SESSION_STATE_NEGOTIATED,
    SessionState.RESERVED: k.SESSION_STATE_RESERVED,
    SessionState.TRANSFERRING: k.SESSION_STATE_TRANSFERRING,
    SessionState.COMPLETE: k.SESSION_STATE_COMPLETE,
    SessionState.FAILED: k.SESSION_STATE_FAILED,
    SessionState.EXPIRED: k.SESSION_STATE_EXPIRED,
    SessionState.ABORTED: k.SESSION_STATE_ABORTED,
}
STATE_FROM_PB: dict[int, SessionState] = {int(v): s for s, v in STATE_TO_PB.items()}


def state_from_pb(path: str, value: int) -> SessionState:
    if value not in STATE_FROM_PB:
        raise InvalidArgument(path, "must be a known session state")
    return STATE_FROM_PB[value]


def format_from_pb(m: c.KvFormat, path: str) -> KvFormat:
    """A KV format from the wire; enums must be set (validation is the service's)."""
    return kv_format_from_pb(m, path)


@functools.lru_cache(maxsize=4096)
def negotiation_to_pb(n: Negotiation) -> k.Negotiation:
    """Built once per distinct negotiation; callers copy it into their message (protobuf
    constructors and CopyFrom copy), never mutate it."""
    return k.Negotiation(
        verdict=VERDICT_TO_PB[n.verdict],
        reasons=list(n.reasons),
        details=list(n.details),
        steps=[
            k.ConversionStep(
                kind=s.kind, detail=s.detail, cost_ms_per_gib=s.cost_ms_per_gib, lossy=s.lossy
            )
            for s in n.steps
        ],
        cost_ms_per_gib=n.cost_ms_per_gib,
    )


def conversion_ms(n: Negotiation, kv_bytes: int) -> float:
    """0 when no bytes are given (no estimate asked for), else Negotiation.conversion_ms."""
    if kv_bytes == 0:
        return 0.0 if n.transferable else math.inf
    return n.conversion_ms(kv_bytes)


def format_to_pb(kv: KvFormat) -> c.KvFormat:
    return kv_format_to_pb(kv)


def session_to_pb(s: Session, out: k.KvSession | None = None) -> k.KvSession:
    """The session as a message, written into `out` (a response's field) when given, so
    the response does not copy a finished message."""
    if out is None:
        out = k.KvSession()
    out.session_id = s.session_id
    out.request_id = s.request_id
    out.source_worker_id = s.source_worker_id
    out.destination_worker_id = s.destination_worker_id
    out.state = STATE_TO_PB[s.state]
    out.negotiation.CopyFrom(negotiation_to_pb(s.negotiation))
    out.expected_bytes = s.expected_bytes
    out.bytes_done = s.bytes_done
    out.created_at_unix_ms = s.created_ms
    out.updated_at_unix_ms = s.updated_ms
    out.deadline_unix_ms = s.deadline_ms
    out.lease_expires_at_unix_ms = s.lease_expires_ms
    out.lease_ttl_ms = s.lease_ttl_ms
    out.reason = s.reason
    out.version = s.version
    out.updated_by = s.updated_by
    return out


def caller_from_pb(m: k.SessionCaller) -> Caller:
    return Caller(
        worker_id=m.worker_id,
        credential=m.credential,
        scheduler_token=m.scheduler_token,
        gateway_token=m.gateway_token,
    )


def matrix_to_pb(v: MatrixView, revision: int) -> k.GetCompatibilityMatrixResponse:
    return k.GetCompatibilityMatrixResponse(
        model_id=v.model_id,
        prefill_worker_ids=list(v.prefill_ids),
        decode_worker_ids=list(v.decode_ids),
        pairs=[
            k.WorkerPair(prefill_worker_id=p, decode_worker_id=d, negotiation=negotiation_to_pb(n))
            for p, d, n in v.pairs
        ],
        registry_revision=revision,
    )
