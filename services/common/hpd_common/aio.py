"""asyncio helpers every service uses to stop its background tasks.

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
from collections.abc import Iterable
from typing import Any

from hpd_common.logging import get_logger

__all__ = ["cancel_and_wait"]

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
