"""Fault injection for the demo and its tests: each fault fires once, at a wall offset from
the start of the replay, and is logged to the live view and the report.

=============  =================================================================  ==========
kind           what happens                                                        auto target
=============  =================================================================  ==========
kill_worker    the worker crashes: its engine fails all work, heartbeats stop;    busiest decode
               the lease lapses, the registry deletes it, the broker fails its     worker
               open sessions, in-flight requests take their fallbacks
slow_link      a (prefill pool, decode pool) link loses ``factor`` x bandwidth;    busiest transfer
               the scheduler learns it from reported transfer times                pair
fill_pool      ``fraction`` of each worker's KV memory in a decode pool is         busiest decode
               occupied; load reports show it; the memory ladder acts              pool
stop_redis     the Redis server is stopped for ``seconds``, then restarted from    -
               its append-only file
=============  =================================================================  ==========

``auto`` targets are chosen from what the gateway has planned so far, so the fault hits
where the traffic is.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hpd_common.logging import get_logger

from .fleet import Fleet
from .replay_common import Replay

__all__ = ["Fault", "FaultInjector", "parse_fault"]

log = get_logger("fleet.faults")

KINDS = ("kill_worker", "slow_link", "fill_pool", "stop_redis")


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: ``kind``, its target (``auto`` = chosen at fire time), a value (slowdown
    factor, memory fraction or outage seconds) and when it fires (wall s after the start)."""

    kind: str
    target: str = "auto"
    value: float = 0.0
    at_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault {self.kind!r}; one of {', '.join(KINDS)}")
        if self.at_s < 0:
            raise ValueError("a fault cannot fire before the start")

    def __str__(self) -> str:
        return f"{self.kind} {self.target} {self.value:g} at {self.at_s:.1f}s"


_DEFAULT_VALUE = {"kill_worker": 0.0, "slow_link": 10.0, "fill_pool": 0.97, "stop_redis": 3.0}


def parse_fault(kind: str, spec: str, at_s: float) -> Fault:
    """``spec`` is ``TARGET[=VALUE]`` (``auto`` or empty target = chosen at fire time);
    for stop_redis it is the outage in seconds. E.g. ``h100-prefill-a>l40s-decode-b=10``."""
    target, _, value = (spec or "auto").partition("=")
    if kind == "stop_redis":
        return Fault(kind, "redis", float(target) if target not in ("", "auto") else 3.0, at_s)
    v = float(value) if value else _DEFAULT_VALUE[kind]
    return Fault(kind, target or "auto", v, at_s)


class FaultInjector:
    """Fires faults against a fleet (and a Redis stop/start pair) on schedule."""

    def __init__(
        self,
        fleet: Fleet,
        gateway: Replay,
        stop_redis: Callable[[], Awaitable[None]] | None = None,
        start_redis: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.fleet = fleet
        self.gateway = gateway
        self._stop_redis = stop_redis
        self._start_redis = start_redis
        self.applied: list[str] = []

    async def run(self, faults: list[Fault]) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        pending = sorted(faults, key=lambda f: f.at_s)
        tasks = []
        for f in pending:
            delay = start + f.at_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.fire(f)))
        await asyncio.gather(*tasks)

    def _note(self, text: str) -> None:
        self.applied.append(text)
        self.gateway.stats.events.append(text)
        log.warning("fault_injected", fault=text)

    async def fire(self, f: Fault) -> None:
        if f.kind == "kill_worker":
            wid = f.target if f.target != "auto" else self._busiest_decode_worker()
            await self.fleet.kill(wid)
            self._note(f"killed worker {wid}")
        elif f.kind == "slow_link":
            src, dst = (
                f.target.split(">", 1) if f.target != "auto" else self._busiest_transfer_pair()
            )
            self.fleet.slow_link(src, dst, f.value)
            self._note(f"link {src} -> {dst} bandwidth / {f.value:g}")
        elif f.kind == "fill_pool":
            pool = f.target if f.target != "auto" else self._busiest_decode_pool()
            self.fleet.fill_pool(pool, f.value)
            self._note(f"filled {f.value:.0%} of KV memory in pool {pool}")
        elif f.kind == "stop_redis":
            if self._stop_redis is None or self._start_redis is None:
                raise ValueError("stop_redis needs the embedded Redis (not --redis-url)")
            await self._stop_redis()
            self._note(f"Redis stopped for {f.value:g} s")
            await asyncio.sleep(f.value)
            await self._start_redis()
            self._note("Redis restarted")

    # -- auto targets -----------------------------------------------------------------------

    def _planned(self) -> list[tuple[str, str, str, str, str]]:
        return list(self.gateway.planned)

    def _busiest_decode_worker(self) -> str:
        counts = collections.Counter(
            p[2] for p in self._planned() if self.fleet.get(p[2]) is not None
        )
        decode_only = [
            w.worker_id for w in self.fleet if w.view.stage.value == "decode" and not w.killed
        ]
        for wid, _ in counts.most_common():
            if wid in decode_only:
                return wid
        if not decode_only:
            raise ValueError("no decode worker to kill")
        return decode_only[0]

    def _busiest_transfer_pair(self) -> tuple[str, str]:
        counts = collections.Counter((p[3], p[4]) for p in self._planned() if p[0] == "transfer")
        if not counts:
            raise ValueError("no transfer planned yet: name the link (SRC_POOL>DST_POOL)")
        return counts.most_common(1)[0][0]

    def _busiest_decode_pool(self) -> str:
        decode_pools = {w.view.pool_id for w in self.fleet if w.view.stage.value == "decode"}
        counts = collections.Counter(p[4] for p in self._planned() if p[4] in decode_pools)
        if counts:
            return counts.most_common(1)[0][0]
        if not decode_pools:
            raise ValueError("no decode pool to fill")
        return sorted(decode_pools)[0]
