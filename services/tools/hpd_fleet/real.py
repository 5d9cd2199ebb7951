"""Real engines on this machine, put together: :class:`RealStack` (a prefill and a decode
vLLM engine, the control plane, an agent per engine, the peer router) for the real-engine
CI stage (``scripts/real-engines-e2e.sh``), its tests, the gateway benchmark and
``hpd demo --real``; and the command that installs the engines and writes their model.

The parts: ``hpd_fleet.real_install`` (the pinned vLLM stack in a virtualenv of its own,
the tiny model) and ``hpd_fleet.real_processes`` (engine and agent processes, ports, HTTP
probes). Nothing here imports an engine: vLLM is reached as processes, over HTTP.

    python -m hpd_fleet.real venv           # install (or find) the engines' virtualenv
    python -m hpd_fleet.real model DIR      # write the tiny model folder
    python -m hpd_fleet.real clean [--all]  # remove CPU-quota cgroups of runs that are gone
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpd_fleet.cgroups import remove_stale
from hpd_fleet.real_install import engines_venv, write_tiny_model
from hpd_fleet.real_processes import (
    OWN_SESSION,
    AgentProcess,
    EngineProcess,
    EngineSpec,
    http_json,
    pick_port,
    wait_http,
)

__all__ = ["RealStack", "main"]


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
    m = sub.add_parser("model", help="write the tiny model folder; print its path")
    m.add_argument("out_dir", type=Path)
    m.add_argument("--revision", default="tiny-r1")
    args = ap.parse_args(argv)
    if args.cmd == "clean":
        print(f"removed {remove_stale(every=args.all)} cgroup(s)")
        return 0
    venv = engines_venv(getattr(sys, "_base_executable", sys.executable))
    if args.cmd == "venv":
        print(venv)
    else:
        print(write_tiny_model(args.out_dir, venv, args.revision))
    return 0


@dataclass
class RealStack:
    """A prefill and a decode vLLM engine (NIXL, one core each), ``hpd up``, an agent per
    engine and ``hpd gateway``, all on free ports of 127.0.0.1; optionally the peer router
    (``vllm-router`` in its P/D mode) over the same two engines. Use as a context manager;
    everything is stopped on exit."""

    work_dir: Path
    with_router: bool = False
    gpu_flags: tuple[str, ...] = ("--gpu-type", "cpu-core", "--peak-tflops", "0.5",
                                  "--hbm-gbps", "20")  # fmt: skip
    engines: dict[str, EngineProcess] = field(default_factory=dict)
    procs: list[AgentProcess] = field(default_factory=list)
    control_plane: subprocess.Popen[bytes] | None = None
    router: subprocess.Popen[bytes] | None = None
    gateway_url: str = ""
    router_url: str = ""
    addrs: dict[str, str] = field(default_factory=dict)

    def __enter__(self) -> RealStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        logs = self.work_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        venv = engines_venv(getattr(sys, "_base_executable", sys.executable))
        model = write_tiny_model(self.work_dir / "tiny", venv)
        self.engines = {
            "prefill": EngineProcess(
                EngineSpec("prefill", pick_port(), 0, "kv_producer", pick_port()),
                venv, model, logs,
            ),
            "decode": EngineProcess(
                EngineSpec("decode", pick_port(), 1, "kv_consumer", pick_port()),
                venv, model, logs,
            ),
        }  # fmt: skip
        for e in self.engines.values():
            e.start()
        ports = {k: pick_port() for k in ("registry", "scheduler", "kvbroker")}
        self.addrs = {k: f"127.0.0.1:{p}" for k, p in ports.items()}
        hpd = str(Path(sys.executable).with_name("hpd"))
        self.control_plane = subprocess.Popen(
            [
                hpd, "up", "--state-dir", str(self.work_dir / "hpd-up"),
                "--registry-port", str(ports["registry"]),
                "--scheduler-port", str(ports["scheduler"]),
                "--kvbroker-port", str(ports["kvbroker"]), "--log-level", "warning",
            ],
            stdout=(logs / "hpd-up.log").open("ab"), stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=OWN_SESSION,
        )  # fmt: skip
        for e in self.engines.values():
            try:
                e.wait_ready(150)
            except (TimeoutError, RuntimeError):
                e.kill()
                e.start_ready()  # once more, on new ports
        self._start_agents(model, logs)
        gw_port = pick_port()
        gateway = AgentProcess(
            "gateway",
            [
                "--port", str(gw_port), "--scheduler", self.addrs["scheduler"],
                "--broker", self.addrs["kvbroker"], "--registry", self.addrs["registry"],
                "--tokenizer", f"tiny={model}", "--log-level", "warning",
            ],
            logs,
            command="gateway",
        )  # fmt: skip
        gateway.start()
        self.procs.append(gateway)
        self.gateway_url = f"http://127.0.0.1:{gw_port}"
        wait_http(self.gateway_url + "/health", 60)
        deadline = time.monotonic() + 60
        while len(http_json(self.gateway_url + "/v1/models")["data"]) == 0:
            if time.monotonic() > deadline:
                raise TimeoutError("the engines never registered")
            time.sleep(0.2)
        if self.with_router:
            self._start_router(venv, logs)

    def _start_agents(self, model: Path, logs: Path) -> None:
        """An agent per engine, registering it with the control plane."""
        for name, role in (("prefill", "prefill"), ("decode", "decode")):
            e = self.engines[name]
            agent = AgentProcess(
                name,
                [
                    "--engine-url", e.url, "--model-dir", str(model), "--role", role,
                    "--registry", self.addrs["registry"], "--worker-id", name,
                    "--kv-connector", "nixl", "--kv-side-channel", e.side_channel,
                    "--scrape-period-s", "0.5", "--log-level", "warning", *self.gpu_flags,
                ],
                logs,
            )  # fmt: skip
            agent.start()
            self.procs.append(agent)

    def _start_router(self, venv: Path, logs: Path) -> None:
        """The peer router (vllm-router, P/D mode) over the same two engines."""
        rport = pick_port()
        self.router = subprocess.Popen(
            [
                str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1",
                "--port", str(rport), "--vllm-pd-disaggregation",
                "--prefill", self.engines["prefill"].url,
                "--decode", self.engines["decode"].url,
                "--kv-connector", "nixl", "--policy", "round_robin",
            ],
            stdout=(logs / "vllm-router.log").open("ab"), stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.router_url = f"http://127.0.0.1:{rport}"
        wait_http(self.router_url + "/health", 60)

    def stop(self) -> None:
        if self.router is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.router.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.router.wait(timeout=10)
        for p in reversed(self.procs):
            p.stop()
        for e in self.engines.values():
            e.kill()
        if self.control_plane is not None:
            self.control_plane.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.control_plane.wait(timeout=20)


if __name__ == "__main__":
    raise SystemExit(main())
