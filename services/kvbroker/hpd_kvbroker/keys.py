"""Every Redis key the KV broker uses, built here and nowhere else.

All keys share the hash tag `{kv}`, so the Lua scripts, which touch several keys at once,
stay inside one slot on Redis Cluster. `<p>` is the configurable prefix (default `hpd`).
The scripts receive the fixed keys as KEYS; the per-session and per-worker prefixes below
are written into each store's copy of the scripts when it starts (`SessionStore._render`),
and the scripts append the id (`prefix .. id`). Nothing else spells a key.

| key                          | type   | holds |
|------------------------------|--------|-------|
| `<p>:{kv}:s:<session_id>`    | hash   | one session (fields below) |
| `<p>:{kv}:req:<request_id>`  | string | the session id opened for a request id (idempotency) |
| `<p>:{kv}:ids`               | zset   | every kept session id, score 0 (lex order: pagination) |
| `<p>:{kv}:due`               | zset   | open session id -> min(deadline, lease expiry) ms |
| `<p>:{kv}:done`              | zset   | terminal session id -> time it is purged (ms) |
| `<p>:{kv}:open:<worker_id>`  | set    | open sessions the worker is the source or destination of |
| `<p>:{kv}:busy`              | set    | workers with open sessions (leases checked) |
| `<p>:{kv}:feed`              | stream | one entry per session change: `sid` plus the hash fields |

Fields of a session hash: `sid`, `rid` (request id), `src`, `dst` (worker ids), `st`
(state name), `exb`, `done` (expected and moved bytes), `crt`, `upd`, `dl`, `lexp`
(created, updated, deadline, lease expiry; Unix ms), `ttl` (lease length ms), `why`
(reason), `ver` (version, +1 per change), `by` (who changed it last), `neg` (the
negotiation at open, JSON), `fp` (fingerprint of the open request, for idempotency).

Terminal sessions keep their hash, request key and feed history for `retention_ms`: the
sweeper purges them then, and the hash and request key also carry a Redis TTL of
retention plus a margin, so nothing outlives its retention even with no broker running.

The broker also reads (never writes) the two fields of the registry's worker hashes that
the registry names for it (`hpd_registry.keys.WORKER_CREDENTIAL_FIELD`, `WORKER_LEASE_FIELD`)
and judges the lease by the registry's own rule (`hpd_registry.scripts.LEASE_RULE`), to check
a caller's credential and a worker's lease inside the same script as the transition (an
RPC to the registry there would let a lease lapse between the check and the change). Those keys
carry the hash tag `{reg}`, so the broker and the registry must share one Redis server
(a single Redis or a Sentinel-managed primary); on Redis Cluster the two tags would have
to map to one node.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KvKeys:
    prefix: str = "hpd"

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{kv}}:"

    @property
    def session_prefix(self) -> str:
        return f"{self.base}s:"

    def session(self, session_id: str) -> str:
        return f"{self.session_prefix}{session_id}"

    @property
    def request_prefix(self) -> str:
        return f"{self.base}req:"

    def request(self, request_id: str) -> str:
        return f"{self.request_prefix}{request_id}"

    @property
    def ids(self) -> str:
        return f"{self.base}ids"

    @property
    def due(self) -> str:
        return f"{self.base}due"

    @property
    def done(self) -> str:
        return f"{self.base}done"

    @property
    def open_prefix(self) -> str:
        return f"{self.base}open:"

    def open_sessions(self, worker_id: str) -> str:
        return f"{self.open_prefix}{worker_id}"

    @property
    def busy(self) -> str:
        return f"{self.base}busy"

    @property
    def feed(self) -> str:
        return f"{self.base}feed"
