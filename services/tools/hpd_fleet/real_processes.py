"""Real engine processes on this machine: ``vllm serve`` and ``hpd agent``, started in
sessions of their own, with the HTTP and port helpers their callers share.

* :class:`EngineProcess` starts one ``vllm serve`` (its own process group, so a SIGKILL
  takes the engine core with it), waits for ``/health``, kills and restarts it;
* :class:`AgentProcess` runs ``hpd agent`` for one engine;
* :func:`pick_port`, :func:`wait_http`, :func:`http_json`: what starting and probing
  them needs.

The engines come from the virtualenv ``hpd_fleet.real_install`` makes; ``hpd_fleet.real``
puts a whole stack together.
"""

from __future__ import annotations

import contextlib
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

from hpd_fleet.cgroups import CpuQuota
from hpd_fleet.real_install import say

__all__ = [
    "ENGINE_ENV",
    "OWN_SESSION",
    "AgentProcess",
    "EngineProcess",
    "EngineSpec",
    "http_json",
    "http_text",
    "pick_port",
    "wait_http",
]


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
    cpu_quota: float = 0.0  # CPU time in cores (cgroup quota; 0 = none): a slower engine
    cpus: str = ""  # the CPUs its threads may run on ("0", "0-1"; "" = the one ``core``)
    kv_cache_gib: int = 1  # its KV cache in whole GiB (VLLM_CPU_KVCACHE_SPACE)
    kv_blocks: int = 0  # fewer KV blocks than fit (--num-gpu-blocks-override; 0 = all)
    kv_cache_dtype: str = ""  # vLLM's --kv-cache-dtype ("" = the model's dtype)
    max_num_seqs: int = 0  # vLLM's --max-num-seqs (0 = its default)
    nixl_threads: int = 0  # NIXL's UCX threads (0 = vLLM's default)


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
    quota: CpuQuota | None = field(default=None, repr=False)

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
            cfg: dict[str, Any] = {
                "kv_connector": "NixlConnector", "kv_role": s.role, "kv_buffer_device": "cpu"
            }  # fmt: skip
            if s.nixl_threads:
                cfg["kv_connector_extra_config"] = {"num_threads": s.nixl_threads}
            cmd += ["--kv-transfer-config", json.dumps(cfg)]
        if s.kv_cache_dtype:
            cmd += ["--kv-cache-dtype", s.kv_cache_dtype]
        if s.max_num_seqs:
            cmd += ["--max-num-seqs", str(s.max_num_seqs)]
        if s.kv_blocks:
            cmd += ["--num-gpu-blocks-override", str(s.kv_blocks)]
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
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(
                f"engine {self.spec.name} is still running (pid {self.proc.pid}): stop it first"
            )
        s = self.spec
        cpus = s.cpus or str(s.core)
        env = {
            **os.environ, **ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": cpus,
            "VLLM_CPU_KVCACHE_SPACE": str(s.kv_cache_gib),
        }  # fmt: skip
        if s.side_channel_port:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(s.side_channel_port)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        self._log_file = (self.log_dir / f"engine-{s.name}.log").open("ab")
        cmd = self.command()
        if shutil.which("taskset"):
            # every thread of the engine on its core (the NIXL progress thread spins, and
            # unpinned it takes its share of the other engine's core)
            cmd = ["taskset", "-c", cpus, *cmd]
        if s.cpu_quota > 0:
            # in its cgroup from its first instruction (hpd_fleet.cgroups); limited once it
            # is up (wait_ready), so its start does not crawl at the quota
            self.quota = CpuQuota(s.name, s.cpu_quota)
            cmd = self.quota.wrap(cmd, limited=False)
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
                if self.quota is not None:
                    self.quota.limit()
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
                say(f"engine {self.spec.name}: start failed ({exc}); retrying on new ports")
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
        if self.quota is not None:
            self.quota.remove()
            self.quota = None
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


def reap(tag: str) -> int:
    """SIGKILL every process (and its group) whose environment holds ``tag`` (``NAME=VALUE``),
    except this one and its ancestors: what a run started and lost track of (an engine a
    failed test restarted over a live one). Returns how many were killed."""
    own = {os.getpid()}
    pid = os.getpid()
    while pid > 1:  # our ancestors carry the tag too (the script that exported it)
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            pid = int(fields[1])
        except (OSError, ValueError, IndexError):
            break
        own.add(pid)
    want = tag.encode()
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in own:
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in env:
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
    return killed
