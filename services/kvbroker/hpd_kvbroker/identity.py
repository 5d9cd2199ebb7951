"""Who acts on a KV session: the caller's verified identity, never the message's say-so.

:func:`authenticate` turns a session call into ``(actor, credential hash)``: actor ``''`` is
the control plane (the scheduler, the gateway, an operator, as each is allowed for the
operation); any other actor is a worker, whose registration credential the session script
checks against the session's two workers. Tested adversarially in ``tests/security``.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from hpd_common import auth
from hpd_common.auth import Role
from hpd_common.errors import InvalidArgument, PermissionDenied
from hpd_common.ids import check_id
from hpd_kvbroker.domain import GATEWAY_OPS, SCHEDULER_OPS, Op
from hpd_kvbroker.settings import KvBrokerSettings
from hpd_registry.store import credential_hash

__all__ = ["MAX_CREDENTIAL_LEN", "Caller", "authenticate"]

MAX_CREDENTIAL_LEN = 256


@dataclass(frozen=True, slots=True)
class Caller:
    """Who calls: a worker (id + registry credential), the scheduler or the gateway (tokens)."""

    worker_id: str = ""
    credential: str = ""
    scheduler_token: str = ""
    gateway_token: str = ""


def authenticate(caller: Caller, op: Op | None, settings: KvBrokerSettings) -> tuple[str, str]:
    """(actor, credential hash): actor '' is the control plane (scheduler, gateway or an
    operator, as allowed for ``op``; None = opening).

    With auth on, the caller's verified identity (bearer token or client certificate)
    decides and nothing in the message can raise it: a worker principal is always the
    worker its ``caller.worker_id`` names, proved by that worker's registration
    credential (the session script checks it is one of the session's two workers), and
    the in-message tokens are ignored. With auth off (development), an in-message token
    is checked against the broker's setting and refused where none is configured; a
    caller naming a worker is that worker; an empty caller is the control plane unless
    a token is configured."""
    scheduler_may = op is None or op in SCHEDULER_OPS
    gateway_may = op is not None and op in GATEWAY_OPS
    who = auth.current()  # None: auth is off (these RPCs are never open reads)
    if who is not None:
        if who.role is Role.WORKER:
            return _as_worker(caller)
        if who.role is Role.GATEWAY and not gateway_may:
            raise PermissionDenied("the gateway may not do this (only its workers may)")
        if who.role is Role.SCHEDULER and not scheduler_may:
            raise PermissionDenied("only the session's workers may do this, not the scheduler")
        return "", ""
    for name, given, configured, allowed in (
        ("gateway", caller.gateway_token, settings.gateway_token, gateway_may),
        ("scheduler", caller.scheduler_token, settings.scheduler_token, scheduler_may),
    ):
        if not given:
            continue
        if not configured:
            raise PermissionDenied(
                f"this broker has no {name} token configured, so an in-message "
                f"{name}_token is refused (use bearer auth: hpd_common.auth)"
            )
        if not hmac.compare_digest(configured.encode(), given.encode()):
            raise PermissionDenied(f"{name} token does not match")
        if not allowed:
            raise PermissionDenied(f"the {name} may not do this (only the session's workers may)")
        return "", ""
    if caller.worker_id:
        return _as_worker(caller)
    if settings.scheduler_token or settings.gateway_token:
        raise InvalidArgument(
            "caller.worker_id",
            "is required: a session worker's id and registry credential"
            + (" (or the scheduler token)" if scheduler_may else "")
            + (" (or the gateway token)" if gateway_may else ""),
        )
    return "", ""  # auth off and no token configured: development, trusted


def _as_worker(caller: Caller) -> tuple[str, str]:
    """A worker's (id, credential hash); the session script checks both."""
    if not caller.worker_id:
        raise InvalidArgument(
            "caller.worker_id", "is required: a worker acts with its id and credential"
        )
    check_id("caller.worker_id", caller.worker_id)
    if not caller.credential:
        raise InvalidArgument("caller.credential", "is required with caller.worker_id")
    if len(caller.credential) > MAX_CREDENTIAL_LEN:
        raise InvalidArgument("caller.credential", f"longer than {MAX_CREDENTIAL_LEN} characters")
    return caller.worker_id, credential_hash(caller.credential)
