"""The registry's settings (flags, environment, `hpd up`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpd_common.server import ServerSettings


@dataclass(frozen=True, slots=True)
class RegistrySettings(ServerSettings):
    port: int = field(default=50051, metadata={"help": "gRPC port of the registry"})
    key_prefix: str = field(default="hpd", metadata={"help": "prefix of every Redis key"})
    lease_ttl_ms: int = field(default=10_000, metadata={"help": "default worker lease"})
    min_lease_ttl_ms: int = field(default=300, metadata={"help": "shortest lease a worker may ask"})
    max_lease_ttl_ms: int = field(
        default=300_000, metadata={"help": "longest lease a worker may ask"}
    )
    sweep_interval_ms: int = field(default=1_000, metadata={"help": "how often leases are checked"})
    load_stale_ms: int = field(
        default=30_000, metadata={"help": "a load report older than this makes a worker SUSPECT"}
    )
    feed_max_len: int = field(default=100_000, metadata={"help": "change-feed entries kept"})
    kv_feed_max_len: int = field(
        default=200_000,
        metadata={"help": "KV cache event batches kept for scheduler replicas to replay"},
    )
    bookmark_interval_ms: int = field(
        default=1_000, metadata={"help": "idle watch streams get a bookmark this often"}
    )
    watch_queue_max: int = field(
        default=20_000, metadata={"help": "events buffered per watcher before it must resync"}
    )
