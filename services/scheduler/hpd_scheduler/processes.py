"""One scheduler per core: ``hpd scheduler --processes N`` (and ``hpd up --scheduler-processes
N``) run N scheduler processes on one port.

Python runs one thread of Python at a time, so one scheduler process uses one core however
many the machine has. N processes each bind the same port with ``SO_REUSEPORT``; the kernel
spreads incoming connections over them. Each process is a complete scheduler with its own
fleet view (its own registry feed), event loop, health service and metrics port
(``metrics_port + i``); they share Redis exactly as replicas on different machines do, so
the reservation script keeps the never-more-than-K guarantee across them.

The kernel balances connections, not calls: a client with one HTTP/2 connection talks to
one process. Clients that want the whole scheduler open several connections (the gateway's
``scheduler_channels``; the scaling runs of ``bench/schedule_rpc.py`` open 8).

The supervisor (the process started by the operator) starts the N children, restarts one
that dies (after a second, logged), and on SIGTERM / SIGINT stops them all and waits for
each. Under ``hpd up`` its own process is process 0 and it restarts the others the same
way. Children get their settings in a private YAML file (so a token never shows in ``ps``)
and ``HPD_SCHEDULER_PROCESS=i`` (``hpd_common.processes``, which ``hpd gateway --workers``
shares).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hpd_common.errors import InvalidArgument
from hpd_common.processes import ProcessGroup
from hpd_common.processes import process_index as _index
from hpd_common.processes import supervise as _supervise

PROCESS_ENV = "HPD_SCHEDULER_PROCESS"
"""Set to the child's index in every scheduler process a supervisor starts."""


def process_index() -> int | None:
    """This process's index when a supervisor started it, else None."""
    return _index(PROCESS_ENV)


def child_settings(settings: Any, index: int) -> Any:
    """What child ``index`` runs with: its own metrics port and replica name."""
    changes: dict[str, Any] = {}
    if settings.metrics_port > 0:
        changes["metrics_port"] = settings.metrics_port + index
    if settings.scheduler_id:
        changes["scheduler_id"] = f"{settings.scheduler_id}-{index}"
    return dataclasses.replace(settings, **changes)


def check(settings: Any) -> None:
    """The settings' own checks, and one port to share when there are several processes."""
    settings.validate()
    if settings.processes > 1 and settings.port == 0:
        raise InvalidArgument("processes", "more than one process needs a fixed --port")


class SchedulerProcesses(ProcessGroup):
    """Children ``first..processes-1`` of a scheduler on ``settings.port``
    (``hpd_common.processes``)."""

    def __init__(self, settings: Any, first: int = 0) -> None:
        check(settings)
        super().__init__("hpd_scheduler", PROCESS_ENV, settings, settings.processes, first)


def supervise(settings: Any, restart_delay_s: float = 1.0) -> int:
    """The supervisor's life: start every child, keep them running, stop them on a signal."""
    return _supervise(SchedulerProcesses(settings), restart_delay_s)


def prepare(settings: Any) -> Any | int:
    """`serve_main`'s hook: a child gets its own settings; a supervisor runs its children and
    returns the exit code; one process runs as before."""
    check(settings)
    index = process_index()
    if index is not None:
        return child_settings(settings, index)
    if settings.processes > 1:
        return supervise(settings)
    return settings
