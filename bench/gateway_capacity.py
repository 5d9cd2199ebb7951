"""The front door's capacity: hpd gateway against the peer router (vllm-router, P/D mode)
over engines that answer instantly, so that only the two front doors are measured.

**The engines.** One prefill and one decode emulated engine (``hpd_fleet.engine_http``: each
on its own HTTP port, speaking vLLM's OpenAI API and NIXL's ``kv_transfer_params`` hand-off,
registered with the registry as workers like any agent's engine) run in a process of their
own (this script with ``--serve-engines``, on uvloop). Their compute is zero: the emulated
time runs ``INSTANT_SCALE`` times faster than the wall clock, so a prefill, a decode step and
the KV pull each sleep a few picoseconds (one event-loop turn); what an engine costs is its
HTTP handling. vllm-router runs ``--vllm-pd-disaggregation --kv-connector nixl --prefill URL
--decode URL`` over the very same two ports.

**The clients.** A closed loop in a process of its own per level (this script with
``--client``, aiohttp on uvloop): C requests in flight (1, 4, 16, 64, 256; ``--quick``: 1,
16, 64, 256), each a streamed completion of ``PROMPT_WORDS`` random words and ``MAX_TOKENS``
tokens; a new request as soon as one ends. TTFT is the time to the first SSE ``data:`` event;
a request counts when its stream ended with ``[DONE]`` inside the measured window (after a
warm-up); anything else is an error (HTTP status, cut stream, refused connection), after
which that client waits 10 ms before its next request. At each level the two arms run one
after the other, the order alternating from level to level (full run: ours-router-router-
ours, the two passes of an arm merged), so the machine's noise hits both alike.

**CPU.** utime + stime from ``/proc/<pid>/stat`` of every process of an arm, read by the
client at the start and the end of its window: ours = the gateway and its children, ``hpd
up`` and its children (registry, scheduler, KV broker) and the private ``redis-server``
(anything the gateway calls); the router's = ``vllm-router`` and its children. The engines'
and the client's CPU are read too and shown, but counted in neither arm.

**Processes and threads.** The machine has 2 cores. Our gateway runs ``--workers`` N
processes on its port (default: one per core, ``--workers``), each with its own event loop
and scheduler replica; the control plane's ``hpd up`` is one more process (its default, one
scheduler process), plus Redis. ``vllm-router`` has no option for its
worker threads (``vllm-router --help``; its async runtime starts one worker thread per core,
2 here): it runs with that default, which is what the machine allows it. Neither is pinned.

**Our gateway's mode.** ``--gateway-mode embedded`` (the default) starts ``hpd gateway
--redis-url <the control plane's Redis>`` without ``--scheduler``: it plans in its own
process; ``remote`` plans over the scheduler service (``--scheduler ADDR``, a plan per
request over the scheduler's stream). Our gateway counts prompt tokens with a local
``tokenizer.json`` (``--tokenizer``, as it is deployed; without one it would ask an
engine's ``/tokenize`` on every request) and serves the default profile's ``batch`` tier
(``--default-tier batch``, as ``bench/gateway.py``): admission is not what this measures,
the peer admits everything. Refusals (429) are counted
as errors.

Figures (``--json``, targets from the issue):

* ``max_rps_vs_vllm_router`` (>= 0.5): the highest completed requests/s ours reached at any
  level over the router's highest;
* ``cpu_ms_per_request_vs_vllm_router`` (<= 2.0): CPU ms of every process of ours per
  completed request over the router's, each summed over all levels (CPU over requests);
* ``added_ttft_p50_ms_c1`` (<= 2.0 ms): our TTFT p50 at C=1 minus the instant engines' own
  TTFT p50 (the same request streamed straight to the decode engine, in the same run);
* ``ttft_p99_vs_vllm_router_c64`` (<= 1.25): our TTFT p99 at C=64 over the router's.

Also, without targets: the per-level table (rps, TTFT p50 / p99, CPU ms per request, errors),
the TTFT of the hand-off run by this client itself at C=1 (prefill call, then the decode
stream: the floor of any P/D proxy), and the hand-off modes our gateway's plans used (its
planner may recompute a short prompt on the decode engine: one engine call where the router
always makes two).

    .venv/bin/python bench/gateway_capacity.py --quick --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

# size: a benchmark's procedure, read top to bottom (bench/README.md): the instant engines'
# process, the closed-loop client's process, the stack of both arms and the run, in turn

# --- what is measured -----------------------------------------------------------------------

MODEL = "llama-3-8b"
INSTANT_SCALE = 1e9
"""Emulated ms per wall ms: an H100's 10 ms decode step sleeps 10 ps of wall time."""
CLUSTER: dict[str, Any] = {
    "name": "instant-pd",
    "model": MODEL,
    # a batch cap above the highest level: the planner never sees a full decode batch
    "defaults": {"memory_fraction": 0.9, "max_batch_size": 512, "nic_gbps": 200},
    "pools": [
        {"id": "prefill", "gpu": "H100-SXM", "count": 1, "tp": 1, "stage": "prefill",
         "zone": "a", "rack": "a1"},
        {"id": "decode", "gpu": "H100-SXM", "count": 1, "tp": 1, "stage": "decode",
         "zone": "a", "rack": "a1"},
    ],
    "links": {"classes": {"same_rack": {"gbps": 200, "latency_ms": 0.1},
                          "same_zone": {"gbps": 200, "latency_ms": 0.2}}},
}  # fmt: skip
LEVELS = (1, 4, 16, 64, 256)
LEVELS_QUICK = (1, 16, 64, 256)
MAX_TOKENS = 8
PROMPT_WORDS = 16
TARGETS: dict[str, tuple[str, float]] = {
    "max_rps_vs_vllm_router": (">=", 0.5),
    "cpu_ms_per_request_vs_vllm_router": ("<=", 2.0),
    "added_ttft_p50_ms_c1": ("<=", 2.0),
    "ttft_p99_vs_vllm_router_c64": ("<=", 1.25),
}
WORDS = (
    "the quick brown fox jumps over a lazy dog while prefill and decode share one cache "
    "across the link or recompute it on the other side of a heterogeneous fleet"
)
CLK_TCK = os.sysconf("SC_CLK_TCK")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# --- CPU of process trees -------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (None when it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_s(pid: int) -> float:
    """utime + stime of every thread of ``pid``, in seconds (0 when it is gone)."""
    f = _stat(pid)
    return (int(f[11]) + int(f[12])) / CLK_TCK if f else 0.0


