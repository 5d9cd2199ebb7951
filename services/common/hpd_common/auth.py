"""Who may call what: bearer tokens, four roles, and one table of every RPC.

A service started with ``auth_tokens_file`` checks every call against :data:`ACCESS`
before the servicer sees it (:class:`AuthInterceptor`):

| role        | may                                                                    |
|-------------|------------------------------------------------------------------------|
| ``worker``  | register, heartbeat, deregister and drain **its own** record (the      |
|             | registry's per-registration credential names which), report its KV     |
|             | sessions' progress                                                      |
| ``gateway`` | Schedule, ReportOutcome of **its own** requests, report, complete and  |
|             | abort the KV sessions it runs                                          |
| ``scheduler``| send directives (its serving actions), open and abort KV sessions     |
| ``operator``| everything: drain, cordon, directives, policy, deregistering others   |

A call with no ``authorization: Bearer <token>`` metadata is UNAUTHENTICATED, a token
the file does not hold is UNAUTHENTICATED, a role the table does not allow is
PERMISSION_DENIED. Read-only RPCs (``READ`` below) stay open to anyone while
``auth_open_reads`` is on (the default), else they need any known token. Health and
reflection are always open. Which *subject* a caller may touch (a worker's own record, a
gateway's own requests) is checked by the service, which reads the caller from
:func:`current`.

Every state-changing call except the per-request and per-heartbeat ones is written to
the log as an ``audit`` event (at warning level, so any log level keeps it): who, which
method, on what, and the answer.

The tokens file (YAML), mode 0600 as any secret::

    tokens:
      - {name: alice, role: operator, token_sha256: 5e884898da28...}   # hash only
      - {name: gw-1, role: gateway, token: "s3cret-gateway-token"}   # or the token itself
      - {name: gw-2, role: gateway, cert_name: gateway-2.prod}       # or an mTLS identity
      - {name: rack-7, role: worker, token: "...", workers: "r7-*", pools: [h100-prefill]}

A worker entry may carry ``workers`` (glob patterns of the worker ids it may register) and
``pools`` (the pools it may register into): an agent's token then cannot register a worker
elsewhere in the fleet, nor take another's id. Everything a worker does after registering is
bound to the per-registration credential the registry answered, so it acts only on its own
record and on the KV sessions that name it.

A ``cert_name`` entry makes a client certificate an identity: a call that carries no token
over mutual TLS (the server has ``tls_client_ca_file``, so the certificate was verified
against that CA) is the principal whose ``cert_name`` equals the certificate's common name
or one of its DNS / URI subject alternative names. A token, when a call carries one,
decides; certificates only identify where the server checks them.

Unset, auth is off (development): every caller may do everything, and the services log
``auth_off`` at start. Callers present their token with :mod:`hpd_common.channels`.
"""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import hashlib
import os
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from hpd_common.errors import InvalidArgument
from hpd_common.logging import get_logger

log = get_logger("auth")


class Role(StrEnum):
    WORKER = "worker"
    GATEWAY = "gateway"
    SCHEDULER = "scheduler"
    OPERATOR = "operator"


@dataclass(frozen=True, slots=True)
class Principal:
    """A caller the tokens file names. A worker principal may be scoped: ``workers``, glob
    patterns (``fnmatch``) of the worker ids it may register, and ``pools``, the pools it
    may register into (empty: any)."""

    name: str
    role: Role
    workers: tuple[str, ...] = ()
    pools: tuple[str, ...] = ()

    @property
    def operator(self) -> bool:
        return self.role is Role.OPERATOR

    def may_register(self, worker_id: str, pool_id: str) -> str:
        """Why this principal may not register ``worker_id`` into ``pool_id`` ('' = it may)."""
        if self.workers and not any(fnmatch.fnmatchcase(worker_id, w) for w in self.workers):
            return f"{self.name} may register only worker ids matching {list(self.workers)}"
        if self.pools and pool_id not in self.pools:
            return f"{self.name} may register only into the pools {list(self.pools)}"
        return ""


READ = "read"  # a read-only RPC
W, G, S = Role.WORKER, Role.GATEWAY, Role.SCHEDULER

