"""One process per core on one port: a supervisor starts N copies of a server process that
each bind the same port with ``SO_REUSEPORT`` (the kernel spreads new connections over
them), restarts one that dies and stops them all on SIGTERM / SIGINT.

Python runs one thread of Python at a time, so one process uses one core however many the
machine has; ``hpd scheduler --processes N`` and ``hpd gateway --workers N`` run N. Each
process is complete (its own fleet view, event loop and metrics port): they share Redis
exactly as replicas on different machines do.

Children get their settings in a private YAML file (mode 0600, in a private folder: a
token or key path never shows in ``ps``) and their index in an environment variable of
the command's own (``HPD_SCHEDULER_PROCESS``, ``HPD_GATEWAY_WORKER``); a setting's
``HPD_<NAME>`` variable meant for the parent is dropped from a child's environment, so the
file is what it runs with.
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

from hpd_common.logging import get_logger

log = get_logger("processes")


def process_index(env_var: str) -> int | None:
    """This process's index when a supervisor started it (``env_var`` set), else None."""
    raw = os.environ.get(env_var)
    return int(raw) if raw is not None and raw.isdigit() else None


class ProcessGroup:
    """Children ``first..count-1`` of a server: ``python -m <module> --config <file>`` with
    ``env_var=<index>`` (module docstring). ``settings`` is a settings dataclass whose
    fields are the command's flags."""

    def __init__(
        self, module: str, env_var: str, settings: Any, count: int, first: int = 0
    ) -> None:
        self.module = module
        self.env_var = env_var
        self.settings = settings
        self.count = count
        self.first = first
        self._dir = tempfile.TemporaryDirectory(prefix=f"hpd-{module}-")
        self._config = Path(self._dir.name) / "settings.yaml"
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
        env[self.env_var] = str(index)
        return env

    def spawn(self, index: int) -> None:
        self.procs[index] = subprocess.Popen(
            [sys.executable, "-m", self.module, "--config", str(self._config)],
            env=dict(self._env(index)),
        )
        log.info("process_started", module=self.module, index=index, pid=self.procs[index].pid)

    def start(self) -> None:
        for i in range(self.first, self.count):
            self.spawn(i)

    def restart_dead(self) -> list[int]:
        """Starts again every child that exited while not stopping; their indices."""
        dead = [i for i, p in self.procs.items() if p.poll() is not None]
        if self.stopping:
            return []
        for i in dead:
            log.warning(
                "process_exited", module=self.module, index=i, code=self.procs[i].returncode
            )
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


def supervise(group: ProcessGroup, restart_delay_s: float = 1.0) -> int:
    """A supervisor's whole life (it serves nothing itself): start every child, keep them
    running, stop them on a signal."""
    stop = False

    def on_signal(_sig: int, _frame: Any) -> None:
        nonlocal stop
        stop = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        group.start()
        log.info("processes_running", module=group.module, processes=group.count)
        while not stop:
            time.sleep(0.2)
            if group.restart_dead():
                time.sleep(restart_delay_s)  # a child that dies at once must not spin
    finally:
        group.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    log.info("processes_stopped", module=group.module, processes=group.count)
    return 0
