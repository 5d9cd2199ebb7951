"""Every Redis key the registry uses, built here and nowhere else.

All keys share the hash tag `{reg}` so that the Lua scripts, which touch several
keys at once, stay inside one slot on Redis Cluster. `<p>` is the configurable
prefix (default `hpd`), which lets several control planes share one Redis.

| key                         | type   | holds |
|-----------------------------|--------|-------|
| `<p>:{reg}:w:<worker_id>`   | hash   | one worker (fields below) |
| `<p>:{reg}:ids`             | zset   | every worker id, score 0 (lex order: pagination) |
| `<p>:{reg}:lease`           | zset   | worker id -> lease expiry (ms): the sweeper's input |
| `<p>:{reg}:hb`              | zset   | worker id -> suspect-at (ms): heartbeat + 2 intervals |
| `<p>:{reg}:lat`             | zset   | worker id -> load reported-at (ms): stale load |
| `<p>:{reg}:rev`             | string | the revision counter (INCR per change) |
| `<p>:{reg}:feed`            | stream | the change feed (below) |
| `<p>:{reg}:dir:<worker_id>` | list   | pending directives (JSON), oldest first |
| `<p>:{reg}:dirs`            | pubsub | a worker id with a new directive (wakes its stream) |
| `<p>:{reg}:grace`           | hash   | `from`, `until` (ms): after an outage (below) |
| `<p>:{reg}:kvev`            | stream | engines' prefix-cache events (below) |

After a Redis outage the sweeper writes `grace`: leases that ran out since `from` (the last
good sweep) stay live for heartbeats and are not swept until `until` (one default lease
after Redis answered again, or as long as the outage lasted if that is longer: a worker
reconnecting with exponential backoff may sleep about that long), since no heartbeat could
renew them meanwhile.

Fields of a worker hash: `spec` (capability JSON), `cred` (SHA-256 of the credential),
`load` (the last load report, see `store.encode_load`), `lat` (load reported-at ms), `reg`,
`hb`, `exp`, `ttl` (registered, last heartbeat, lease expiry, lease length; ms), `sus`,
`unh`, `drn`, `cor` (suspect, unhealthy, draining, cordoned; "0"/"1"), `why` (unhealthy
reason), `adm` (operator reason), `rev` (revision of the last change).

The feed: entry id `<revision>-0`; fields `t` (put, load, del) and `id`, plus the
worker's hash fields without `cred` (put), `load`, `lat`, `hb` (load), or `why` (del).
Capped at about `feed_max_len` entries; older revisions make a watcher resync.

The KV event feed (`ReportKvEvents`): fields `w` (worker id), `bt` (tokens per block) and
`ev`, a JSON list of `[kind, keys]` in the engine's order, kind `s` (stored, keys in chain
order), `h` (the same, the first key starting a prompt), `r` (removed) or `c` (all
cleared, no keys). Capped at about `kv_feed_max_len`
entries: a scheduler replica that starts replays what is left (older events are lost,
which can only make its prefix index miss blocks, never claim dropped ones).
"""

from __future__ import annotations

from dataclasses import dataclass

WORKER_CREDENTIAL_FIELD = "cred"
WORKER_LEASE_FIELD = "exp"
"""The two fields of a worker hash another service may read (the KV broker, in the same
script as a session's transition, with the registry's lease rule, `scripts.LEASE_RULE`):
the credential's hash and the lease expiry. Nothing outside the registry writes a worker
hash or reads its other fields."""


@dataclass(frozen=True, slots=True)
class RegistryKeys:
    prefix: str = "hpd"

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{reg}}:"

    def worker(self, worker_id: str) -> str:
        return f"{self.base}w:{worker_id}"

    @property
    def worker_prefix(self) -> str:
        return f"{self.base}w:"

    @property
    def ids(self) -> str:
        return f"{self.base}ids"

    @property
    def lease(self) -> str:
        return f"{self.base}lease"

    @property
    def heartbeats(self) -> str:
        return f"{self.base}hb"

    @property
    def load_times(self) -> str:
        return f"{self.base}lat"

    @property
    def revision(self) -> str:
        return f"{self.base}rev"

    @property
    def feed(self) -> str:
        return f"{self.base}feed"

    def directives(self, worker_id: str) -> str:
        return f"{self.base}dir:{worker_id}"

    @property
    def directive_prefix(self) -> str:
        return f"{self.base}dir:"

    @property
    def grace(self) -> str:
        return f"{self.base}grace"

    @property
    def kv_events(self) -> str:
        return f"{self.base}kvev"

    @property
    def directive_channel(self) -> str:
        return f"{self.base}dirs"
