"""The KV broker's settings (flags, environment, `hpd up`) and the KV policy they give."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpd_common.errors import InvalidArgument
from hpd_common.kvformat import KvPolicy
from hpd_common.server import ServerSettings
from hpd_common.settings import split_csv


@dataclass(frozen=True, slots=True)
class KvBrokerSettings(ServerSettings):
    port: int = field(default=50053, metadata={"help": "gRPC port of the KV broker"})
    key_prefix: str = field(default="hpd", metadata={"help": "prefix of the broker's Redis keys"})
    registry_key_prefix: str = field(
        default="hpd",
        metadata={"help": "the registry's key prefix (credentials and leases are read there)"},
    )
    registry_target: str = field(
        default="",
        metadata={
            "help": "registry host:port for the fleet feed (matrix, worker loss); "
            "empty = no feed (Negotiate and OpenSession read the registry's records in Redis)"
        },
    )
    scheduler_token: str = field(
        default="",
        metadata={
            "help": "secret the scheduler presents to open and abort sessions; empty = "
            "anyone may open and abort without a credential (development only)"
        },
    )
    gateway_token: str = field(
        default="",
        metadata={
            "help": "secret the gateway presents to report a session's progress, completion "
            "or failure; empty = anyone may (development only)"
        },
    )
    default_deadline_ms: int = field(default=30_000, metadata={"help": "session deadline if unset"})
    max_deadline_ms: int = field(default=600_000, metadata={"help": "longest session deadline"})
    lease_ttl_ms: int = field(
        default=5_000, metadata={"help": "default session lease (longest gap between reports)"}
    )
    min_lease_ttl_ms: int = field(default=100, metadata={"help": "shortest session lease"})
    max_lease_ttl_ms: int = field(default=120_000, metadata={"help": "longest session lease"})
    sweep_interval_ms: int = field(
        default=500, metadata={"help": "how often overdue sessions and lost workers are checked"}
    )
    retention_ms: int = field(
        default=600_000, metadata={"help": "how long terminal sessions are kept for inspection"}
    )
    feed_max_len: int = field(
        default=100_000, metadata={"help": "session-change feed entries kept"}
    )
    watch_poll_ms: int = field(
        default=2_000,
        metadata={"help": "a WatchSession stream re-reads its session when idle this long"},
    )
    allow_lossy_narrowing: bool = field(
        default=False, metadata={"help": "allow lossy KV dtype casts (e.g. bf16 -> fp8)"}
    )
    compatible_backends: str = field(
        default="",
        metadata={
            "help": "groups of attention backends that read each other's KV, "
            "e.g. 'flash_attn+flashinfer,xformers+sdpa'"
        },
    )


def policy_from(settings: KvBrokerSettings) -> KvPolicy:
    """The KV policy the settings describe; a group needs at least two backends."""
    groups = []
    for part in split_csv(settings.compatible_backends):
        names = frozenset(x.strip() for x in part.split("+") if x.strip())
        if len(names) < 2:
            raise InvalidArgument("compatible_backends", f"group {part!r} names fewer than two")
        groups.append(names)
    return KvPolicy(
        allow_lossy_narrowing=settings.allow_lossy_narrowing,
        compatible_backends=frozenset(groups),
    )
