"""The link model: bandwidth and latency between two workers.

The seed budgets the network with one fixed 100 ms; here the hand-off estimate uses the link
the pair would actually use. A link is classified by locality (same host, same rack, same
zone, cross-zone) with default figures per class, and any (prefill pool, decode pool) pair can
be overridden, e.g. a known slow cross-zone link or an NVLink-connected pair.

Effective bandwidth of a pair = min(link class bandwidth, source NIC, destination NIC), in
Gb/s. Same host counts the intra-node fabric, so the NICs do not cap it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from .domain import WorkerView
from .errors import InvalidInputError

__all__ = ["Link", "LinkModel", "Locality", "locality"]


class Locality(enum.StrEnum):
    """How close two workers are."""

    SAME_HOST = "same_host"
    SAME_RACK = "same_rack"
    SAME_ZONE = "same_zone"
    CROSS_ZONE = "cross_zone"


@dataclass(frozen=True, slots=True)
class Link:
    """Bandwidth (Gb/s) and one-way setup latency (ms) of a link."""

    gbps: float
    latency_ms: float

    def __post_init__(self) -> None:
        if not self.gbps > 0:
            raise InvalidInputError("link.gbps", f"must be > 0, got {self.gbps}")
        if self.latency_ms < 0:
            raise InvalidInputError("link.latency_ms", f"must be >= 0, got {self.latency_ms}")

    def transfer_ms(self, nbytes: float) -> float:
        """``nbytes x 8 / (gbps x 10^6) + latency_ms``: ms to move ``nbytes`` over this link
        (Gb/s are decimal: 10^9 bit/s, so 10^6 bit per ms per Gb/s)."""
        return nbytes * 8.0 / (self.gbps * 1e6) + self.latency_ms

    def ms_per_byte(self) -> float:
        """``8 / (gbps x 10^6)``: the bandwidth term of :meth:`transfer_ms` per byte, for a
        caller that prices many sizes over one link (``Fleet.handoff_terms``)."""
        return 8.0 / (self.gbps * 1e6)


_DEFAULT_CLASSES: dict[Locality, Link] = {
    Locality.SAME_HOST: Link(gbps=1600.0, latency_ms=0.01),
    Locality.SAME_RACK: Link(gbps=400.0, latency_ms=0.05),
    Locality.SAME_ZONE: Link(gbps=200.0, latency_ms=0.2),
    Locality.CROSS_ZONE: Link(gbps=25.0, latency_ms=2.0),
}


def locality(a: WorkerView, b: WorkerView) -> Locality:
    """Locality of two workers from their zone / rack / host labels (empty = unknown)."""
    la, lb = a.network, b.network
    if la.zone != lb.zone:
        return Locality.CROSS_ZONE
    if la.host and la.host == lb.host and la.rack == lb.rack:
        return Locality.SAME_HOST
    if la.rack and la.rack == lb.rack:
        return Locality.SAME_RACK
    return Locality.SAME_ZONE


@dataclass(frozen=True, slots=True)
class LinkModel:
    """Link figures by locality class, overridable per (source pool, destination pool).

    ``pool_overrides`` keys are ``(prefill_pool_id, decode_pool_id)``; an override replaces
    the class figures and is still capped by the two NICs unless the pair shares a host.
    """

    classes: Mapping[Locality, Link] = field(default_factory=lambda: dict(_DEFAULT_CLASSES))
    pool_overrides: Mapping[tuple[str, str], Link] = field(default_factory=dict)

    def between(self, src: WorkerView, dst: WorkerView) -> tuple[Locality, Link]:
        """The effective link from ``src`` to ``dst`` (NIC-capped), with its locality."""
        loc = locality(src, dst)
        link = self.pool_overrides.get((src.pool_id, dst.pool_id))
        if link is None:
            link = self.classes.get(loc) or _DEFAULT_CLASSES[loc]
        if loc is Locality.SAME_HOST:
            return loc, link
        cap = min(src.network.nic_or_assumed_gbps, dst.network.nic_or_assumed_gbps)
        if cap > 0 and cap < link.gbps:
            link = Link(gbps=cap, latency_ms=link.latency_ms)
        return loc, link

    @classmethod
    def from_dict(cls, data: Mapping[str, object], key_path: str = "links") -> LinkModel:
        """Build from ``{classes: {same_rack: {gbps, latency_ms}}, pools: [{src, dst, gbps,
        latency_ms}]}``; raise :class:`InvalidInputError` naming the bad key."""
        classes: dict[Locality, Link] = dict(_DEFAULT_CLASSES)
        raw_classes = data.get("classes", {}) or {}
        if not isinstance(raw_classes, Mapping):
            raise InvalidInputError(f"{key_path}.classes", "must be a mapping")
        for name, spec in raw_classes.items():
            try:
                loc = Locality(str(name))
            except ValueError:
                raise InvalidInputError(
                    f"{key_path}.classes.{name}", f"unknown locality; one of {list(Locality)}"
                ) from None
            classes[loc] = _link_from(spec, f"{key_path}.classes.{name}")
        overrides: dict[tuple[str, str], Link] = {}
        raw_pools = data.get("pools", []) or []
        if not isinstance(raw_pools, list):
            raise InvalidInputError(f"{key_path}.pools", "must be a list")
        for i, spec in enumerate(raw_pools):
            path = f"{key_path}.pools[{i}]"
            if not isinstance(spec, Mapping) or "src" not in spec or "dst" not in spec:
                raise InvalidInputError(path, "needs src and dst pool ids")
            overrides[(str(spec["src"]), str(spec["dst"]))] = _link_from(spec, path)
        return cls(classes=classes, pool_overrides=overrides)


def _link_from(spec: object, path: str) -> Link:
    if not isinstance(spec, Mapping):
        raise InvalidInputError(path, "must be a mapping with gbps and latency_ms")
    try:
        gbps = float(spec["gbps"])
        latency = float(spec.get("latency_ms", 0.0))
    except (KeyError, TypeError, ValueError):
        raise InvalidInputError(path, "gbps and latency_ms must be numbers") from None
    try:
        return Link(gbps=gbps, latency_ms=latency)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{path}.{exc.field.split('.')[-1]}", exc.message) from None
