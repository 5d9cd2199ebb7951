"""The demo's live terminal view: a progress bar and a per-pool table, redrawn in place with
plain ANSI escapes (cursor up ``ESC[nF``, clear to end ``ESC[J``); no dependency.

On a terminal the block is redrawn every ``interval_s``; elsewhere (a pipe, a CI log) one
progress line is printed every ``10 x interval_s`` instead, so logs stay readable.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import TextIO

from .fleet import Fleet
from .replay_common import Replay

__all__ = ["LiveView", "render"]


def _bar(done: int, total: int, width: int = 30) -> str:
    frac = done / total if total else 1.0
    full = int(frac * width)
    return "[" + "#" * full + "-" * (width - full) + f"] {done}/{total}"


def _top(counter: collections.Counter[str], n: int = 4) -> str:
    return ", ".join(f"{k} {v}" for k, v in counter.most_common(n)) or "-"


def render(gateway: Replay, fleet: Fleet, elapsed_s: float) -> list[str]:
    """The lines of the live block."""
    st = gateway.stats
    lines = [
        f"{_bar(st.done, st.total)} requests ended: {st.completed} completed,"
        f" {st.rejected} rejected, {st.failed} failed; {st.inflight} in flight"
        f"   t={elapsed_s:5.1f}s",
        f"{'pool':<16}{'gpu':<10}{'stage':<9}{'up':>5}{'queue':>7}{'batch':>7}{'KV used':>9}"
        f"{'util':>7}",
    ]
    pools: dict[str, list[object]] = {}
    for w in fleet:
        pools.setdefault(w.view.pool_id, []).append(w)
    for pool_id in sorted(pools):
        ws = [w for w in fleet if w.view.pool_id == pool_id]
        alive = [w for w in ws if not w.killed]
        queue = sum(w.engine.queue_depth() for w in alive)
        batch = sum(len(w.engine._batch) for w in alive)
        cap = sum(w.engine.spec.kv_capacity_tokens for w in alive) or 1
        used = sum(w.engine.used_tokens + w.engine.ballast_tokens for w in alive)
        util = sum(w.engine.load_report().gpu_util for w in alive) / max(1, len(alive))
        v = ws[0].view
        lines.append(
            f"{pool_id:<16}{v.gpu_type:<10}{v.stage.value:<9}{len(alive):>3}/{len(ws):<1}"
            f"{queue:>7}{batch:>7}{used / cap:>8.0%}{util:>7.0%}"
        )
    lines.append(f"modes: {_top(st.modes)}   fallbacks: {_top(st.fallbacks, 3)}")
    lines.append(
        f"rejects: {_top(st.rejects, 3)}   Schedule retries while unavailable: "
        f"{st.unavailable_retries}"
    )
    if st.events:
        lines.append("faults: " + "; ".join(st.events[-3:]))
    return lines


class LiveView:
    """Redraws :func:`render` until stopped."""

    def __init__(self, gateway: Replay, fleet: Fleet, out: TextIO, interval_s: float = 0.5) -> None:
        self.gateway = gateway
        self.fleet = fleet
        self.out = out
        self.interval_s = interval_s
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self._task: asyncio.Task[None] | None = None
        self._drawn = 0
        self._start = 0.0

    def start(self) -> None:
        self._start = asyncio.get_running_loop().time()
        self._task = asyncio.create_task(self._loop(), name="live-view")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._draw(asyncio.get_running_loop().time() - self._start)

    def _draw(self, elapsed: float) -> None:
        lines = render(self.gateway, self.fleet, elapsed)
        if self.tty:
            up = f"\x1b[{self._drawn}F" if self._drawn else ""
            self.out.write(up + "\x1b[J" + "\n".join(lines) + "\n")
            self._drawn = len(lines)
        else:
            self.out.write(lines[0] + "\n")
        self.out.flush()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        self._start = loop.time()
        n = 0
        while True:
            if self.tty or n % 10 == 0:
                self._draw(loop.time() - self._start)
            n += 1
            await asyncio.sleep(self.interval_s)
