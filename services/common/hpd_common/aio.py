"""asyncio helpers every service uses to stop its background tasks.

Stopping a task is ``cancel()`` then waiting for it. A task can absorb a cancellation and
carry on: on Python 3.11, ``asyncio.wait_for`` returns the inner result and drops the
CancelledError when both land in the same loop iteration (fixed in 3.12), so a ``while
True`` loop around it may never end and an unbounded ``await task`` then hangs shutdown.
The services use ``asyncio.timeout`` instead of ``wait_for``, and stop tasks with
:func:`cancel_and_wait`, which re-cancels and gives up after a bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from hpd_common.logging import get_logger

__all__ = ["cancel_and_wait"]

log = get_logger("aio")

_RECANCEL_S = 0.1


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], timeout_s: float = 5.0) -> bool:
    """Cancel ``tasks`` and wait until every one has ended, re-cancelling the ones still
    running every 100 ms, for at most ``timeout_s``. Returns True when all ended; otherwise
    logs the stragglers and returns False (shutdown goes on without them)."""
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - loop.time()
        if left <= 0:
            log.warning("tasks_did_not_stop", tasks=sorted(_name(t) for t in pending))
            return False
        _, pending = await asyncio.wait(pending, timeout=min(_RECANCEL_S, left))
    return True


def _name(task: asyncio.Future[Any]) -> str:
    get_name = getattr(task, "get_name", None)
    return str(get_name()) if get_name is not None else repr(task)
