"""The fleet snapshot: worker views plus the indexes that make one decision cheap.

Built once per fleet change (``Fleet.build``), shared by every decision until the next
change. What it precomputes, so that a decision never walks the whole fleet:

* per worker: capacity (``capacity.py``), observed corrections, schedulability;
* per (model, role): the eligible workers, the workers dropped by the static execution gate
  (health, stage, model, unknown GPU) with their reasons, per-pool reasons, the largest
  prefill throughput and memory bandwidth (for capacity scorers), aggregate KV memory (for
  memory pressure);
* per (model, role, key): the eligible workers sorted by a cheap preselection key, computed
  lazily on first use. ``top_k`` then walks that order and stops at the k-th worker the
  request's filters keep, so a decision touches O(k) workers in the common case and never
  more than ``max_scan``.

Reservations made after the snapshot was built go through :meth:`Fleet.reserve` /
:meth:`Fleet.release`, which also move the worker to its new place in every sorted order
already built (a bisect and a list move per order: keys depend only on the worker's own
figures and reservations). The orders therefore hold live keys, and the walk stays O(k)
however many reservations pile up between rebuilds. With keys left at their snapshot values
(lower bounds, re-checked per worker), a scheduler holding many reservations scanned ever
deeper: at 256 workers, about 260 us per decision with no reservations and 700-800 us after
1,500 unreleased ones, against about 300-360 us now.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Collection, Container, Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from hpd_common.kvformat import DEFAULT_KV_POLICY, GIB, KvFormat, KvPolicy, Negotiation, negotiate

from .capacity import Capacity, StalenessPolicy, capacity_for, resolve_gpu
from .domain import Role, Stage, WorkerView
from .errors import InvalidInputError
from .links import Link, LinkModel
from .mechanisms import health_reason, kv_reasons, kv_transferable
from .worker_state import WorkerState

__all__ = ["PRESELECT_KEYS", "Fleet", "ModelIndex", "WorkerState"]

_ROLES = (Role.PREFILL, Role.DECODE)
_MISS: object = object()


def _key_capacity_prefill(ws: WorkerState, ref_tokens: int) -> float:
    return ws.prefill_wait_ms() + ws.prefill_ms(ref_tokens)


def _key_capacity_decode(ws: WorkerState, ref_tokens: int) -> float:
    extra = (ws.queue_depth() + 1) * ref_tokens
    return ws.step_ms(extra) / max(0.05, 1.0 - ws.kv_used_fraction())


def _key_blind(ws: WorkerState, ref_tokens: int) -> float:
    del ref_tokens
    return ws.queue_depth() + 4.0 * ws.kv_used_fraction()


KeyFn = Callable[[WorkerState, int], float]

PRESELECT_KEYS: Mapping[str, tuple[KeyFn, KeyFn]] = {
    "capacity": (_key_capacity_prefill, _key_capacity_decode),
    "blind": (_key_blind, _key_blind),
}
"""Preselection keys, lower is better, (prefill, decode):

* ``capacity``: prefill = queued work in ms of this worker's throughput + its time for a
  reference prompt; decode = predicted step ms with the queue admitted, divided by the free
  KV share (``max(0.05, 1 - used)``) so nearly full workers sink.
* ``blind``: queue depth + 4 x KV used share, the same for every GPU (capacity-blind, what a
  plain least-loaded router does).

