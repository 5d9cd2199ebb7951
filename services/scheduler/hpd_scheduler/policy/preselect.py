"""Preselection, the filter and score stages of a plan: per role, the profile's `Filter`
plugins drop the workers that cannot take the request (each with its reason), the
preselection key picks at most top-k of the rest without sorting the fleet, the holders
of the request's longest cached prefixes take the last places, and the profile's
pair-independent `Scorer` plugins score each candidate.

The filters run here are the profile's own `Filter` objects (`Preselection.filters`), the
same ones `Filter.filter` applies to a list in tests; `Preselection.filter` runs the whole
chain on a list of workers, as a plan does, for tests and tools.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from .config import Profile
from .decision import DecisionRecord
from .domain import Role, Stage
from .fleet import Fleet, ModelIndex, WorkerState
from .framework import Candidate, Filter, FilterResult, RequestContext, split_workers
from .prefix import matched_blocks

__all__ = ["PREFIX_HOLDERS", "Preselection", "prefix_matches"]

PREFIX_HOLDERS = 2
"""Holders of the longest prefixes that take the last places of a role's top k: the two
longest matches (a shorter one saves less), in place of the preselection's last ones
rather than beside them, since each extra candidate adds a row of pairs to the joint
search (measured: k extra holders nearly doubled a decision's p99 at 256 workers with
8k-token prompts, bench/kv_index.py)."""


def prefix_matches(ctx: RequestContext) -> dict[int, int]:
    """Per worker (snapshot index) holding the request's first block, how many blocks of its
    chain it holds in a row; once per plan. With the index's heads (``Fleet.prefix_heads``)
    only the holders of the first block are looked at, else every worker."""
    got = ctx.matched
    if got is not None:
        return got
    out: dict[int, int] = {}
    req = ctx.request
    chain = req.prefix_blocks
    if chain:
        head = chain[0]
        bt = req.prefix_block_tokens
        fleet = ctx.fleet
        heads = fleet.prefix_heads
        pool: list[WorkerState] = []
        if heads is not None:
            for wid in heads.get(head, ()):
                ws = fleet.by_id.get(wid)
                if ws is not None:
                    pool.append(ws)
        else:
            pool = fleet.states
        for ws in pool:
            held = ws.held
            if held is None or ws.held_block_tokens != bt or head not in held:
                continue
            n = matched_blocks(chain, held)
            if n:
                out[ws.idx] = n
    ctx.matched = out
    return out


def _prefix_holders(
    fleet: Fleet,
    index: ModelIndex,
    matches: dict[int, int],
    k: int,
    kept: list[WorkerState],
    drop: Callable[[WorkerState], str | None],
) -> list[WorkerState]:
    """Up to ``k`` workers of ``index`` that preselection left out, holding the longest
    prefixes of the request's chain (a preselection by capacity or load knows nothing of
    caches; KV-aware routers look at every holder)."""
    if not matches:
        return []
    seen = {ws.idx for ws in kept}
    found: list[tuple[int, int, WorkerState]] = []
    states = fleet.states
    for idx, n in matches.items():
        if idx in seen:
            continue
        ws = states[idx]
        if ws.view.model_id != index.model_id or not ws.view.stage.serves(index.role):
            continue
        found.append((-n, idx, ws))
    found.sort(key=lambda row: (row[0], row[1]))
    out: list[WorkerState] = []
    for _, _, ws in found:
        if len(out) >= k:
            break
        if drop(ws) is None:
            out.append(ws)
    return out


class Preselection:
    """The filter and score stages for one profile (module docstring)."""

    __slots__ = (
        "_cursor",
        "decode_scorers",
        "drop_reasons",
        "filters",
        "prefill_scorers",
        "profile",
    )

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self._cursor: dict[tuple[str, Role], int] = {}
        # per role: the profile's filters, and their bound drop_reason methods (looked up
        # once, not per worker)
        self.filters: dict[Role, tuple[Filter, ...]] = {
            Role.PREFILL: tuple(profile.prefill.filters),
            Role.DECODE: tuple(profile.decode.filters),
        }
        self.drop_reasons = {
            role: tuple(f.drop_reason for f in filters) for role, filters in self.filters.items()
        }
        # the pair-independent scorers of each side, (bound score method, name, weight), in
        # profile order
        self.prefill_scorers = [
            (s.score, s.name, w) for s, w in profile.prefill.scorers if not s.pairwise
        ]
        self.decode_scorers = [
            (s.score, s.name, w) for s, w in profile.decode.scorers if not s.pairwise
        ]

    def reason(
        self, ws: WorkerState, role: Role, ctx: RequestContext, colocated: bool = False
    ) -> str | None:
        """Why the filters drop ``ws`` for ``role`` (the first filter's reason), or None."""
        if colocated and ws.view.stage is not Stage.BOTH:
            return "not_colocated"
        avoid = ctx.request.avoid_workers
        if avoid and ws.worker_id in avoid:
            return "failed_for_this_request"
        for drop_reason in self.drop_reasons[role]:
            reason = drop_reason(ws, role, ctx)
            if reason is not None:
                return reason
        return None

    def filter(
        self, workers: Sequence[WorkerState], role: Role, ctx: RequestContext
    ) -> FilterResult:
        """The whole filter chain on ``workers``, as a plan runs it: kept in order, and the
        first reason for each dropped worker."""
        return split_workers(workers, lambda ws: self.reason(ws, role, ctx))

    def score(self, c: Candidate, ctx: RequestContext) -> None:
        """``c.score`` and ``c.factors`` from its side's pair-independent scorers."""
        total = 0.0
        factors = c.factors
        scorers = self.prefill_scorers if c.role is Role.PREFILL else self.decode_scorers
        for score, name, weight in scorers:
            v = score(c, ctx)
            factors[name] = v
            total += weight * v
        c.score = total

    def candidates(
        self,
        index: ModelIndex,
        role: Role,
        ctx: RequestContext,
        rng: random.Random,
        record: DecisionRecord,
        colocated: bool,
        record_drops: bool = True,
    ) -> list[Candidate]:
        """The role's candidates for this request, filtered, preselected (at most top-k, the
        longest prefix holders taking the last places) and scored; the drops go to the
        record (the first 64) unless ``record_drops`` is off."""
        prof = self.profile
        k = prof.top_k_prefill if role is Role.PREFILL else prof.top_k_decode

        def drop(ws: WorkerState) -> str | None:  # the filter chain, as `filter` runs it
            return self.reason(ws, role, ctx, colocated)

        mode = prof.preselect
        dropped: list[tuple[WorkerState, str]]
        if mode in ("capacity", "blind"):
            kept, dropped, truncated = ctx.fleet.top_k(index, mode, k, drop, prof.max_scan)
            if truncated:
                record.notes.append(f"{role.value}_scan_truncated_at_{prof.max_scan}")
        else:
            kept, dropped = self._scan_order(index, role, ctx, rng, k, drop, mode)
        matches: dict[int, int] | None = None
        if ctx.request.prefix_blocks:
            matches = prefix_matches(ctx)
            holders = _prefix_holders(ctx.fleet, index, matches, PREFIX_HOLDERS, kept, drop)
            if holders:  # they take the last places: the pair search stays k x k
                kept = kept[: max(1, len(kept) - len(holders))] + holders
        if record_drops:
            for ws, reason in dropped[:64]:
                record.rejected_workers.append((ws.worker_id, ws.pool_id, reason))

        ref = ctx.fleet.ref_tokens
        request = ctx.request
        out: list[Candidate] = []
        for ws in kept:
            # a worker found by the prefix search has its match; any other checks its own
            # cache (one lookup when it does not hold the first block)
            c = Candidate(
                ws, role, request, ref, -1 if matches is None else matches.get(ws.idx, -1)
            )
            self.score(c, ctx)
            out.append(c)
        return out

    def _scan_order(
        self,
        index: ModelIndex,
        role: Role,
        ctx: RequestContext,
        rng: random.Random,
        k: int,
        drop: Any,
        mode: str,
    ) -> tuple[list[WorkerState], list[tuple[WorkerState, str]]]:
        workers = index.workers
        n = len(workers)
        prof = self.profile
        if mode == "all":
            order = range(n)
            limit = n
        elif mode == "rotation":
            key = (index.model_id, role)
            start = self._cursor.get(key, 0)
            self._cursor[key] = (start + 1) % max(n, 1)
            order = range(start, start + n)
            limit = min(prof.max_scan, n)
        else:
            # random: a uniformly random start, then the next workers; the random picker
            # shuffles the window, so every worker is equally likely to come first
            start = rng.randrange(n) if n else 0
            order = range(start, start + n)
            limit = min(prof.max_scan, n)
        kept: list[WorkerState] = []
        dropped: list[tuple[WorkerState, str]] = []
        for scanned, i in enumerate(order):
            if scanned >= limit or (mode != "all" and len(kept) >= k):
                break
            ws = workers[i % n]
            reason = drop(ws)
            if reason is None:
                kept.append(ws)
            else:
                dropped.append((ws, reason))
        return kept, dropped