# Every RPC of every hetero-pd service: READ, or the roles (beside operator, who may do
# everything) allowed to call it. A method missing here is refused to everyone but
# operators, so a new RPC is closed until it is classified (and a test fails until then).
ACCESS: Mapping[str, str | frozenset[Role]] = {
    "RegistryService/RegisterWorker": frozenset({W}),
    "RegistryService/Heartbeat": frozenset({W}),
    "RegistryService/StreamHeartbeats": frozenset({W}),
    "RegistryService/DeregisterWorker": frozenset({W}),
    "RegistryService/DrainWorker": frozenset({W}),  # a worker: its own record only
    "RegistryService/CordonWorker": frozenset(),
    "RegistryService/UncordonWorker": frozenset(),
    "RegistryService/SendDirective": frozenset({S}),
    "RegistryService/ReportKvEvents": frozenset({W}),  # its own engine's, by credential
    "RegistryService/GetWorker": READ,
    "RegistryService/ListWorkers": READ,
    "RegistryService/ListPools": READ,
    "RegistryService/WatchWorkers": READ,
    "SchedulerService/Schedule": frozenset({G}),
    "SchedulerService/ScheduleStream": frozenset({G}),
    "SchedulerService/ReportOutcome": frozenset({G}),  # its own requests only
    "SchedulerService/ReloadPolicy": frozenset(),
    "SchedulerService/GetRouteRecord": READ,
    "SchedulerService/ListRouteRecords": READ,
    "SchedulerService/GetPolicy": READ,
    "SchedulerService/GetRecommendations": READ,
    "KvBrokerService/Negotiate": READ,
    "KvBrokerService/GetCompatibilityMatrix": READ,
    "KvBrokerService/OpenSession": frozenset({S}),
    "KvBrokerService/ReportProgress": frozenset({W, G}),  # the gateway runs transfers too
    "KvBrokerService/CompleteSession": frozenset({W, G}),
    "KvBrokerService/AbortSession": frozenset({W, S, G}),
    "KvBrokerService/GetSession": READ,
    "KvBrokerService/WatchSession": READ,
    "KvBrokerService/ListSessions": READ,
    "DiagnosticsService/Echo": READ,
    "DiagnosticsService/EchoRedis": READ,
}

# high-rate calls whose every instance would drown the audit trail (their effects are in
# the route records, the registry's change feed and the sessions)
NOT_AUDITED = frozenset(
    {
        "RegistryService/Heartbeat",
        "RegistryService/StreamHeartbeats",
        "RegistryService/ReportKvEvents",
        "SchedulerService/Schedule",
        "SchedulerService/ScheduleStream",
        "SchedulerService/ReportOutcome",
        "KvBrokerService/ReportProgress",
    }
)
_PACKAGE = "/hetero_pd.v1."


def method_key(full_method: str) -> str | None:
    """``/hetero_pd.v1.RegistryService/DrainWorker`` -> ``RegistryService/DrainWorker``;
    None for a method outside hetero-pd (health, reflection)."""
    if not full_method.startswith(_PACKAGE):
        return None
    return full_method[len(_PACKAGE) :]


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


PRINCIPAL: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "hpd_principal", default=None
)


def current() -> Principal | None:
    """The caller of the RPC being served; None when auth is off (or on an open read)."""
    return PRINCIPAL.get()


@contextlib.contextmanager
def acting_as(principal: Principal | None) -> Iterator[None]:
    """Serve an in-process call as ``principal``: one service calling another in its own
    process (``hpd up``) without the loopback RPC, whose server would have set the caller."""
    token = PRINCIPAL.set(principal)
    try:
        yield
    finally:
        PRINCIPAL.reset(token)


def may_act_for_others() -> bool:
    """Whether the caller may touch subjects that are not its own (an operator)."""
    p = PRINCIPAL.get()
    return p is not None and p.operator