def tree(roots: Sequence[int]) -> list[int]:
    """``roots`` and every live descendant of theirs."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            f = _stat(int(entry.name))
            if f:
                children.setdefault(int(f[1]), []).append(int(entry.name))
    out: list[int] = []
    todo = [p for p in roots if _stat(p) is not None]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


# --- the engines (a process of their own) ---------------------------------------------------


async def serve_engines(registry: str, broker: str) -> None:
    """The instant engines, registered with the registry; prints one JSON line of their
    endpoints by stage once both serve, then serves until SIGTERM or SIGINT."""
    import grpc

    from hpd_agent.worker_client import ClientTiming
    from hpd_common.clock import SystemClock
    from hpd_common.logging import configure_logging
    from hpd_fleet.engine import EmuTime
    from hpd_fleet.engine_http import FleetHttp
    from hpd_fleet.fleet import Fleet
    from hpd_scheduler.policy import Stage
    from hpd_sim.cluster import parse_cluster

    configure_logging("warning")
    cluster = parse_cluster(CLUSTER)
    emu = EmuTime(INSTANT_SCALE, time.monotonic, asyncio.sleep, start=time.monotonic())
    reg_ch, kb_ch = grpc.aio.insecure_channel(registry), grpc.aio.insecure_channel(broker)
    fleet = Fleet(
        cluster, reg_ch, kb_ch, emu, SystemClock(), random.Random(7),
        timing=ClientTiming(report_interval_s=0.5),  # an agent's scrape period
    )  # fmt: skip
    http = FleetHttp(fleet)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await http.start()
        await fleet.start()
        by_stage = {
            ("prefill" if w.view.stage == Stage.PREFILL else "decode"): http.endpoint(w.worker_id)
            for w in fleet
        }
        print(json.dumps(by_stage), flush=True)
        await stop.wait()
    finally:
        await fleet.stop()
        await http.stop()
        await reg_ch.close()
        await kb_ch.close()


# --- the closed-loop client (a process of its own per level) --------------------------------


def _bodies(seed: int, n: int = 512) -> list[dict[str, Any]]:
    """``n`` completions of ``PROMPT_WORDS`` words drawn at random, used in turn (the
    emulated engines keep no prefix cache: repeats help neither arm)."""
    rng = random.Random(seed)
    words = WORDS.split()
    return [
        {"model": MODEL, "prompt": " ".join(rng.choices(words, k=PROMPT_WORDS)),
         "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
        for _ in range(n)
    ]  # fmt: skip


class HttpError(RuntimeError):
    """A front door's or engine's answer other than 200 (its body's start kept)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"http_{status}")
        self.body = body


async def _stream(http: Any, url: str, data: bytes, t0: float) -> float:
    """POST a streamed completion; seconds from ``t0`` to its first ``data:`` event. Raises
    on an HTTP error and on a stream that does not end with ``[DONE]``."""
    first = 0.0
    done = False
    async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise HttpError(resp.status, (await resp.read())[:300].decode(errors="replace"))
        async for line in resp.content:
            if line.startswith(b"data:"):
                if not first:
                    first = time.perf_counter() - t0
                if line[5:].strip() == b"[DONE]":
                    done = True
    if not done:
        raise RuntimeError("stream_without_done")
    return first


async def _handoff(http: Any, prefill: str, decode: str, body: dict[str, Any], t0: float) -> float:
    """vLLM's hand-off run by the client itself (the prefill call, then the decode stream):
    seconds from ``t0`` to the decode stream's first event."""
    first = {**body, "stream": False, "max_tokens": 1,
             "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    async with http.post(prefill + "/v1/completions", json=first) as resp:
        if resp.status != 200:
            raise HttpError(resp.status, (await resp.read())[:300].decode(errors="replace"))
        params = (await resp.json())["kv_transfer_params"]
    data = json.dumps({**body, "kv_transfer_params": params}).encode()
    return await _stream(http, decode + "/v1/completions", data, t0)


def _cpu(groups: dict[str, list[int]]) -> dict[str, float]:
    out = {name: sum(cpu_s(p) for p in pids) for name, pids in groups.items()}
    out["client"] = cpu_s(os.getpid())
    return out


async def drive(spec: dict[str, Any]) -> dict[str, Any]:
    """One closed-loop level (module docstring): ``spec`` names the arm, its URLs, the
    concurrency, the warm-up and window seconds and the process groups whose CPU to read
    at the window's edges. Returns the window's completions, TTFTs, errors and CPU."""
    import aiohttp

    c, warm, secs = int(spec["concurrency"]), float(spec["warmup_s"]), float(spec["seconds"])
    urls: dict[str, str] = spec["urls"]
    bodies = _bodies(int(spec["seed"]))
    datas = [json.dumps(b).encode() for b in bodies]
    t_begin = time.perf_counter()
    t_start, t_end = t_begin + warm, t_begin + warm + secs
    done: list[tuple[float, float]] = []  # (end, ttft) of every request that succeeded
    failed: list[tuple[float, str]] = []
    samples: dict[str, str] = {}  # the first error of each kind, for the log
    edges: dict[str, Any] = {}

    async def one(http: Any, i: int, t0: float) -> float:
        if spec["arm"] == "handoff":
            return await _handoff(http, urls["prefill"], urls["decode"], bodies[i], t0)
        return await _stream(http, urls["front"] + "/v1/completions", datas[i], t0)

    async def worker(http: Any, k: int) -> None:
        i = k
        while time.perf_counter() < t_end:
            i = (i + c) % len(datas)
            t0 = time.perf_counter()
            try:
                ttft = await one(http, i, t0)
            except (aiohttp.ClientError, RuntimeError, OSError, TimeoutError, KeyError) as exc:
                kind = str(exc) if isinstance(exc, RuntimeError) else type(exc).__name__
                failed.append((time.perf_counter(), kind))
                samples.setdefault(kind, getattr(exc, "body", "") or repr(exc))
                await asyncio.sleep(0.01)  # a refusing front door is not hammered
                continue
            done.append((time.perf_counter(), ttft))

    async def edge() -> None:
        await asyncio.sleep(max(0.0, t_start - time.perf_counter()))
        edges["start"], edges["cpu0"] = time.perf_counter(), _cpu(spec["pids"])
        await asyncio.sleep(max(0.0, t_end - time.perf_counter()))
        edges["end"], edges["cpu1"] = time.perf_counter(), _cpu(spec["pids"])

    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        await asyncio.gather(edge(), *(worker(http, k) for k in range(c)))
    start, end = edges["start"], edges["end"]
    ttft = [t * 1000.0 for e, t in done if start <= e <= end]
    errors: dict[str, int] = {}
    for e, kind in failed:
        if start <= e <= end:
            errors[kind] = errors.get(kind, 0) + 1
    return {
        "completed": len(ttft),
        "window_s": end - start,
        "ttft_ms": [round(t, 4) for t in ttft],
        "errors": errors,
        "error_samples": {k: v for k, v in samples.items() if k in errors},
        "cpu_s": {k: edges["cpu1"][k] - edges["cpu0"][k] for k in edges["cpu0"]},
    }


# --- the stack ------------------------------------------------------------------------------


class StartError(RuntimeError):
    """A component did not start; the message says which and where its log is."""


def _tail(path: Path, n: int = 1500) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-n:]
    return ""


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _port_open(addr: str) -> bool:
    host, port = addr.rsplit(":", 1)
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=0.5):
        return True
    return False


