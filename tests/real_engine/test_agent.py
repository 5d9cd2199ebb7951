"""`hpd agent` against real vLLM engines: what registers, how load follows, how workers
leave and come back, drain, and a KV-incompatible pair that is really incompatible."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hpd_fleet.real_processes import AgentProcess, http_json
from tests.real_engine.conftest import SCRAPE_PERIOD_S, RealFleet

PROMPT = "transfer the cache over the link or recompute it on the decode worker " * 20


def hpd(*args: str) -> str:
    out = subprocess.run(
        [str(Path(sys.executable).with_name("hpd")), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return out.stdout


def cache_config(metrics: str) -> dict[str, str]:
    line = next(ln for ln in metrics.splitlines() if ln.startswith("vllm:cache_config_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


def gauge(metrics: str, name: str, **labels: str) -> float:
    total = 0.0
    for ln in metrics.splitlines():
        if ln.startswith(name + "{") and all(f'{k}="{v}"' in ln for k, v in labels.items()):
            total += float(ln.rsplit(" ", 1)[1])
    return total


def test_every_engine_registers_the_kv_format_its_engine_states(pd_pair: RealFleet) -> None:
    """The registry's KV format is what each engine's cache_config_info and config.json
    say: the dtype follows from the engine's KV bytes per token, not from a flag."""
    real = pd_pair
    workers = {
        w["capability"]["worker_id"]: w
        for w in json.loads(hpd("workers", "--registry", real.registry_addr, "-o", "json"))
    }
    assert {"p0", "d0"} <= set(workers)
    for wid, engine in (("p0", "prefill"), ("d0", "decode")):
        check_kv_format(real, workers[wid], engine, "KV_DTYPE_BF16")
    table = hpd("workers", "--registry", real.registry_addr)
    assert re.search(r"^p0\s", table, re.M) and re.search(r"^d0\s", table, re.M), table


