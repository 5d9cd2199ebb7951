"""Token-true prefill queues: which of this replica's reserved prompt tokens are still waiting
to be prefilled.

A reservation holds its prompt's tokens against the worker that prefills it until the
request's outcome is reported, which comes when the whole request ends: a request that
finished its prefill seconds ago and is now decoding still counted as queued prefill work,
so a prefill worker with many requests in flight looked backlogged by all of their prompts
(and, with conditional disaggregation, decode workers would take prefills they should not).
Nothing tells the scheduler the moment a prefill ends, but it predicted it: each plan's
estimates carry the prefill wait and time. A plan's tokens count as queued until that
predicted end (``due``: ``RoutePlan.prefill_end_ms``, for a transfer before the hand-off);
after it the engine's own load report (its queue of waiting requests, priced at the
traffic's mean prompt) covers a prefill that runs late. Before it, the report's queue holds
the same requests: :meth:`PrefillDue.counts` tells the snapshot how many of a worker's
reported prefills are plans it already counts in tokens, so that only the rest is priced at
the mean prompt (counting both had every planned prompt queued twice), and, per decode
worker, the transfers on their way to it
whose prefill elsewhere is not done, as the simulator's views show them (module docstring
of ``hpd_sim.engine``; why they count there: ``WorkerState.backlog_tokens``). The tokens
stop counting at once when the outcome releases the reservation, and are forgotten when the
reservation's TTL lapses (``drop``).

Only this replica's own plans are tracked: other replicas' reservations come as totals
without timing and count in full, as before. Pure and synchronous; times in ms of the
service's clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["PrefillDue"]


@dataclass(slots=True)
class _Entry:
    worker_id: str
    tokens: int
    drop_ms: int
    added_ms: int
    decode_worker_id: str  # "" unless the plan transfers to another worker
    done: bool = False


class PrefillDue:
    """Own plans' prefill tokens by predicted end (module docstring)."""

    __slots__ = ("_done", "_entries", "_heap")

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        # (time, request id, phase): phase 0 = predicted prefill end, 1 = reservation lapse
        self._heap: list[tuple[int, str, int]] = []
        self._done: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(
        self,
        request_id: str,
        worker_id: str,
        tokens: int,
        due_ms: int,
        drop_ms: int,
        added_ms: int = 0,
        decode_worker_id: str = "",
    ) -> None:
        """Track a new reservation's ``tokens`` on ``worker_id`` (planned at ``added_ms``)
        until ``due_ms``; ``decode_worker_id``: where the plan decodes (a transfer's when
        it is another worker; empty or ``worker_id`` for a local prefill)."""
        if tokens <= 0 or request_id in self._entries:
            return
        if decode_worker_id == worker_id:
            decode_worker_id = ""
        self._entries[request_id] = _Entry(
            worker_id, tokens, max(drop_ms, due_ms), added_ms, decode_worker_id
        )
        heapq.heappush(self._heap, (due_ms, request_id, 0))

    def expire(self, now_ms: int) -> dict[str, int]:
        """Advance to ``now_ms``: returns, per worker, the tokens newly presumed prefilled."""
        out: dict[str, int] = {}
        heap = self._heap
        while heap and heap[0][0] <= now_ms:
            _, rid, phase = heapq.heappop(heap)
            e = self._entries.get(rid)
            if e is None:
                continue  # released meanwhile
            if phase == 0 and not e.done:
                e.done = True
                self._done[e.worker_id] = self._done.get(e.worker_id, 0) + e.tokens
                out[e.worker_id] = out.get(e.worker_id, 0) + e.tokens
                heapq.heappush(heap, (e.drop_ms, rid, 1))
            elif phase == 1:
                self._forget(rid, e)
        return out

    def release(self, request_id: str) -> tuple[str, int] | None:
        """The outcome released the reservation: forget it. Returns ``(worker, tokens)`` when
        they had already been presumed prefilled (and so no longer counted), else None."""
        e = self._entries.get(request_id)
        if e is None:
            return None
        was_done = e.done
        self._forget(request_id, e)
        return (e.worker_id, e.tokens) if was_done else None

    def counts(self, reported_ms: Mapping[str, int]) -> tuple[dict[str, int], dict[str, int]]:
        """Two per-worker counts of the plans still counted in tokens, in one pass over them
        (a snapshot rebuild asks for both).

        ``known``: per prefill worker, the plans made by its load report's time
        (``reported_ms``, per worker id), which may be among the prefills the report shows
        waiting or running; plans made after it, and workers without a report, count
        nothing: the report cannot show them. ``inbound``: per decode worker, the transfers
        planned to it whose prefill on another worker is not presumed done. O(plans)."""
        known: dict[str, int] = {}
        inbound: dict[str, int] = {}
        for e in self._entries.values():
            if e.done:
                continue
            at = reported_ms.get(e.worker_id)
            if at is not None and e.added_ms <= at:
                known[e.worker_id] = known.get(e.worker_id, 0) + 1
            if e.decode_worker_id:
                inbound[e.decode_worker_id] = inbound.get(e.decode_worker_id, 0) + 1
        return known, inbound

    def done_tokens(self, worker_id: str) -> int:
        """Reserved tokens on ``worker_id`` presumed prefilled already."""
        return self._done.get(worker_id, 0)

    def _forget(self, request_id: str, e: _Entry) -> None:
        del self._entries[request_id]
        if e.done:
            left = self._done.get(e.worker_id, 0) - e.tokens
            if left > 0:
                self._done[e.worker_id] = left
            else:
                self._done.pop(e.worker_id, None)
