"""A real heterogeneous fleet described in a file: N vLLM engines (CPU build), each with its
own role, CPU quota, cores, KV cache size and dtype, and connector; the control plane; an
agent per engine, every agent declaring the *same* GPU figures (only measurement may tell
the engines apart); the gateway; and, on demand, the peer router over the same engines.

The fleet file (YAML)::

    declare:                 # what every agent declares (optional; these are the defaults)
      gpu_type: cpu-core
      peak_tflops: 0.5
      hbm_gbps: 20
    max_model_len: 1024      # optional
    engines:                 # one entry per engine, at least one
      - name: fast           # worker id and engine name: lower case letters, digits, '-'
        role: both           # prefill | decode | both
        cores: "0"           # CPUs its threads may use (taskset list; default: "0")
        cpu_quota: 0.8       # CPU time in cores (cgroup quota, at least 0.1; 0 = none)
        kv_cache_gib: 1      # its KV cache, whole GiB (the CPU build takes no fraction)
        kv_blocks: 0         # or fewer: vLLM's --num-gpu-blocks-override (0 = all that fit)
        dtype: bfloat16      # the model's dtype: bfloat16 | float32 (float32 KV cannot
                             # go to a bfloat16 engine: a really incompatible pair)
        kv_cache_dtype: ""   # vLLM's --kv-cache-dtype ("" = the model's dtype)
        connector: none      # nixl | none (a NIXL engine's progress thread spins on a core)
        max_num_seqs: 0      # vLLM's --max-num-seqs (0 = its default)

:func:`load_fleet` validates it and names the offending key; :class:`FleetStack` runs it.
A fleet of prefill and decode engines is served by the peer router in its P/D mode; a fleet
whose engines all serve both stages, by its regular mode. Every process listens on a free
port of 127.0.0.1 and everything (engines, their cgroups, agents, gateway, router, control
plane) is stopped on exit, also on failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import yaml

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
from hpd_tools.up import embedded_redis_url

__all__ = [
    "Declared",
    "EngineEntry",
    "FleetError",
    "FleetFile",
    "FleetStack",
    "load_fleet",
    "parse_fleet",
]

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
_ROLES = ("prefill", "decode", "both")
_DTYPES = ("bfloat16", "float32")
_CONNECTORS = ("nixl", "none")
_CPUS = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


class FleetError(ValueError):
    """A fleet file that cannot be run; ``key`` names what is wrong."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"fleet file: {key}: {message}")
        self.key = key


@dataclass(frozen=True, slots=True)
class Declared:
    """What every agent declares: one GPU type and its figures for all."""

    gpu_type: str = "cpu-core"
    peak_tflops: float = 0.5
    hbm_gbps: float = 20.0


@dataclass(frozen=True, slots=True)
class EngineEntry:
    """One engine of the fleet file (module docstring)."""

    name: str
    role: str = "both"
    cores: str = "0"
    cpu_quota: float = 0.0
    kv_cache_gib: int = 1
    kv_blocks: int = 0
    dtype: str = "bfloat16"
    kv_cache_dtype: str = ""
    connector: str = "none"
    max_num_seqs: int = 0

    @property
    def kv_role(self) -> str:
        """The NIXL role of its connector ('' without one)."""
        if self.connector != "nixl":
            return ""
        return {"prefill": "kv_producer", "decode": "kv_consumer"}.get(self.role, "kv_both")


@dataclass(frozen=True, slots=True)
class FleetFile:
    engines: tuple[EngineEntry, ...]
    declare: Declared = Declared()
    max_model_len: int = 1024

    @property
    def disaggregated(self) -> bool:
        """True when some engine serves only one stage (the router's P/D mode)."""
        return any(e.role != "both" for e in self.engines)


def _number(doc: Mapping[str, Any], key: str, where: str, default: float, lo: float) -> float:
    raw = doc.get(key, default)
    if isinstance(raw, bool) or not isinstance(raw, int | float) or raw < lo:
        raise FleetError(f"{where}.{key}", f"must be a number >= {lo:g}, got {raw!r}")
    return float(raw)


