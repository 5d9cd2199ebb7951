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
and ``HPD_SCHEDULER_PROCESS=i``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from hpd_common.errors import InvalidArgument
from hpd_common.logging import get_logger

log = get_logger("scheduler.processes")

PROCESS_ENV = "HPD_SCHEDULER_PROCESS"
"""Set to the child's index in every scheduler process a supervisor starts."""


def process_index() -> int | None:
    """This process's index when a supervisor started it, else None."""
    raw = os.environ.get(PROCESS_ENV)
    return int(raw) if raw is not None and raw.isdigit() else None


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


class SchedulerProcesses:
    """Children ``first..count-1`` of a scheduler on ``settings.port``."""

    def __init__(self, settings: Any, first: int = 0) -> None:
        check(settings)
        self.settings = settings
        self.first = first
        self._dir = tempfile.TemporaryDirectory(prefix="hpd-scheduler-")
        self._config = Path(self._dir.name) / "scheduler.yaml"
        fd = os.open(self._config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yaml.safe_dump(dataclasses.asdict(settings), f)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.stopping = False

    def _env(self, index: int) -> Mapping[str, str]:
        # the YAML file holds every setting: a setting's HPD_<NAME> variable (or HPD_CONFIG)
        # meant for the parent must not override it in a child; others (HPD_NATIVE) stay
        settings_vars = {"HPD_CONFIG"} | {
            f"HPD_{f.name.upper()}" for f in dataclasses.fields(self.settings)
        }
        env = {k: v for k, v in os.environ.items() if k not in settings_vars}
        env[PROCESS_ENV] = str(index)
        return env

    def spawn(self, index: int) -> None:
        self.procs[index] = subprocess.Popen(
            [sys.executable, "-m", "hpd_scheduler", "--config", str(self._config)],
            env=dict(self._env(index)),
        )
        log.info("scheduler_process_started", index=index, pid=self.procs[index].pid)

    def start(self) -> None:
        for i in range(self.first, self.settings.processes):
            self.spawn(i)

    def restart_dead(self) -> list[int]:
        """Starts again every child that exited while not stopping; their indices."""
        dead = [i for i, p in self.procs.items() if p.poll() is not None]
        if self.stopping:
            return []
        for i in dead:
            log.warning("scheduler_process_exited", index=i, code=self.procs[i].returncode)
            self.spawn(i)
        return dead

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM to every child, then SIGKILL to one still there after ``timeout_s``."""
        self.stopping = True
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self._dir.cleanup()


def supervise(settings: Any, restart_delay_s: float = 1.0) -> int:
    """The supervisor's life: start every child, keep them running, stop them on a signal."""
    group = SchedulerProcesses(settings)
    stop = False

    def on_signal(_sig: int, _frame: Any) -> None:
        nonlocal stop
        stop = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        group.start()
        log.info("scheduler_processes_running", processes=settings.processes, port=settings.port)
        while not stop:
            time.sleep(0.2)
            if group.restart_dead():
                time.sleep(restart_delay_s)  # a child that dies at once must not spin
    finally:
        group.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    log.info("scheduler_processes_stopped", processes=settings.processes)
    return 0


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
