"""The scheduler's settings and its policy document (a built-in profile or a file, with an
optional tiers file), validated at start-up and on reload."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from hpd_common.errors import InvalidArgument
from hpd_common.server import ServerSettings
from hpd_common.yamlsafe import YamlLimitError, load_bounded
from hpd_scheduler.group_commit import GroupCommitSettings
from hpd_scheduler.policy import (
    ConfigError,
    InvalidInputError,
    Planner,
    Profile,
    builtin_profile_names,
    parse_profile,
)


@dataclass(frozen=True, slots=True)
class SchedulerSettings(ServerSettings):
    port: int = field(default=50052, metadata={"help": "gRPC port of the scheduler"})
    key_prefix: str = field(
        default="hpd", metadata={"help": "prefix of the scheduler's Redis keys"}
    )
    registry_target: str = field(
        default="127.0.0.1:50051", metadata={"help": "registry host:port (fleet feed, directives)"}
    )
    broker_target: str = field(
        default="",
        metadata={"help": "KV broker host:port; empty = plan transfers without sessions"},
    )
    broker_token: str = field(
        default="", metadata={"help": "scheduler token the KV broker expects (if it has one)"}
    )
    broker_timeout_ms: int = field(
        default=250, metadata={"help": "OpenSession deadline; past it the plan recomputes"}
    )
    profile: str = field(
        default="default", metadata={"help": "built-in profile name or path of a profile YAML"}
    )
    tiers_file: str = field(
        default="", metadata={"help": "YAML of serving tiers replacing the profile's `tiers`"}
    )
    staleness_bound_ms: int = field(
        default=5_000, metadata={"help": "older fleet view: NOT_SERVING and Schedule UNAVAILABLE"}
    )
    reservation_ttl_ms: int = field(
        default=120_000, metadata={"help": "a reservation lapses unless released before"}
    )
    record_ttl_ms: int = field(
        default=3_600_000, metadata={"help": "route records (and idempotency) are kept this long"}
    )
    record_index_cap: int = field(
        default=100_000,
        metadata={
            "help": "most route records kept: older ones are deleted (never one younger "
            "than reservation_ttl_ms), so Redis holds at most about this many"
        },
    )
    fleet_rebuild_interval_ms: int = field(
        default=20, metadata={"help": "fleet changes coalesce into one rebuild per interval"}
    )
    fleet_refresh_ms: int = field(
        default=1_000, metadata={"help": "rebuild at least this often (report confidence ages)"}
    )
    reservation_sync_interval_ms: int = field(
        default=250, metadata={"help": "how often other replicas' reservations are read"}
    )
    max_plan_attempts: int = field(
        default=4, metadata={"help": "re-plans when the chosen worker was fully reserved"}
    )
    ewma_alpha: float = field(
        default=0.2, metadata={"help": "weight of a new outcome in the decaying averages"}
    )
    directive_interval_ms: int = field(
        default=10_000, metadata={"help": "how often recommendations become directives (0 = off)"}
    )
    directive_repeat_ms: int = field(
        default=300_000, metadata={"help": "an unchanged directive is not resent within this"}
    )
    directive_max_per_cycle: int = field(
        default=32, metadata={"help": "most directives sent per cycle"}
    )
    informer_max_backoff_ms: int = field(
        default=2_000, metadata={"help": "longest wait between registry reconnects"}
    )
    group_commit_max_batch: int = field(
        default=64,
        metadata={
            "help": "most Schedule reservations written in one script call (group commit; "
            "1 = off, every call its own)"
        },
    )
    group_commit_wait_us: int = field(
        default=200,
        metadata={
            "help": "longest a reservation waits for the batch in flight before a second "
            "batch goes (0 = only when the batch in flight answers or the batch is full)"
        },
    )
    stream_max_in_flight: int = field(
        default=256,
        metadata={
            "help": "most requests of one ScheduleStream decided at a time (no more are read "
            "until one is answered)"
        },
    )
    processes: int = field(
        default=1,
        metadata={
            "help": "scheduler processes serving this port (SO_REUSEPORT), one per core: each "
            "with its own fleet view, sharing Redis like replicas; needs a fixed --port; "
            "metrics of process i on metrics_port + i"
        },
    )
    scheduler_id: str = field(default="", metadata={"help": "replica name in route records"})
    seed: int = field(default=0, metadata={"help": "seed of the planner's tie-breaking RNG"})

    def validate(self) -> None:
        """Refuse inconsistent settings at start-up, naming the setting."""
        positive = (
            "staleness_bound_ms",
            "reservation_ttl_ms",
            "record_ttl_ms",
            "record_index_cap",
            "fleet_refresh_ms",
            "reservation_sync_interval_ms",
            "max_plan_attempts",
            "broker_timeout_ms",
            "stream_max_in_flight",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise InvalidArgument(name, "must be > 0")
        if self.fleet_rebuild_interval_ms < 0 or self.directive_interval_ms < 0:
            raise InvalidArgument("fleet_rebuild_interval_ms", "must be >= 0")
        if self.record_ttl_ms < self.reservation_ttl_ms:
            raise InvalidArgument(
                "record_ttl_ms", "must be >= reservation_ttl_ms (the record is the idempotency key)"
            )
        if not 0 < self.ewma_alpha <= 1:
            raise InvalidArgument("ewma_alpha", "must be in (0, 1]")
        if not 1 <= self.processes <= 256:
            raise InvalidArgument("processes", "must be within 1..256")
        try:
            self.group_commit().validate()
        except ValueError as exc:
            name = str(exc).split()[0]
            raise InvalidArgument(name, str(exc).removeprefix(name).strip()) from None

    def group_commit(self) -> GroupCommitSettings:
        return GroupCommitSettings(self.group_commit_max_batch, self.group_commit_wait_us)


def profile_document(ref: str) -> str:
    """The YAML text of a built-in profile name or a profile file path."""
    if ref in builtin_profile_names():
        res = resources.files("hpd_scheduler.policy") / "profiles" / f"{ref}.yaml"
        return res.read_text(encoding="utf-8")
    try:
        return Path(ref).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            "profile", f"no built-in profile or readable file {ref!r}: {exc.strerror}"
        ) from None


def parse_policy(text: str, tiers_text: str = "") -> tuple[Profile, str]:
    """Validate a profile document (with optional tiers replacing its own). Raises
    ConfigError naming the offending key."""
    try:
        doc = load_bounded(text)
        if tiers_text:
            tiers = load_bounded(tiers_text)
            if not isinstance(tiers, dict):
                raise ConfigError("tiers", "the tiers file must hold a mapping")
            if not isinstance(doc, dict):
                raise ConfigError("profile", "must be a mapping")
            doc["tiers"] = tiers.get("tiers", tiers)
            text = yaml.safe_dump(doc, sort_keys=False)
    except YamlLimitError as exc:
        raise ConfigError("profile", f"refused: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError("profile", f"invalid YAML: {exc}") from None
    try:
        return parse_profile(doc), text
    except InvalidInputError as exc:
        raise ConfigError(exc.field, exc.message) from None
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError("profile", f"malformed document: {exc}") from None


@dataclass(frozen=True, slots=True)
class PolicyState:
    """The profile in force, its planner and where it came from."""

    profile: Profile
    planner: Planner
    source_yaml: str
    generation: int
    loaded_at_ms: int