def _quota(doc: Mapping[str, Any], where: str) -> float:
    """0 (none) or at least 0.1 core: the kernel's least quota is 1 ms per period (10 ms,
    ``hpd_fleet.cgroups.PERIOD_US``)."""
    q = _number(doc, "cpu_quota", where, 0.0, 0.0)
    if 0 < q < 0.1:
        raise FleetError(f"{where}.cpu_quota", f"must be 0 (none) or at least 0.1, got {q:g}")
    return q


def _whole(doc: Mapping[str, Any], key: str, where: str, default: int, lo: int) -> int:
    raw = doc.get(key, default)
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < lo:
        raise FleetError(f"{where}.{key}", f"must be a whole number >= {lo}, got {raw!r}")
    return raw


def _choice(
    doc: Mapping[str, Any], key: str, where: str, default: str, allowed: Sequence[str]
) -> str:
    raw = doc.get(key, default)
    if raw not in allowed:
        raise FleetError(f"{where}.{key}", f"must be one of {', '.join(allowed)}, got {raw!r}")
    return str(raw)


def _engine(doc: Any, i: int) -> EngineEntry:
    where = f"engines[{i}]"
    if not isinstance(doc, dict):
        raise FleetError(where, "must be a mapping")
    known = set(EngineEntry.__dataclass_fields__)
    unknown = sorted(set(doc) - known)
    if unknown:
        raise FleetError(
            f"{where}.{unknown[0]}", f"unknown key (known: {', '.join(sorted(known))})"
        )
    name = doc.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise FleetError(f"{where}.name", f"must match {_NAME.pattern}, got {name!r}")
    cores = str(doc.get("cores", "0"))
    if not _CPUS.match(cores):
        raise FleetError(f"{where}.cores", f"must be a CPU list like 0 or 0-1, got {cores!r}")
    highest = max(int(x) for x in re.split(r"[,-]", cores))
    if highest >= (os.cpu_count() or 1):
        raise FleetError(f"{where}.cores", f"CPU {highest} is not on this machine")
    connector = _choice(doc, "connector", where, "none", _CONNECTORS)
    role = _choice(doc, "role", where, "both", _ROLES)
    if role != "both" and connector == "none":
        raise FleetError(f"{where}.connector", f"a {role} engine needs a KV connector (nixl)")
    kv_dtype = doc.get("kv_cache_dtype", "")
    if not isinstance(kv_dtype, str):
        raise FleetError(f"{where}.kv_cache_dtype", f"must be a string, got {kv_dtype!r}")
    return EngineEntry(
        name=name,
        role=role,
        cores=cores,
        cpu_quota=_quota(doc, where),
        kv_cache_gib=_whole(doc, "kv_cache_gib", where, 1, 1),
        kv_blocks=_whole(doc, "kv_blocks", where, 0, 0),
        dtype=_choice(doc, "dtype", where, "bfloat16", _DTYPES),
        kv_cache_dtype=kv_dtype,
        connector=connector,
        max_num_seqs=_whole(doc, "max_num_seqs", where, 0, 0),
    )


def parse_fleet(doc: Any) -> FleetFile:
    """A fleet from its parsed YAML (module docstring); FleetError names what is wrong."""
    if not isinstance(doc, dict):
        raise FleetError("fleet", "must be a mapping with an `engines` list")
    unknown = sorted(set(doc) - {"engines", "declare", "max_model_len"})
    if unknown:
        raise FleetError(unknown[0], "unknown key (known: declare, engines, max_model_len)")
    raw = doc.get("engines")
    if not isinstance(raw, list) or not raw:
        raise FleetError("engines", "must be a non-empty list")
    engines = tuple(_engine(e, i) for i, e in enumerate(raw))
    names = [e.name for e in engines]
    if len(set(names)) != len(names):
        raise FleetError("engines", f"names repeat: {names}")
    has_prefill = any(e.role in ("prefill", "both") for e in engines)
    has_decode = any(e.role in ("decode", "both") for e in engines)
    if not (has_prefill and has_decode):
        raise FleetError("engines", "the fleet needs a prefill and a decode side")
    dec = doc.get("declare") or {}
    if not isinstance(dec, dict):
        raise FleetError("declare", "must be a mapping")
    gpu = dec.get("gpu_type", "cpu-core")
    if not isinstance(gpu, str) or not gpu:
        raise FleetError("declare.gpu_type", f"must be a non-empty string, got {gpu!r}")
    declared = Declared(
        gpu,
        _number(dec, "peak_tflops", "declare", 0.5, 1e-6),
        _number(dec, "hbm_gbps", "declare", 20.0, 1e-6),
    )
    max_len = int(_number(doc, "max_model_len", "fleet", 1024, 64))
    return FleetFile(engines, declared, max_len)