@dataclass
class Stack:
    """Redis, ``hpd up``, the instant engines, our gateway and the router, each a process
    (a group of its own) on free ports of 127.0.0.1; :meth:`stop` ends every one."""

    work: Path
    mode: str  # "embedded" or "remote"
    workers: int = 1  # our gateway's processes on its port (--workers)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    redis: Any = None
    addrs: dict[str, str] = field(default_factory=dict)
    engines: dict[str, str] = field(default_factory=dict)
    gateway_url: str = ""
    metrics_url: str = ""
    metrics_urls: list[str] = field(default_factory=list)  # one per worker
    router_url: str = ""
    _files: list[IO[bytes]] = field(default_factory=list)

    def _spawn(self, name: str, cmd: list[str], stdout: int | None = None) -> None:
        log = self.work / f"{name}.log"
        self.logs[name] = log
        f = log.open("ab")
        self._files.append(f)
        try:
            self.procs[name] = subprocess.Popen(
                cmd, stdout=stdout if stdout is not None else f, stderr=f,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            raise StartError(f"{name}: cannot run {cmd[0]}: {exc}") from exc

    def _wait(self, name: str, ready: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        proc = self.procs[name]
        while not ready():
            if proc.poll() is not None:
                raise StartError(
                    f"{name} exited with {proc.returncode} at start; {self.logs[name]}:\n"
                    + _tail(self.logs[name])
                )
            if time.monotonic() > deadline:
                raise StartError(f"{name} not ready after {timeout_s:.0f} s; see {self.logs[name]}")
            time.sleep(0.1)

    def start(self, router_bin: Path) -> None:
        from hpd_fleet.real_processes import pick_port
        from hpd_fleet.tiny_model import train_tokenizer
        from hpd_tools.embedded_redis import EmbeddedRedis

        hpd = str(Path(sys.executable).with_name("hpd"))
        try:
            self.redis = EmbeddedRedis(self.work / "redis", persist=False).start()
        except Exception as exc:
            raise StartError(f"redis-server: {exc}") from exc
        ports = {k: pick_port() for k in ("registry", "scheduler", "kvbroker")}
        self.addrs = {k: f"127.0.0.1:{p}" for k, p in ports.items()}
        self._spawn("hpd-up", [
            hpd, "up", "--redis-url", self.redis.url, "--state-dir", str(self.work / "up"),
            "--registry-port", str(ports["registry"]),
            "--scheduler-port", str(ports["scheduler"]),
            "--kvbroker-port", str(ports["kvbroker"]), "--metrics-port", "0",
            "--log-level", "warning",
        ])  # fmt: skip
        self._wait("hpd-up", lambda: b"Ctrl-C" in self.logs["hpd-up"].read_bytes(), 60)

        self._spawn("engines", [
            sys.executable, __file__, "--serve-engines",
            self.addrs["registry"], self.addrs["kvbroker"],
        ], stdout=subprocess.PIPE)  # fmt: skip
        self.engines = self._engine_line(60)

        tok = self.work / "tokenizer"
        tok.mkdir()
        train_tokenizer(tok)
        port, mport = pick_port(), pick_port()
        self.gateway_url = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{mport}/metrics"
        self.metrics_urls = [f"http://127.0.0.1:{mport + i}/metrics" for i in range(self.workers)]
        plan = (
            ["--redis-url", self.redis.url]
            if self.mode == "embedded"
            else ["--scheduler", self.addrs["scheduler"]]
        )
        self._spawn("hpd-gateway", [
            hpd, "gateway", "--port", str(port), "--metrics-port", str(mport), *plan,
            "--broker", self.addrs["kvbroker"], "--registry", self.addrs["registry"],
            "--tokenizer", f"{MODEL}={tok}", "--default-tier", "batch",
            "--workers", str(self.workers), "--log-level", "warning",
        ])  # fmt: skip
        self._wait("hpd-gateway", lambda: _http_ok(self.gateway_url + "/health"), 60)
        self._wait("hpd-gateway", self._gateway_sees_model, 60)

        port = pick_port()
        self.router_url = f"http://127.0.0.1:{port}"
        self._spawn("vllm-router", [
            str(router_bin), "--host", "127.0.0.1", "--port", str(port),
            "--policy", "round_robin", "--vllm-pd-disaggregation", "--kv-connector", "nixl",
            "--prefill", "http://" + self.engines["prefill"],
            "--decode", "http://" + self.engines["decode"], "--log-level", "warning",
        ])  # fmt: skip
        self._wait("vllm-router", lambda: _http_ok(self.router_url + "/health"), 60)

    def _engine_line(self, timeout_s: float) -> dict[str, str]:
        """The engines' endpoints, from the first line their process prints."""
        import select

        proc = self.procs["engines"]
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else b""
        if not line:
            proc.poll()
            raise StartError(
                f"the engines did not start (exit {proc.returncode}); {self.logs['engines']}:\n"
                + _tail(self.logs["engines"])
            )
        got: dict[str, str] = json.loads(line)
        return got

    def _gateway_sees_model(self) -> bool:
        try:
            with urllib.request.urlopen(self.gateway_url + "/v1/models", timeout=2) as resp:
                return bool(json.loads(resp.read())["data"])
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            return False

    def pids(self) -> dict[str, dict[str, list[int]]]:
        """Every process of each arm by part (module docstring), and the engines'."""
        redis = [self.redis.pid] if self.redis is not None and self.redis.pid else []

        def of(name: str) -> list[int]:
            return tree([self.procs[name].pid]) if name in self.procs else []

        return {
            "ours": {"gateway": of("hpd-gateway"), "hpd-up": of("hpd-up"), "redis": tree(redis)},
            "router": {"vllm-router": of("vllm-router")},
            "engines": {"engines": of("engines")},
        }

    def threads(self) -> dict[str, int]:
        """Threads of each process this run started (``/proc/<pid>/task``)."""
        out: dict[str, int] = {}
        for name, proc in self.procs.items():
            with contextlib.suppress(OSError):
                out[name] = len(list(Path(f"/proc/{proc.pid}/task").iterdir()))
        return out

    def stop(self) -> None:
        """SIGTERM to every group, newest first; SIGKILL after 10 s; Redis last."""
        for name, proc in reversed(list(self.procs.items())):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                say(f"{name} did not stop on SIGTERM: killed")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # and anything left in its group
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            if proc.stdout is not None:
                proc.stdout.close()
        self.procs.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        for f in self._files:
            f.close()
        self._files.clear()


def gateway_modes(metrics_urls: Sequence[str]) -> dict[str, int]:
    """Our gateway's requests so far by the hand-off mode used (``hpd_gateway_requests``),
    summed over its workers."""
    from prometheus_client.parser import text_string_to_metric_families

    text = ""
    for url in metrics_urls:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text += resp.read().decode()
    modes: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "hpd_gateway_requests":
            for s in family.samples:
                if s.name.endswith("_total"):
                    key = s.labels.get("mode", "") or "-"
                    modes[key] = modes.get(key, 0) + int(s.value)
    return modes


# --- the run --------------------------------------------------------------------------------

ARMS = ("hpd-gateway", "vllm-router")


def run_client(
    stack: Stack, arm: str, c: int, warmup_s: float, seconds: float, seed: int
) -> dict[str, Any]:
    """One level of one arm in a client process of its own; its result."""
    pids = stack.pids()
    urls = {
        "hpd-gateway": {"front": stack.gateway_url},
        "vllm-router": {"front": stack.router_url},
        "engine": {"front": "http://" + stack.engines["decode"]},
        "handoff": {k: "http://" + v for k, v in stack.engines.items()},
    }[arm]
    group = {"hpd-gateway": "ours", "vllm-router": "router"}.get(arm, "")
    spec = {
        "arm": arm, "urls": urls, "concurrency": c, "warmup_s": warmup_s, "seconds": seconds,
        "seed": seed,
        "pids": {
            **{f"front:{k}": v for k, v in (pids[group] if group else {}).items()},
            "engines": pids["engines"]["engines"],
        },
    }  # fmt: skip
    done = subprocess.run(
        [sys.executable, __file__, "--client", json.dumps(spec)],
        capture_output=True, text=True, timeout=warmup_s + seconds + 120, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"client of {arm} at C={c} failed: {done.stderr[-2000:]}")
    got: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return got


def merge(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """One level's passes of one arm as one: sums, and the TTFTs pooled."""
    completed = sum(p["completed"] for p in passes)
    window = sum(p["window_s"] for p in passes)
    ttft = [t for p in passes for t in p["ttft_ms"]]
    errors: dict[str, int] = {}
    cpu: dict[str, float] = {}
    samples: dict[str, str] = {}
    modes: dict[str, int] = {}
    for p in passes:
        for k, n in p.get("modes", {}).items():
            modes[k] = modes.get(k, 0) + n
        for k, v in p.get("error_samples", {}).items():
            samples.setdefault(k, v)
        for k, v in p["errors"].items():
            errors[k] = errors.get(k, 0) + v
        for k, v in p["cpu_s"].items():
            cpu[k] = cpu.get(k, 0.0) + v
    per_req = 1000.0 / completed if completed else float("nan")
    front = sum(v for k, v in cpu.items() if k.startswith("front:"))
    return {
        "completed": completed,
        "window_s": round(window, 3),
        "rps": completed / window if window > 0 else 0.0,
        "ttft_p50_ms": pct(ttft, 0.5),
        "ttft_p99_ms": pct(ttft, 0.99),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "error_samples": samples,
        **({"plans_by_mode": {k: n for k, n in modes.items() if n}} if modes else {}),
        "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
        "cpu_ms_per_request": front * per_req,
        "cpu_ms_per_request_by_process": {
            k.removeprefix("front:"): v * per_req for k, v in cpu.items() if k.startswith("front:")
        },
        "engines_cpu_ms_per_request": cpu.get("engines", 0.0) * per_req,
        "client_cpu_ms_per_request": cpu.get("client", 0.0) * per_req,
    }


def measure(
    stack: Stack, levels: Sequence[int], warmup_s: float, seconds: float, twice: bool
) -> dict[str, dict[int, dict[str, Any]]]:
    """Every level of every arm, the order alternating (module docstring); C=1 also runs the
    engine alone and the client's own hand-off."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    seed = 1
    for i, c in enumerate(levels):
        order = list(ARMS) if i % 2 == 0 else list(reversed(ARMS))
        if c == 1:
            order = ["engine", *order, "handoff"]
        if twice:
            order += list(reversed(order))
        passes: dict[str, list[dict[str, Any]]] = {}
        for arm in order:
            seed += 1
            before = gateway_modes(stack.metrics_urls) if arm == "hpd-gateway" else {}
            got = run_client(stack, arm, c, warmup_s, seconds, seed)
            if arm == "hpd-gateway":  # the pass's plans by mode, its warm-up included
                after = gateway_modes(stack.metrics_urls)
                got["modes"] = {k: v - before.get(k, 0) for k, v in after.items()}
            passes.setdefault(arm, []).append(got)
            say(
                f"  C={c:<3} {arm:<11} {got['completed'] / got['window_s']:8.0f} req/s  "
                f"TTFT p50 {pct(got['ttft_ms'], 0.5):6.2f} ms  errors {sum(got['errors'].values())}"
            )
        for arm, ps in passes.items():
            out.setdefault(arm, {})[c] = merge(ps)
    return out


def figures(levels: dict[str, dict[int, dict[str, Any]]]) -> dict[str, float]:
    ours, peer = levels["hpd-gateway"], levels["vllm-router"]

    def cpu_ms_per_req(arm: dict[int, dict[str, Any]]) -> float:
        cpu = sum(c for v in arm.values() for k, c in v["cpu_s"].items() if k.startswith("front:"))
        n = sum(v["completed"] for v in arm.values())
        return cpu * 1000.0 / n if n else float("nan")

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    out = {
        "max_rps_vs_vllm_router": ratio(
            max(v["rps"] for v in ours.values()), max(v["rps"] for v in peer.values())
        ),
        "cpu_ms_per_request_vs_vllm_router": ratio(cpu_ms_per_req(ours), cpu_ms_per_req(peer)),
        "added_ttft_p50_ms_c1": float("nan"),
        "ttft_p99_vs_vllm_router_c64": float("nan"),
        "cpu_ms_per_request_ours": cpu_ms_per_req(ours),
        "cpu_ms_per_request_vllm_router": cpu_ms_per_req(peer),
    }
    if 1 in ours and "engine" in levels:
        out["added_ttft_p50_ms_c1"] = ours[1]["ttft_p50_ms"] - levels["engine"][1]["ttft_p50_ms"]
    if 64 in ours:
        out["ttft_p99_vs_vllm_router_c64"] = ratio(ours[64]["ttft_p99_ms"], peer[64]["ttft_p99_ms"])
    return out


def finite(obj: Any) -> Any:
    """``obj`` with every NaN (a figure whose level did not run) as None: strict JSON."""
    if isinstance(obj, float):
        return obj if obj == obj else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj


def verdict(name: str, value: float) -> str:
    op, target = TARGETS[name]
    if value != value:
        return f"target {op} {target:g}: not measured (its level did not run)"
    met = value >= target if op == ">=" else value <= target
    return f"target {op} {target:g}: {'met' if met else 'NOT met'}"


def table(levels: dict[str, dict[int, dict[str, Any]]]) -> str:
    rows = [
        f"{'arm':<12} {'C':>4} {'req/s':>8} {'TTFT p50':>9} {'p99 ms':>8} {'CPU ms/req':>11} "
        f"{'errors':>7} {'engines ms/req':>15}  plans"
    ]
    for arm in ("engine", "handoff", *ARMS):
        for c, v in sorted(levels.get(arm, {}).items()):
            cpu = f"{v['cpu_ms_per_request']:.3f}" if arm in ARMS else "-"
            modes = v.get("plans_by_mode", {})
            plans = ", ".join(f"{k} {n}" for k, n in sorted(modes.items()))
            rows.append(
                f"{arm:<12} {c:>4} {v['rps']:>8.0f} {v['ttft_p50_ms']:>9.2f} "
                f"{v['ttft_p99_ms']:>8.2f} {cpu:>11} {v['errors']:>7} "
                f"{v['engines_cpu_ms_per_request']:>15.3f}  {plans}"
            )
    return "\n".join(rows)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    say("terminated: stopping everything this run started")
    raise SystemExit(128 + signum)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument(
        "--quick", action="store_true", help="4 shorter levels: about a minute (full run: 5 min)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--gateway-mode", choices=("embedded", "remote"), default="embedded",
                    help="embedded: the gateway plans itself (--redis-url); remote: over the "
                    "scheduler service (--scheduler)")  # fmt: skip
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                    help="our gateway's processes (--workers; default one per core, as the "
                    "router's runtime runs a worker thread per core)")  # fmt: skip
    ap.add_argument("--levels", default="", help="comma-separated concurrencies (overrides)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    ap.add_argument("--serve-engines", nargs=2, metavar=("REGISTRY", "BROKER"),
                    help=argparse.SUPPRESS)  # fmt: skip
    ap.add_argument("--client", metavar="SPEC", help=argparse.SUPPRESS)
    return ap


def _print_report(
    results: dict[str, dict[int, dict[str, Any]]], figs: dict[str, float], out: dict[str, Any]
) -> None:
    """The human-readable report: the per-level table, the figures against their targets,
    and where our CPU went."""
    print(table(results))
    print()
    for name in TARGETS:
        print(f"{name}: {figs[name]:.3f}  ({verdict(name, figs[name])})")
    print(
        f"CPU ms/request: ours {figs['cpu_ms_per_request_ours']:.3f}, vllm-router "
        f"{figs['cpu_ms_per_request_vllm_router']:.3f}; engine TTFT p50 at C=1 "
        f"{out['engine_ttft_p50_ms_c1']:.2f} ms, the client's own hand-off "
        f"{out['handoff_ttft_p50_ms_c1']:.2f} ms; gateway mode {out['gateway_mode']}, plans by "
        f"mode {out['gateway_modes_used']}"
    )
    parts = {
        k: sum(lv["cpu_s"].get(f"front:{k}", 0.0) for lv in results["hpd-gateway"].values())
        for k in ("gateway", "hpd-up", "redis")
    }
    total = sum(parts.values()) or 1.0
    print(
        "our CPU by process: "
        + ", ".join(f"{k} {100 * v / total:.0f} %" for k, v in parts.items())
        + f"; threads at start: {out['threads']}"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.serve_engines or args.client:
        from hpd_common.aio import run

        if args.serve_engines:
            run(serve_engines(*args.serve_engines))
        else:
            print(json.dumps(run(drive(json.loads(args.client)))), flush=True)
        return 0
    signal.signal(signal.SIGTERM, _on_sigterm)
    levels = tuple(int(x) for x in args.levels.split(",") if x) or (
        LEVELS_QUICK if args.quick else LEVELS
    )
    warmup_s, seconds, twice = (1.0, 4.0, False) if args.quick else (2.0, 8.0, True)
    mode = args.gateway_mode
    from hpd_fleet.real_install import engines_venv

    try:  # where bench/gateway.py finds it: the engines' virtualenv (installed once)
        venv = engines_venv(getattr(sys, "_base_executable", sys.executable))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        say(f"error: the engines' virtualenv (vllm-router) could not be installed: {exc}")
        return 1
    work = Path(tempfile.mkdtemp(prefix="hpd-bench-gwcap-"))
    stack = Stack(work, mode, args.workers)
    t0 = time.perf_counter()
    try:
        say(f"starting redis, hpd up, the instant engines, hpd gateway ({mode}), vllm-router ...")
        stack.start(venv / "bin" / "vllm-router")
        setup_s = time.perf_counter() - t0
        threads = stack.threads()
        for arm in ARMS:  # connections, the scheduler's first measurements of the engines
            warm = run_client(stack, arm, 4, 0.0, 3.0, 0)
            if warm["completed"] == 0:
                raise StartError(f"{arm} served no request in its warm-up: {warm['errors']}")
        results = measure(stack, levels, warmup_s, seconds, twice)
        modes = gateway_modes(stack.metrics_urls)
    except (StartError, RuntimeError) as exc:
        say(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        stack.stop()
        if not args.keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"logs kept in {work}")
    figs = figures(results)
    out: dict[str, Any] = {
        **figs,
        "targets": {k: f"{op} {t:g}" for k, (op, t) in TARGETS.items()},
        "engine_ttft_p50_ms_c1": results.get("engine", {}).get(1, {}).get("ttft_p50_ms", math.nan),
        "handoff_ttft_p50_ms_c1": results.get("handoff", {})
        .get(1, {})
        .get("ttft_p50_ms", math.nan),
        "gateway_mode": mode,
        "gateway_workers": args.workers,
        "gateway_modes_used": modes,
        "threads": threads,
        "levels": {arm: {str(c): v for c, v in lv.items()} for arm, lv in results.items()},
        "max_tokens": MAX_TOKENS,
        "prompt_words": PROMPT_WORDS,
        "seconds_per_pass": seconds,
        "passes_per_level": 2 if twice else 1,
        "setup_s": round(setup_s, 1),
        "total_s": round(time.perf_counter() - t0, 1),
        "cpus": os.cpu_count(),
        "quick": args.quick,
    }
    if args.json:
        print(json.dumps(finite(out)))
    else:
        _print_report(results, figs, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
