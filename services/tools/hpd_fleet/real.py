"""Real engines on this machine, put together: :class:`RealStack` (a prefill and a decode
vLLM engine, the control plane, an agent per engine, the peer router; a fleet file's
stack, ``hpd_fleet.real_fleet``, over the built-in P/D pair) for the gateway benchmark and
``hpd demo --real``; and the command that installs the engines and writes their model.

The parts: ``hpd_fleet.real_install`` (the pinned vLLM stack in a virtualenv of its own,
the tiny model) and ``hpd_fleet.real_processes`` (engine and agent processes, ports, HTTP
probes). Nothing here imports an engine: vLLM is reached as processes, over HTTP.

    python -m hpd_fleet.real venv           # install (or find) the engines' virtualenv
    python -m hpd_fleet.real model DIR      # write the tiny model folder
    python -m hpd_fleet.real clean [--all]  # remove CPU-quota cgroups of runs that are gone
    python -m hpd_fleet.real clean --reap HPD_REAL_LOG_DIR=/tmp/x  # and a run's processes
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from hpd_fleet.cgroups import remove_stale
from hpd_fleet.real_fleet import EngineEntry, FleetFile, FleetStack
from hpd_fleet.real_install import engines_venv, write_tiny_model
from hpd_fleet.real_processes import reap

__all__ = ["PD_PAIR", "RealStack", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hpd_fleet.real", description="Real engines: install, model folder."
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("venv", help="install (or find) the engines' virtualenv; print its path")
    c = sub.add_parser(
        "clean", help="remove CPU-quota cgroups left by runs that are gone (and their engines)"
    )
    c.add_argument("--all", action="store_true", help="every one of this project's groups")
    c.add_argument(
        "--reap",
        default="",
        metavar="NAME=VALUE",
        help="also kill every process whose environment holds NAME=VALUE (what a run exported"
        " for everything it started: engines, agents, routers), whatever became of its parent",
    )
    m = sub.add_parser("model", help="write the tiny model folder; print its path")
    m.add_argument("out_dir", type=Path)
    m.add_argument("--revision", default="tiny-r1")
    args = ap.parse_args(argv)
    if args.cmd == "clean":
        if args.reap:
            print(f"killed {reap(args.reap)} process(es) of the run")
        print(f"removed {remove_stale(every=args.all)} cgroup(s)")
        return 0
    venv = engines_venv(getattr(sys, "_base_executable", sys.executable))
    if args.cmd == "venv":
        print(venv)
    else:
        print(write_tiny_model(args.out_dir, venv, args.revision))
    return 0


PD_PAIR = FleetFile(
    (
        EngineEntry("prefill", role="prefill", cores="0", connector="nixl"),
        EngineEntry("decode", role="decode", cores="1", connector="nixl"),
    )
)
"""A prefill and a decode engine over NIXL, one core each (every agent declares one CPU
core's order-of-magnitude figures, ``Declared``'s defaults)."""


class RealStack(FleetStack):
    """The P/D pair (``PD_PAIR``) under the control plane, an agent per engine and
    ``hpd gateway``, all on free ports of 127.0.0.1; with ``with_router`` the peer router
    (``vllm-router`` in its P/D mode, round robin) over the same two engines. A
    :class:`~hpd_fleet.real_fleet.FleetStack`: use as a context manager; everything is
    stopped on exit."""

    def __init__(self, work_dir: Path, with_router: bool = False) -> None:
        super().__init__(PD_PAIR, work_dir)
        self.with_router = with_router

    def start(self) -> None:
        super().start()
        if self.with_router:
            self.start_router("round_robin")


if __name__ == "__main__":
    raise SystemExit(main())