def load_fleet(path: Path) -> FleetFile:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise FleetError(str(path), f"cannot read: {exc.strerror}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise FleetError(str(path), f"invalid YAML: {exc}") from None
    return parse_fleet(doc)


@dataclass
class FleetStack:
    """The fleet file's engines under the real control plane (module docstring). Use as a
    context manager; :meth:`start_router` / :meth:`stop_router` run the peer router with
    one policy at a time."""

    fleet: FleetFile
    work_dir: Path
    log_level: str = "warning"
    engines: dict[str, EngineProcess] = field(default_factory=dict)
    procs: list[AgentProcess] = field(default_factory=list)
    control_plane: subprocess.Popen[bytes] | None = None
    router: subprocess.Popen[bytes] | None = None
    gateway_url: str = ""
    gateway_metrics_url: str = ""  # the gateway's /metrics listener (not its public port)
    router_url: str = ""
    addrs: dict[str, str] = field(default_factory=dict)
    redis_url: str = ""  # the control plane's embedded Redis (the gateway plans over it)
    gateway_mode: str = "embedded"  # or "remote": the gateway plans at the scheduler service
    venv: Path = Path()
    model_dir: Path = Path()

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def logs(self) -> Path:
        return self.work_dir / "logs"

    def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.venv = engines_venv(getattr(sys, "_base_executable", sys.executable))
        self.model_dir = write_tiny_model(self.work_dir / "tiny", self.venv)
        for e in self.fleet.engines:
            spec = EngineSpec(
                e.name, pick_port(), int(re.split(r"[,-]", e.cores)[0]), e.kv_role,
                pick_port() if e.kv_role else 0, dtype=e.dtype, cpu_quota=e.cpu_quota,
                cpus=e.cores, kv_cache_gib=e.kv_cache_gib, kv_cache_dtype=e.kv_cache_dtype,
                max_num_seqs=e.max_num_seqs, kv_blocks=e.kv_blocks,
            )  # fmt: skip
            self.engines[e.name] = EngineProcess(spec, self.venv, self.model_dir, self.logs)
        for proc in self.engines.values():
            proc.start()
        self._start_control_plane()
        for proc in self.engines.values():
            try:
                proc.wait_ready(300)
            except (TimeoutError, RuntimeError):
                proc.kill()
                proc.start_ready(300)  # once more, on new ports
        for e in self.fleet.engines:
            self._start_agent(e)
        self._start_gateway()

    def _start_control_plane(self) -> None:
        ports = {k: pick_port() for k in ("registry", "scheduler", "kvbroker", "redis")}
        self.addrs = {k: f"127.0.0.1:{p}" for k, p in ports.items()}
        hpd = str(Path(sys.executable).with_name("hpd"))
        self.redis_url = embedded_redis_url(self.work_dir / "hpd-up", ports["redis"])
        self.control_plane = subprocess.Popen(
            [
                hpd, "up", "--state-dir", str(self.work_dir / "hpd-up"),
                "--redis-port", str(ports["redis"]),
                "--registry-port", str(ports["registry"]),
                "--scheduler-port", str(ports["scheduler"]),
                "--kvbroker-port", str(ports["kvbroker"]), "--metrics-port", "0",
                "--log-level", self.log_level,
            ],
            stdout=(self.logs / "hpd-up.log").open("ab"), stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=OWN_SESSION,
        )  # fmt: skip

    def _start_agent(self, e: EngineEntry) -> None:
        proc = self.engines[e.name]
        d = self.fleet.declare
        args = [
            "--engine-url", proc.url, "--model-dir", str(self.model_dir), "--role", e.role,
            "--registry", self.addrs["registry"], "--worker-id", e.name,
            "--pool-id", f"tiny-{e.role}", "--gpu-type", d.gpu_type,
            "--peak-tflops", f"{d.peak_tflops:g}", "--hbm-gbps", f"{d.hbm_gbps:g}",
            "--zone", "local", "--scrape-period-s", "0.5", "--log-level", self.log_level,
        ]  # fmt: skip
        if e.kv_role:
            args += ["--kv-connector", "nixl", "--kv-side-channel", proc.side_channel]
        else:
            args += ["--kv-role", "none"]
        agent = AgentProcess(e.name, args, self.logs)
        agent.start()
        self.procs.append(agent)

    def planning_args(self) -> list[str]:
        """Where ``hpd gateway`` plans: in its own process over the control plane's Redis
        (the default), or at the scheduler service (``gateway_mode="remote"``)."""
        if self.gateway_mode == "remote":
            return ["--scheduler", self.addrs["scheduler"]]
        return ["--redis-url", self.redis_url]

    def _start_gateway(self) -> None:
        port, mport = pick_port(), pick_port()
        gateway = AgentProcess(
            "gateway",
            [
                "--port", str(port), "--metrics-port", str(mport), *self.planning_args(),
                "--broker", self.addrs["kvbroker"], "--registry", self.addrs["registry"],
                "--tokenizer", f"tiny={self.model_dir}", "--log-level", self.log_level,
            ],
            self.logs,
            command="gateway",
        )  # fmt: skip
        gateway.start()
        self.procs.append(gateway)
        self.gateway_url = f"http://127.0.0.1:{port}"
        self.gateway_metrics_url = f"http://127.0.0.1:{mport}/metrics"
        wait_http(self.gateway_url + "/health", 60)
        deadline = time.monotonic() + 90
        while len(http_json(self.gateway_url + "/v1/models")["data"]) == 0:
            if time.monotonic() > deadline:
                raise TimeoutError("the engines never registered")
            time.sleep(0.2)

    def start_router(self, policy: str) -> str:
        """The peer router over the same engines with ``policy``; returns its URL."""
        self.stop_router()
        port = pick_port()
        cmd = [str(self.venv / "bin" / "vllm-router"), "--host", "127.0.0.1",
               "--port", str(port), "--policy", policy]  # fmt: skip
        if self.fleet.disaggregated:
            cmd += ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
            for e in self.fleet.engines:
                url = self.engines[e.name].url
                if e.role in ("prefill", "both"):
                    cmd += ["--prefill", url]
                if e.role in ("decode", "both"):
                    cmd += ["--decode", url]
        else:
            cmd += ["--worker-urls", *(self.engines[e.name].url for e in self.fleet.engines)]
        self.router = subprocess.Popen(
            cmd, stdout=(self.logs / f"vllm-router-{policy}.log").open("ab"),
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.router_url = f"http://127.0.0.1:{port}"
        wait_http(self.router_url + "/health", 60)
        return self.router_url

    def stop_router(self) -> None:
        if self.router is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.router.pid, signal.SIGTERM)
        try:
            self.router.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.router.pid, signal.SIGKILL)
            self.router.wait(timeout=10)
        self.router = None
        self.router_url = ""

    def stop(self) -> None:
        """Everything, whatever one part does on the way out (each failure printed)."""
        steps = [self.stop_router, *(p.stop for p in reversed(self.procs))]
        steps += [e.kill for e in self.engines.values()]
        for step in steps:
            try:
                step()
            except Exception as exc:  # reported; the rest still stopped
                print(f"fleet stop: {exc!r}", file=sys.stderr)
        self.procs.clear()
        if self.control_plane is not None:
            self.control_plane.terminate()
            try:
                self.control_plane.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.control_plane.kill()
            self.control_plane = None
