"""CPU quotas for real engines: a vLLM engine in a cgroup with a CPU quota is a slower real
engine, the way a throttled, shared or older GPU is a slower one.

:class:`CpuQuota` makes one cgroup per engine start, with a quota of ``cores`` (a fraction
of one core, or more than one), puts the engine in it *before* it runs (the command is
wrapped by a shell that writes its own pid into the group and then ``exec``\\ s the
engine, so every thread and child the engine starts is in the group from its first
instruction), and removes the group again when the engine is gone. The quota may be set
once the engine is up (``limited=False``, then :meth:`CpuQuota.limit`): an engine's start
is mostly compiling and loading, at a quarter core it took minutes, and a throttled GPU
is slow at serving, not at booting. Both cgroup versions:

* v1: the ``cpu`` controller's hierarchy (``/sys/fs/cgroup/cpu``), files
  ``cpu.cfs_period_us`` and ``cpu.cfs_quota_us``;
* v2: the unified hierarchy (``/sys/fs/cgroup`` or ``/sys/fs/cgroup/unified``) where its
  ``cgroup.controllers`` lists ``cpu``, file ``cpu.max`` (``"<quota> <period>"``).

Groups live under one parent, ``hetero-pd`` (created when missing, removed when empty), and
are named ``<engine>-<pid of this process>-<n>``; :func:`remove_stale` removes groups
whose creating process is gone (a run that was SIGKILLed). A machine where none of this is
writable gets :class:`CgroupUnavailable` naming what was tried and what is missing (root,
a mounted ``cpu`` controller), never an engine silently running at full speed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PERIOD_US", "CgroupUnavailable", "CpuQuota", "cgroup_root", "remove_stale"]

PERIOD_US = 10_000
"""The quota's accounting period: 10 ms, a tenth of the kernel's default. Within a period
the group runs until its quota is spent, then waits for the next; with 100 ms a
quarter-core engine answered a short request in either 15 ms or 85-105 ms (it ran at full
speed, then stood still for 75 ms), a stuttering engine rather than a slower one. With
10 ms the stalls are at most a few ms, closer to a GPU that is simply slower."""

_PARENT = "hetero-pd"
_COUNTER = itertools.count(1)
_V1 = Path("/sys/fs/cgroup/cpu")
_V2_CANDIDATES = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))


class CgroupUnavailable(RuntimeError):
    """No writable CPU cgroup on this machine (the message says what is missing)."""


def cgroup_root() -> tuple[Path, int]:
    """The hierarchy to make groups in and its version (1 or 2)."""
    tried: list[str] = []
    if (_V1 / "cpu.cfs_quota_us").exists():
        if os.access(_V1, os.W_OK):
            return _V1, 1
        tried.append(f"{_V1} (cgroup v1 cpu controller) is not writable: run as root")
    for root in _V2_CANDIDATES:
        ctl = root / "cgroup.controllers"
        if ctl.exists():
            if "cpu" not in ctl.read_text().split():
                tried.append(f"{root} (cgroup v2) does not offer the cpu controller")
            elif not os.access(root, os.W_OK):
                tried.append(f"{root} (cgroup v2) is not writable: run as root")
            else:
                return root, 2
    if not tried:
        tried.append("no cgroup v1 cpu hierarchy at /sys/fs/cgroup/cpu and no cgroup v2 mount")
    raise CgroupUnavailable(
        "a CPU quota needs a writable cpu cgroup; " + "; ".join(tried)
        + ". Give the engine no quota (cpu_quota 0) to run it unthrottled."
    )  # fmt: skip


def _parent(root: Path, version: int) -> Path:
    parent = root / _PARENT
    parent.mkdir(exist_ok=True)
    if version == 2:
        # the parent hands the cpu controller down to its children
        with contextlib.suppress(OSError):
            (root / "cgroup.subtree_control").write_text("+cpu")
        (parent / "cgroup.subtree_control").write_text("+cpu")
    return parent


@dataclass
class CpuQuota:
    """One engine's CPU quota: ``cores`` of CPU time per period (0.25 = a quarter core)."""

    name: str
    cores: float
    path: Path | None = None
    version: int = 0
    _root: Path | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.cores > 0:
            raise ValueError(f"cpu quota of {self.name!r} must be > 0 cores, got {self.cores}")

    def create(self, limited: bool = True) -> Path:
        """Make the group, with its quota unless ``limited`` is false (then
        :meth:`limit` sets it later); returns its path."""
        root, version = cgroup_root()
        parent = _parent(root, version)
        path = parent / f"{self.name}-{os.getpid()}-{next(_COUNTER)}"
        path.mkdir()
        self.path, self.version, self._root = path, version, root
        try:
            self._set(limited)
        except OSError:
            path.rmdir()
            self.path = None
            raise
        return path

    def limit(self) -> None:
        """Set the quota (on a group made with ``limited=False``)."""
        self._set(True)

    def _set(self, limited: bool) -> None:
        path = self.path
        assert path is not None
        quota = max(1000, round(self.cores * PERIOD_US)) if limited else -1
        if self.version == 1:
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (path / "cpu.max").write_text(f"{quota if limited else 'max'} {PERIOD_US}")

    def wrap(self, cmd: list[str], limited: bool = True) -> list[str]:
        """``cmd`` started inside the group (module docstring); creates it if needed."""
        path = self.path or self.create(limited)
        procs = shlex.quote(str(path / "cgroup.procs"))
        return ["/bin/sh", "-c", f'echo $$ > {procs} && exec "$@"', "hpd-cpu-quota", *cmd]

    def throttled_s(self) -> float:
        """Seconds the group's processes were held back by the quota so far."""
        if self.path is None:
            return 0.0
        stat = (self.path / "cpu.stat").read_text().split()
        pairs = dict(zip(stat[::2], stat[1::2], strict=False))
        if "throttled_time" in pairs:  # v1, ns
            return int(pairs["throttled_time"]) / 1e9
        return int(pairs.get("throttled_usec", "0")) / 1e6  # v2

    def remove(self, timeout_s: float = 10.0) -> None:
        """Remove the group once its processes are gone (killing any left), then the
        parent when it is empty. Safe to call twice."""
        path = self.path
        if path is None or not path.exists():
            self.path = None
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                path.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                for pid in _pids(path):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, 9)
                time.sleep(0.1)
        self.path = None
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # only when no other engine's group is left


def _pids(path: Path) -> list[int]:
    try:
        return [int(x) for x in (path / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def remove_stale(every: bool = False) -> int:
    """Remove the groups of runs whose process is gone (their engines are killed first),
    or with ``every`` all of this project's groups (the end of a CI run); returns how
    many. Nothing to do on a machine without cgroups."""
    try:
        root, _ = cgroup_root()
    except CgroupUnavailable:
        return 0
    parent = root / _PARENT
    if not parent.is_dir():
        return 0
    removed = 0
    for group in parent.iterdir():
        if not group.is_dir():
            continue
        parts = group.name.rsplit("-", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        if not every and Path(f"/proc/{parts[1]}").exists():  # its run is still going
            continue
        q = CpuQuota(group.name, 1.0, path=group)
        with contextlib.suppress(OSError):
            q.remove()
            removed += 1
    with contextlib.suppress(OSError):
        parent.rmdir()
    return removed