Both depend only on the worker's own figures and reservations, so ``Fleet.reserve`` and
``Fleet.release`` can keep every sorted order exact by moving that one worker.
"""


@dataclass(slots=True)
class ModelIndex:
    """Eligible workers of one model for one role, and why the others were dropped."""

    model_id: str
    role: Role
    workers: list[WorkerState] = field(default_factory=list)
    static_drops: list[tuple[str, str, str]] = field(default_factory=list)
    pools: dict[str, int] = field(default_factory=dict)
    max_prefill_tps: float = 0.0
    max_hbm_gbps: float = 0.0
    kv_total: int = 0
    kv_avail: int = 0
    sorted_by: dict[str, list[tuple[float, int, WorkerState]]] = field(default_factory=dict)
    # per key of sorted_by: each worker's key value as placed in that order (by WorkerState.idx)
    keys_of: dict[str, dict[int, float]] = field(default_factory=dict)
    shared: list[WorkerState] = field(default_factory=list)

    def rejected_pools(self) -> dict[str, tuple[str, ...]]:
        """Pools with no eligible worker, mapped to the distinct reasons of their workers."""
        out: dict[str, set[str]] = {}
        for _wid, pool, reason in self.static_drops:
            if self.pools.get(pool, 0) == 0:
                out.setdefault(pool, set()).add(reason)
        return {p: tuple(sorted(r)) for p, r in out.items()}


def plausible(cap: Capacity) -> bool:
    """Every figure the planner divides by or multiplies with is finite and positive (a
    capacity from, say, a subnormal peak TFLOPs would divide by zero downstream)."""
    figures = (
        cap.prefill_tps,
        cap.weights_ms,
        cap.floor_ms,
        cap.hbm_gbps_total,
        float(cap.kv_bytes_per_token),
    )
    if not all(math.isfinite(x) and x > 0 for x in figures):
        return False
    return all(math.isfinite(x) and x >= 0 for x in (cap.lin_ms, cap.quad_ms, cap.kv_ms_per_token))


def kv_can_flow(src: WorkerView, dst: WorkerView) -> bool:
    """False when the engines' KV connectors cannot move KV this way: the ``kv-role`` label
    (set by ``hpd agent``) of the source is ``consumer`` or the destination's ``producer``
    (vLLM's ``kv_consumer`` / ``kv_producer``), or either side's is ``none`` (no connector).
    No label: no constraint."""
    return src.labels.get("kv-role") not in _NO_SEND and dst.labels.get("kv-role") not in _NO_TAKE


_NO_SEND = frozenset({"consumer", "none"})
_NO_TAKE = frozenset({"producer", "none"})


@lru_cache(maxsize=1024)
def _negotiate(src: KvFormat, dst: KvFormat, policy: KvPolicy) -> Negotiation:
    return negotiate(src, dst, policy)


HandoffTerms = tuple[float, float, float, tuple[str, ...]]
"""(ms per byte over the link, link latency ms, conversion ms per byte, reasons)."""

_MAX_CLASSES = 65_536
_MAX_PAIRS = 1 << 20
"""Link classes and cached class pairs a snapshot carries over from the one before; past
either (workers with ever new labels, a fleet of very many classes) the next snapshot starts
its caches afresh, so they stay bounded (a pair entry is a few hundred bytes)."""


def _capacity_of(
    view: WorkerView, prior: WorkerState | None, ref_prompt_tokens: int
) -> tuple[Capacity | None, str | None]:
    """A worker's capacity (reused from the previous snapshot when its spec is the very same
    object: capacity is a function of the spec alone, and a spec is immutable), or None with
    the reason it is left out."""
    if prior is not None and prior.view.spec is view.spec:
        return prior.cap, None
    gpu = resolve_gpu(view)
    if gpu is None:
        return None, "unknown_gpu_profile"
    cap: Capacity | None
    try:
        cap = capacity_for(view, gpu, ref_prompt_tokens)
    except (ArithmeticError, ValueError):
        cap = None
    if cap is None or not plausible(cap):
        # figures that make no sense leave this worker out, with its reason: never an error
        # for every request of its model
        return None, "implausible_capacity"
    return cap, None


class Fleet:
    """An immutable-by-convention snapshot of the fleet, with indexes (module docstring)."""

    __slots__ = (
        "_classes",
        "_handoff_cache",
        "_model_kv",
        "built_at_s",
        "by_id",
        "indexes",
        "kv_policy",
        "links",
        "prefix_heads",
        "ref_output_tokens",
        "ref_tokens",
        "staleness",
        "states",
    )

    def __init__(self) -> None:
        self.states: list[WorkerState] = []
        self.by_id: dict[str, WorkerState] = {}
        self.indexes: dict[tuple[str, Role], ModelIndex] = {}
        self.links = LinkModel()
        self.kv_policy = DEFAULT_KV_POLICY
        self.staleness = StalenessPolicy()
        self.ref_tokens = 1024
        # the traffic's mean expected output: how long a running sequence lives, so how fast
        # a full batch frees a slot (WorkerState.admission_wait_ms); 0: unknown
        self.ref_output_tokens = 0
        self.built_at_s = 0.0
        self.prefix_heads: Mapping[int, Collection[str]] | None = None
        self._model_kv: dict[str, int] = {}
        self._classes: dict[tuple[object, ...], int] = {}
        self._handoff_cache: dict[tuple[int, int, bool], HandoffTerms | None] = {}

    @classmethod
    def build(
        cls,
        workers: Iterable[WorkerView],
        now_s: float,
        links: LinkModel | None = None,
        kv_policy: KvPolicy = DEFAULT_KV_POLICY,
        staleness: StalenessPolicy | None = None,
        ref_prompt_tokens: int = 1024,
        previous: Fleet | None = None,
        ref_output_tokens: int = 0,
        prefix: Mapping[str, tuple[int, Container[int]]] | None = None,
        prefix_heads: Mapping[int, Collection[str]] | None = None,
        known_prefills: Mapping[str, int] | None = None,
        inbound_transfers: Mapping[str, int] | None = None,
    ) -> Fleet:
        """Index ``workers`` as of ``now_s``. Duplicate worker ids raise
        :class:`InvalidInputError`. Cost: O(N) plus one sort per preselection key used.

        ``previous``: the snapshot this one replaces. A worker whose spec is the very same
        object there (its load may have changed, its capability not) keeps its resolved GPU
        and capacity, the costly part of its entry, when the reference prompt is the same: a
        service rebuilding every second, or a simulator building a view per decision, pays
        for the workers whose capability changed.

        ``prefix``: per worker id, its engine's tokens per block and the prefix keys it holds
        (``PrefixIndex.entries``: live views, so the snapshot sees blocks stored after it
        was built). ``prefix_heads``: per prompt-start key, the workers holding it
        (``PrefixIndex.heads``), so a decision finds a prompt's holders without a scan.
        ``known_prefills``: per worker id, how many of the prefills its load report shows
        waiting or running are plans the scheduler counts by their true prompt tokens (its
        reservations, or the view's ``pending_prefill_tokens``), so the report's queue is
        priced at the traffic's mean prompt only beyond them. ``inbound_transfers``: per
        decode worker id, the transfers on their way to it whose prefill elsewhere is not
        done (``WorkerState.backlog_tokens`` says how both count). ``ref_output_tokens``:
        the traffic's mean expected output, 0 when unknown (the attribute says its use)."""
        fleet = cls()
        fleet.links = links or LinkModel()
        fleet.kv_policy = kv_policy
        fleet.staleness = staleness or StalenessPolicy()
        fleet.ref_tokens = ref_prompt_tokens
        fleet.ref_output_tokens = max(0, ref_output_tokens)
        fleet.built_at_s = now_s
        fleet.prefix_heads = prefix_heads
        same_ref = previous is not None and previous.ref_tokens == ref_prompt_tokens
        reuse = previous.by_id if previous is not None and same_ref else {}
        if (
            previous is not None
            and previous.links is fleet.links
            and previous.kv_policy == kv_policy
            and len(previous._classes) <= _MAX_CLASSES
            and len(previous._handoff_cache) <= _MAX_PAIRS
        ):  # the same figures: the pair classes' hand-off terms still hold
            fleet._classes = previous._classes
            fleet._handoff_cache = previous._handoff_cache
        roles = (Role.PREFILL, Role.DECODE)
        for view in workers:
            if view.worker_id in fleet.by_id:
                raise InvalidInputError("worker_id", f"duplicate worker {view.worker_id!r}")
            cap, reason = _capacity_of(view, reuse.get(view.worker_id), ref_prompt_tokens)
            if reason is None:
                reason = health_reason(view.health)
            ws: WorkerState | None = None
            if cap is not None:
                wid = view.worker_id
                ws = WorkerState(
                    view, cap, len(fleet.states), now_s, fleet.staleness, ref_prompt_tokens,
                    known_prefills.get(wid, 0) if known_prefills else 0,
                    inbound_transfers.get(wid, 0) if inbound_transfers else 0,
                )  # fmt: skip
                ws.link_class = fleet._link_class(view)
                if prefix is not None:
                    entry = prefix.get(view.worker_id)
                    if entry is not None:
                        ws.held_block_tokens, ws.held = entry
                fleet.states.append(ws)
                fleet.by_id[view.worker_id] = ws
            for role in roles:
                if view.stage.serves(role):
                    fleet._index(view, role, ws, reason)
        return fleet

    def _index(
        self, view: WorkerView, role: Role, ws: WorkerState | None, reason: str | None
    ) -> None:
        """Add a worker to its (model, role) index: as a candidate, or among the static
        drops with its reason."""
        index = self.indexes.get((view.model_id, role))
        if index is None:
            index = ModelIndex(view.model_id, role)
            self.indexes[(view.model_id, role)] = index
        index.pools.setdefault(view.pool_id, 0)
        if reason is not None or ws is None:
            index.static_drops.append((view.worker_id, view.pool_id, reason or "?"))
            return
        index.workers.append(ws)
        index.pools[view.pool_id] += 1
        index.max_prefill_tps = max(index.max_prefill_tps, ws.cap.prefill_tps)
        index.max_hbm_gbps = max(index.max_hbm_gbps, ws.cap.hbm_gbps_total)
        if role is Role.DECODE:
            index.kv_total += ws.kv_total
            index.kv_avail += ws.kv_avail
            if view.stage is Stage.BOTH:
                index.shared.append(ws)

    # -- lookups ----------------------------------------------------------------------------

    def index(self, model_id: str, role: Role) -> ModelIndex | None:
        """The (model, role) index, None when no worker ever registered for it."""
        return self.indexes.get((model_id, role))

    def worker(self, worker_id: str) -> WorkerState | None:
        """A worker's state by id (eligible or not, as long as its GPU resolved)."""
        return self.by_id.get(worker_id)

    def memory_pressure(self, model_id: str) -> float:
        """Used / total KV memory over the model's eligible decode workers, reservations
        included; 1.0 when there is no decode memory at all."""
        index = self.indexes.get((model_id, Role.DECODE))
        if index is None or index.kv_total <= 0:
            return 1.0
        live = self._model_kv.get(index.model_id, 0)
        return min(1.0, max(0.0, 1.0 - (index.kv_avail - live) / index.kv_total))

    def link(self, src: WorkerState, dst: WorkerState) -> Link:
        """Effective link from ``src`` to ``dst``."""
        return self.links.between(src.view, dst.view)[1]

    def negotiation(self, src: WorkerState, dst: WorkerState) -> Negotiation:
        """KV negotiation of the pair's formats (shared rules, cached per format pair)."""
        return _negotiate(src.view.kv_format, dst.view.kv_format, self.kv_policy)

    def handoff_terms(self, src: WorkerState, dst: WorkerState) -> HandoffTerms | None:
        """Per-byte hand-off figures for the pair:
        ``(ms per byte over the link, link latency ms, conversion ms per byte, reasons)``,
        or None when the KV formats cannot be exchanged, or the engines' connectors do not
        move KV this way (:func:`kv_can_flow`): the decode side must recompute.
        ``transfer_ms(bytes) = bytes x (link + conversion ms per byte) + latency``.

        Cached per pair of link classes (:meth:`_link_class`: everything the figures depend
        on but the host) and whether the two share a host, and carried to the next snapshot
        while the link model and KV policy are the same: a worker first paired in a decision
        (a prefix holder outside the usual top k) costs a lookup, not a negotiation and a link
        resolution (about 3 us a pair, measured by bench/kv_index.py's decision p99)."""
        key = (src.link_class, dst.link_class, bool(src.host) and src.host == dst.host)
        hit = self._handoff_cache.get(key, _MISS)
        if hit is not _MISS:
            return hit  # type: ignore[return-value]
        neg = _negotiate(src.view.kv_format, dst.view.kv_format, self.kv_policy)
        flows = kv_can_flow(src.view, dst.view)
        terms: HandoffTerms | None = None
        if kv_transferable(neg, flows):  # the KV gate (mechanisms.py)
            link = self.link(src, dst)
            conv = neg.cost_ms_per_gib / GIB
            terms = (link.ms_per_byte(), link.latency_ms, conv, kv_reasons(neg, flows))
        self._handoff_cache[key] = terms
        return terms

    def _link_class(self, view: WorkerView) -> int:
        """An id shared by workers whose hand-off figures to and from any worker are the same
        (pool, KV format, connector direction, zone, rack, NIC), except for sharing a host,
        which :meth:`handoff_terms` checks per pair."""
        loc = view.network
        sig = (
            view.pool_id, view.kv_format, view.labels.get("kv-role"),
            loc.zone, loc.rack, loc.nic_or_assumed_gbps,
        )  # fmt: skip
        got = self._classes.get(sig)
        if got is None:
            got = self._classes[sig] = len(self._classes)
        return got

    # -- reservations ---------------------------------------------------------------------------

    def reserve(
        self, worker_id: str, kv_bytes: int = 0, prefill_tokens: int = 0, requests: int = 1
    ) -> None:
        """Count a reservation against a worker until :meth:`release` (O(1)). Unknown ids are
        ignored (the worker may have left since the plan was made)."""
        ws = self.by_id.get(worker_id)
        if ws is None or not (kv_bytes or prefill_tokens or requests):
            return
        ws.live_kv += kv_bytes
        ws.live_tokens += prefill_tokens
        ws.live_reqs += requests
        model = ws.view.model_id
        self._model_kv[model] = self._model_kv.get(model, 0) + kv_bytes
        self._replace(ws)

    def release(
        self, worker_id: str, kv_bytes: int = 0, prefill_tokens: int = 0, requests: int = 1
    ) -> None:
        """Undo :meth:`reserve` (floors at zero)."""
        ws = self.by_id.get(worker_id)
        if ws is None or not (kv_bytes or prefill_tokens or requests):
            return
        freed = min(ws.live_kv, kv_bytes)
        model = ws.view.model_id
        self._model_kv[model] = max(0, self._model_kv.get(model, 0) - freed)
        ws.live_kv -= freed
        ws.live_tokens = max(0, ws.live_tokens - prefill_tokens)
        ws.live_reqs = max(0, ws.live_reqs - requests)
        self._replace(ws)

    def _replace(self, ws: WorkerState) -> None:
        """Move ``ws`` to its live key's place in every sorted order built so far."""
        model = ws.view.model_id
        ref = self.ref_tokens
        for role in _ROLES:
            index = self.indexes.get((model, role))
            if index is None or not index.sorted_by:
                continue
            for key, rows in index.sorted_by.items():
                placed = index.keys_of[key]
                old = placed.get(ws.idx)
                if old is None:  # not eligible for this role
                    continue
                fns = PRESELECT_KEYS[key]
                new = (fns[0] if role is Role.PREFILL else fns[1])(ws, ref)
                if new == old:
                    continue
                at = bisect.bisect_left(rows, (old, ws.idx))
                if at >= len(rows) or rows[at][2] is not ws:
                    # only a non-finite key misleads the bisect: find the row the slow way
                    at = next(i for i, row in enumerate(rows) if row[2] is ws)
                del rows[at]
                bisect.insort(rows, (new, ws.idx, ws))
                placed[ws.idx] = new

    # -- preselection -------------------------------------------------------------------------

    def sorted_workers(self, index: ModelIndex, key: str) -> list[tuple[float, int, WorkerState]]:
        """Eligible workers by snapshot key (built once per snapshot and key)."""
        rows = index.sorted_by.get(key)
        if rows is None:
            fns = PRESELECT_KEYS.get(key)
            if fns is None:
                raise InvalidInputError("preselect.key", f"unknown key {key!r}")
            fn = fns[0] if index.role is Role.PREFILL else fns[1]
            ref = self.ref_tokens
            rows = sorted(
                ((fn(ws, ref), ws.idx, ws) for ws in index.workers), key=lambda r: (r[0], r[1])
            )
            index.sorted_by[key] = rows
            index.keys_of[key] = {idx: k for k, idx, _ in rows}
        return rows

    def top_k(
        self,
        index: ModelIndex,
        key: str,
        k: int,
        drop: Callable[[WorkerState], str | None],
        max_scan: int,
    ) -> tuple[list[WorkerState], list[tuple[WorkerState, str]], bool]:
        """The ``k`` workers with the lowest live key that ``drop`` keeps (returns None).

        The order holds live keys (reservations re-place workers, module docstring), so the
        first ``k`` kept in order are the answer: the scan stops there, or after
        ``max_scan`` workers. Returns (kept in key order, dropped with reasons, truncated).
        """
        rows = self.sorted_workers(index, key)
        kept: list[WorkerState] = []
        dropped: list[tuple[WorkerState, str]] = []
        truncated = False
        for scanned, (_, _, ws) in enumerate(rows):
            if len(kept) >= k:
                break
            if scanned >= max_scan:
                truncated = True
                break
            reason = drop(ws)
            if reason is None:
                kept.append(ws)
            else:
                dropped.append((ws, reason))
        return kept, dropped, truncated

    def window(self, index: ModelIndex, start: int, k: int) -> list[WorkerState]:
        """``k`` eligible workers from position ``start`` (wrapping): round-robin."""
        n = len(index.workers)
        if n == 0:
            return []
        return [index.workers[(start + i) % n] for i in range(min(k, n))]
