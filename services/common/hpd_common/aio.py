"""asyncio helpers: the gateway's event loop, and stopping a service's background tasks.

**The loop.** :func:`run` runs the gateway's main coroutine on uvloop (libuv; the loop
aiohttp recommends and vLLM's own API server runs on) unless ``HPD_EVENT_LOOP=asyncio``
asks for the standard library's. Measured in an ad-hoc probe against two real engines at 8
requests in flight (``bench/gateway.py``'s stack, 4 passes of 96 requests, idle CPU
subtracted, two runs each):
the gateway's CPU per request 5.1-5.2 ms on asyncio, 4.5-4.9 ms on uvloop, CPU that comes
out of the cores the engines run on. The gRPC services and ``hpd up`` stay on asyncio: the
scheduler's explanation writer works in the loop's idle time, which it reads from asyncio's
ready queue (uvloop has none, so it would write on the serving path), and its group commit
waits a bound in microseconds, which libuv's timers round up to a millisecond; measured
(``bench/schedule_rpc.py --quick --sizes 256``, back to back) unary ``Schedule`` at 16 in
flight fell from 1,995 to 1,772 decisions/s on uvloop and the stream from 2,398 to 1,972.

Stopping a task is ``cancel()`` then waiting for it. A task can absorb a cancellation and
carry on: on Python 3.11, ``asyncio.wait_for`` returns the inner result and drops the
CancelledError when both land in the same loop iteration (fixed in 3.12), so a ``while
True`` loop around it may never end and an unbounded ``await task`` then hangs shutdown.
The services use ``asyncio.timeout`` instead of ``wait_for``, and stop tasks with
:func:`cancel_and_wait`, which cancels again if a task is still running after a grace
period and gives up after a bound.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from hpd_common.logging import get_logger

__all__ = ["EVENT_LOOP_ENV", "cancel_and_wait", "event_loop", "run"]

T = TypeVar("T")

EVENT_LOOP_ENV = "HPD_EVENT_LOOP"
"""``uvloop`` (the default) or ``asyncio``."""

log = get_logger("aio")

_GRACE_S = 1.0
"""How long a cancelled task may take over its own cleanup (closing a channel, a pub/sub
connection) before it is cancelled again."""

_RECANCEL_S = 0.5


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], timeout_s: float = 5.0) -> bool:
    """Cancel ``tasks`` and wait until every one has ended, for at most ``timeout_s``.

    A task still running after ``_GRACE_S`` (its cleanup given time to finish) is cancelled
    again every ``_RECANCEL_S``: it absorbed the first cancellation. Exceptions the tasks
    ended with are retrieved and logged. Returns True when all ended; otherwise logs the
    stragglers and returns False (shutdown goes on without them)."""
    every = list(tasks)
    pending = {t for t in every if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    wait = _GRACE_S
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - loop.time()
        if left <= 0:
            log.warning("tasks_did_not_stop", tasks=sorted(_name(t) for t in pending))
            break
        _, pending = await asyncio.wait(pending, timeout=min(wait, left))
        wait = _RECANCEL_S
    for t in every:
        if t.done() and not t.cancelled() and t.exception() is not None:
            log.warning("task_failed", task=_name(t), error=repr(t.exception()))
    return not pending


def _name(task: asyncio.Future[Any]) -> str:
    get_name = getattr(task, "get_name", None)
    return str(get_name()) if get_name is not None else repr(task)


def event_loop() -> str:
    """The loop :func:`run` uses: ``uvloop`` unless ``HPD_EVENT_LOOP`` says ``asyncio``
    (``ValueError`` for anything else)."""
    want = os.environ.get(EVENT_LOOP_ENV, "").strip().lower() or "uvloop"
    if want not in ("uvloop", "asyncio"):
        raise ValueError(f"{EVENT_LOOP_ENV} must be uvloop or asyncio, got {want!r}")
    return want


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop :func:`event_loop` names (the standard library's
    where uvloop is not installed and was not asked for by name: it has no Windows build)."""
    try:
        loop = event_loop()
    except ValueError:
        main.close()  # never to run: no "never awaited" warning
        raise
    if loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            if os.environ.get(EVENT_LOOP_ENV):
                main.close()
                raise
        else:
            return uvloop.run(main)
    return asyncio.run(main)