def check_kv_format(real: RealFleet, worker: dict[str, Any], engine: str, dtype: str) -> None:
    cfg = json.loads((real.model_dir / "config.json").read_text())
    wid = worker["capability"]["worker_id"]
    info = cache_config(real.engines[engine].metrics())
    kv = worker["capability"]["kv_format"]
    per_token = int(info["kv_cache_memory_bytes"]) / int(info["kv_cache_size_tokens"])
    elem = per_token / (2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"])
    # the cache holds whole blocks, so memory / tokens is the width only to a few 1e-4
    assert {"KV_DTYPE_BF16": 2, "KV_DTYPE_FP32": 4}[dtype] == round(elem * 4) / 4, (wid, elem)
    assert kv["dtype"] == dtype, wid
    assert kv["block_size_tokens"] == int(info["block_size"]) == 128, wid
    assert kv["num_layers"] == cfg["num_hidden_layers"]
    assert kv["num_kv_heads"] == cfg["num_key_value_heads"]
    assert kv["head_dim"] == cfg["head_dim"]
    cap = worker["capability"]
    assert int(cap["kv_memory_total_bytes"]) == int(info["kv_cache_memory_bytes"])
    assert cap["engine"] == "vllm" and cap["engine_version"] == "0.32.0"
    assert cap["labels"]["kv-connector"] == "nixl"
    assert cap["labels"]["kv-side-channel"] == real.engines[engine].side_channel
    assert worker["status"]["health"] == "HEALTH_STATE_HEALTHY"


def _flood(url: str, n: int, max_tokens: int) -> list[threading.Thread]:
    def one() -> None:
        body = {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
        # an engine killed under its requests is what some tests are about
        with contextlib.suppress(urllib.error.URLError, OSError):
            http_json(url + "/v1/completions", body, timeout=120)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_load_in_the_registry_follows_the_engine(pd_pair: RealFleet) -> None:
    """With N requests in flight on the decode engine, the registry shows them within two
    scrape periods of the engine's own /metrics showing them; the engine prefilled them, so
    a report shows a prefill busy share above 0 (and at most 1) while they decode (priced
    at the phase seconds of a request the engine has finished before)."""
    real = pd_pair
    n = 4
    engine = real.engines["decode"]
    for t in _flood(engine.url, 1, max_tokens=2):
        t.join(timeout=60)
    threads = _flood(engine.url, n, max_tokens=300)
    seen_engine = seen_registry = None
    busiest = 0.0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and seen_registry is None:
        now = time.monotonic()
        if seen_engine is None:
            m = engine.metrics()
            in_flight = gauge(m, "vllm:num_requests_running") + gauge(
                m, "vllm:num_requests_waiting"
            )
            if in_flight >= n:
                seen_engine = now
        got = real.worker("d0")
        assert got is not None
        load = got.worker.load
        busiest = max(busiest, load.prefill_busy)
        if seen_engine is not None and load.batch_size + load.queue_depth >= n:
            seen_registry = time.monotonic()
        time.sleep(0.05)
    # the prefilled tokens are counted by the first scrape after them, while the requests
    # decode
    while busiest == 0.0 and any(t.is_alive() for t in threads):
        got = real.worker("d0")
        assert got is not None
        busiest = max(busiest, got.worker.load.prefill_busy)
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=120)
    assert seen_engine is not None, "the engine never had the requests in flight"
    assert seen_registry is not None, "the registry never showed them"
    lag = seen_registry - seen_engine
    # two periods, plus the slack of a 2-core machine whose engines spin on both cores
    assert lag <= 2 * SCRAPE_PERIOD_S + 0.5, f"registry lagged the engine by {lag:.2f} s"
    assert 0.0 < busiest <= 1.0, f"prefill busy share {busiest}"
    # and back to idle once they finish
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        got = real.worker("d0")
        if got is not None and got.worker.load.batch_size == 0:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the registry kept showing finished requests")


@pytest.fixture
def extra_agent(pd_pair: RealFleet) -> Iterator[tuple[str, AgentProcess]]:
    """A second agent on the prefill engine, with a worker id of its own."""
    real = pd_pair
    wid = f"p-extra-{time.monotonic_ns() % 10**6}"
    agent = real.start_agent(wid, "prefill", wid, "prefill")
    real.wait_worker(wid, timeout_s=30)
    yield wid, agent
    agent.stop()


def test_sigterm_of_an_agent_deregisters_its_worker_at_once(
    real: RealFleet, extra_agent: tuple[str, AgentProcess]
) -> None:
    wid, agent = extra_agent
    agent.signal(signal.SIGTERM)
    gone_after = real.wait_worker(wid, present=False, timeout_s=10)
    assert gone_after < 2.0, f"deregistered after {gone_after:.2f} s"
    assert agent.wait(10) == 0


def test_a_drain_directive_stops_new_plans_and_deregisters_once_idle(
    real: RealFleet, extra_agent: tuple[str, AgentProcess]
) -> None:
    wid, agent = extra_agent
    engine = real.engines["prefill"]
    threads = _flood(engine.url, 2, max_tokens=600)  # busy well past the drain mark
    t0 = time.monotonic()
    while gauge(engine.metrics(), "vllm:num_requests_running") < 1:
        assert time.monotonic() - t0 < 30, "the engine never ran the requests"
        time.sleep(0.05)
    real.registry.SendDirective(
        r.SendDirectiveRequest(
            worker_id=wid,
            directive=c.Directive(kind=c.DIRECTIVE_KIND_DRAIN, reason="test", issuer="test"),
        ),
        timeout=5,
    )
    # draining at the registry while the engine still runs its requests
    t0 = time.monotonic()
    while True:
        got = real.worker(wid)
        assert got is not None, "deregistered before the engine was idle"
        if got.worker.status.health == c.HEALTH_STATE_DRAINING:
            break
        assert time.monotonic() - t0 < 5, "never marked draining"
        time.sleep(0.05)
    assert gauge(engine.metrics(), "vllm:num_requests_running") >= 1
    for t in threads:
        t.join(timeout=120)
    real.wait_worker(wid, present=False, timeout_s=10)
    assert agent.wait(10) == 0