class TokenBook:
    """The tokens file: token hash -> principal, certificate name -> principal."""

    def __init__(
        self, principals: Mapping[str, Principal], by_cert: Mapping[str, Principal] | None = None
    ) -> None:
        self._by_hash = dict(principals)
        self._by_cert = dict(by_cert or {})

    def __len__(self) -> int:
        return len(self._by_hash) + len(self._by_cert)

    @property
    def has_certificates(self) -> bool:
        return bool(self._by_cert)

    def lookup(self, token: str) -> Principal | None:
        return self._by_hash.get(hash_token(token)) if token else None

    def lookup_certificate(self, names: Sequence[str]) -> Principal | None:
        """The principal of a verified client certificate with these names (its common
        name, then its subject alternative names), or None."""
        for name in names:
            found = self._by_cert.get(name)
            if found is not None:
                return found
        return None

    @classmethod
    def load(cls, path: str | Path, field: str = "auth_tokens_file") -> TokenBook:
        p = Path(path)
        try:
            doc = yaml.safe_load(p.read_text())
        except OSError as exc:
            raise InvalidArgument(field, f"cannot read {p}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise InvalidArgument(field, f"{p} is not valid YAML: {exc}") from exc
        return cls.parse(doc, f"{field} ({p})")

    @classmethod
    def parse(cls, doc: Any, where: str) -> TokenBook:
        entries = doc.get("tokens") if isinstance(doc, dict) else None
        if not isinstance(entries, list) or not entries:
            raise InvalidArgument(
                where, "must hold `tokens:`, a list of {name, role, token | cert_name}"
            )
        out: dict[str, Principal] = {}
        by_cert: dict[str, Principal] = {}
        names: set[str] = set()
        for i, e in enumerate(entries):
            at = f"{where} tokens[{i}]"
            if not isinstance(e, dict):
                raise InvalidArgument(at, "must be a mapping of name, role and token")
            name, role = str(e.get("name") or ""), str(e.get("role") or "")
            if not name:
                raise InvalidArgument(at, "needs a name")
            if role not in set(Role):
                raise InvalidArgument(at, f"role {role!r} is not one of {[r.value for r in Role]}")
            token, digest, cert = e.get("token"), e.get("token_sha256"), e.get("cert_name")
            if sum(x is not None for x in (token, digest, cert)) != 1:
                raise InvalidArgument(at, "needs exactly one of token, token_sha256 and cert_name")
            if name in names:
                raise InvalidArgument(at, f"the name {name!r} appears twice")
            scope = _scope(e, at, Role(role))
            if cert is not None:
                if not str(cert).strip():
                    raise InvalidArgument(at, "cert_name must not be empty")
                if str(cert) in by_cert:
                    raise InvalidArgument(at, f"the cert_name {cert!r} appears twice")
                names.add(name)
                by_cert[str(cert)] = Principal(name, Role(role), *scope)
                continue
            if token is not None:
                if len(str(token)) < 16:
                    raise InvalidArgument(at, "a token must be at least 16 characters")
                digest = hash_token(str(token))
            digest = str(digest).lower()
            if len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest):
                raise InvalidArgument(at, "token_sha256 must be 64 hex digits")
            if digest in out:
                raise InvalidArgument(at, "the same token appears twice")
            names.add(name)
            out[digest] = Principal(name, Role(role), *scope)
        return cls(out, by_cert)


def _scope(
    entry: Mapping[str, Any], at: str, role: Role
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A worker entry's ``workers`` (id patterns) and ``pools``: a string or a list of them."""
    out: list[tuple[str, ...]] = []
    for key in ("workers", "pools"):
        v = entry.get(key)
        if v is None:
            out.append(())
            continue
        if role is not Role.WORKER:
            raise InvalidArgument(at, f"{key} scopes a worker token; a {role.value} has none")
        items = [v] if isinstance(v, str) else v
        if (
            not isinstance(items, list)
            or not items
            or not all(isinstance(x, str) and x.strip() for x in items)
        ):
            raise InvalidArgument(at, f"{key} must be a non-empty string or list of strings")
        out.append(tuple(x.strip() for x in items))
    return out[0], out[1]


def write_tokens_file(
    path: Path, roles: Sequence[Role] = tuple(Role), cert_names: Mapping[Role, str] | None = None
) -> dict[Role, str]:
    """A fresh tokens file with one random token per role (mode 0600), and the client
    certificate names in ``cert_names`` as identities of their roles; returns the tokens."""
    tokens = {role: secrets.token_urlsafe(32) for role in roles}
    entries: list[dict[str, str]] = [
        {"name": f"hpd-{r.value}", "role": r.value, "token": t} for r, t in tokens.items()
    ]
    entries += [
        {"name": f"hpd-{r.value}-certificate", "role": r.value, "cert_name": n}
        for r, n in (cert_names or {}).items()
    ]
    doc = {"tokens": entries}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# hetero-pd tokens: who may call what (see `hpd up --help`). Keep secret.\n")
        yaml.safe_dump(doc, f, sort_keys=False)
    return tokens


def read_tokens_file(path: Path) -> dict[Role, str]:
    """The plain tokens of a file ``write_tokens_file`` made, by role (first of each)."""
    doc = yaml.safe_load(path.read_text()) or {}
    out: dict[Role, str] = {}
    for e in doc.get("tokens", []):
        if isinstance(e, dict) and e.get("token") and e.get("role") in set(Role):
            out.setdefault(Role(e["role"]), str(e["token"]))
    return out
