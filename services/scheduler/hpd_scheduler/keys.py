"""Every Redis key the scheduler uses, built here and nowhere else.

All keys share the hash tag `{sch}`, so each Lua script (which touches several keys at
once) stays inside one slot on Redis Cluster. `<p>` is the configurable prefix (default
`hpd`); replicas that should share reservations must use the same prefix.

- `<p>:{sch}:tot` (hash): live reservation totals per worker, fields `k:<worker>` (KV
  bytes), `n:<worker>` (queue slots), `t:<worker>` (pending prefill tokens);
- `<p>:{sch}:res` (hash): request id -> `decode|kv_bytes|prefill|prefill_tokens`, one
  live reservation per request;
- `<p>:{sch}:exp` (zset): request id -> reservation expiry (ms); lapsed entries are
  purged from `tot` and `res`;
- `<p>:{sch}:rec:<request>` (hash, TTL = record TTL): the route record, fields `p` (the
  head: plan JSON, also the idempotency key), `d` (decision), `x` (explanation JSON), `o`
  (outcome JSON);
- `<p>:{sch}:idx` (zset): request id -> created-at (ms), the bounded index of recent
  records; a record pushed out of it past the cap (`record_index_cap`) is deleted too,
  once it is older than the reservation TTL, so records take at most about
  cap x record size (a few KB with its explanation) whatever the request rate.
- `<p>:{sch}:learn:<key>` (list, at most the learner's window x 2, JSON samples oldest
  first): what outcomes measured of a worker's prefill (`p:<worker>`), shared by every
  replica (`hpd_scheduler.learn_store`); `<p>:{sch}:learnv` (hash) key -> a version bumped
  with every sample, so a replica reads only the lists that changed;
- `<p>:{sch}:dir:<worker>:<kind>` (string, TTL = directive repeat interval): the last
  directive value of that kind sent to the worker by any replica.

A reservation is written, checked and released only by the Lua scripts in `store.py`, so
`tot` is always the sum of the live entries of `res` (up to entries not yet purged, which
only ever make the check stricter).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerKeys:
    prefix: str = "hpd"

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{sch}}:"

    @property
    def totals(self) -> str:
        return f"{self.base}tot"

    @property
    def reservations(self) -> str:
        return f"{self.base}res"

    @property
    def expiry(self) -> str:
        return f"{self.base}exp"

    def record(self, request_id: str) -> str:
        return f"{self.base}rec:{request_id}"

    @property
    def index(self) -> str:
        return f"{self.base}idx"

    def learned(self, key: str) -> str:
        return f"{self.base}learn:{key}"

    @property
    def learned_versions(self) -> str:
        return f"{self.base}learnv"

    def directive(self, worker_id: str, kind: str) -> str:
        return f"{self.base}dir:{worker_id}:{kind}"
