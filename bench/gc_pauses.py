"""Garbage-collection pauses of the control plane while it serves, with its start-up heap
frozen (the default, ``hpd_common.server.freeze_startup_heap``) against left as it is
(``HPD_GC_FREEZE=0``), in one run.

Each arm starts ``hpd up`` (embedded Redis, its own ports and state folder) and drives it
with ``hpd demo --attach`` (the emulated fleet and a trace replay through the real
services), then reads ``hpd_gc_pause_seconds`` from the control plane's /metrics before and
after the replay: the collections, and the time every thread of the process stood still
for them, counted over the replay only (the start-up heap's own collection is left out).
Full (generation 2) collections are the ones that walk the whole heap.

Figures: ``full_gc_ms_frozen`` / ``full_gc_ms_unfrozen`` (summed over the replay),
``full_gc_count_*``, ``full_gc_over_10ms_*``, and ``full_gc_ms_frozen_vs_unfrozen`` (lower
is better; no target of an issue, a finding measured: bench/README.md).

    python bench/gc_pauses.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from hpd_tools.embedded_redis import free_port

HPD = Path(sys.executable).with_name("hpd")
FAMILY = "hpd_gc_pause_seconds"


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(FAMILY):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def arm(freeze: bool, seconds: int, folder: Path) -> dict[str, float]:
    """One control plane under one replay; the replay's full collections."""
    ports = {k: free_port() for k in ("redis", "registry", "scheduler", "kvbroker", "metrics")}
    env = {**os.environ, "HPD_GC_FREEZE": "1" if freeze else "0"}
    log = (folder / f"up-{int(freeze)}.log").open("wb")
    up = subprocess.Popen(
        [
            str(HPD), "up", "--state-dir", str(folder / f"state-{int(freeze)}"),
            "--redis-port", str(ports["redis"]), "--registry-port", str(ports["registry"]),
            "--scheduler-port", str(ports["scheduler"]), "--kvbroker-port", str(ports["kvbroker"]),
            "--metrics-port", str(ports["metrics"]), "--log-level", "warning",
        ],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while b"Ctrl-C" not in (folder / f"up-{int(freeze)}.log").read_bytes():
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"hpd up did not start; see {log.name}")
            time.sleep(0.2)
        before = scrape(ports["metrics"])
        addrs = ",".join(f"127.0.0.1:{ports[k]}" for k in ("registry", "scheduler", "kvbroker"))
        demo = subprocess.run(
            [
                str(HPD), "demo", "--attach", addrs, "--no-live", "--duration", str(seconds),
                "--time-scale", "2", "--rate-scale", "6", "--log-level", "warning",
            ],
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        if demo.returncode != 0:
            raise RuntimeError(f"hpd demo failed: {demo.stdout[-2000:]} {demo.stderr[-2000:]}")
        after = scrape(ports["metrics"])
    finally:
        up.terminate()
        try:
            up.wait(timeout=20)
        except subprocess.TimeoutExpired:
            up.kill()
        log.close()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    count = delta(f'{FAMILY}_count{{generation="2"}}')
    under_10ms = delta(f'{FAMILY}_bucket{{generation="2",le="0.01"}}')
    done = re.findall(r"(\d+) requests: ", demo.stdout)
    return {
        "full_gc_count": count,
        "full_gc_ms": delta(f'{FAMILY}_sum{{generation="2"}}') * 1000.0,
        "full_gc_over_10ms": count - under_10ms,
        "young_gc_ms": (
            delta(f'{FAMILY}_sum{{generation="0"}}') + delta(f'{FAMILY}_sum{{generation="1"}}')
        )
        * 1000.0,
        "requests": float(done[-1]) if done else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="30 s of trace per arm (about 2 min)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    seconds = 30 if args.quick else 90
    with tempfile.TemporaryDirectory(prefix="hpd-gc-") as tmp:
        folder = Path(tmp)
        off = arm(False, seconds, folder)
        on = arm(True, seconds, folder)
    out: dict[str, object] = {"quick": args.quick, "trace_seconds": seconds}
    for name, got in (("unfrozen", off), ("frozen", on)):
        for k, v in got.items():
            out[f"{k}_{name}"] = round(v, 1)
    out["full_gc_ms_frozen_vs_unfrozen"] = (
        round(on["full_gc_ms"] / off["full_gc_ms"], 3) if off["full_gc_ms"] > 0 else None
    )
    if args.json:
        print(json.dumps(out))
        return 0
    for key, value in out.items():
        print(f"{key:<34} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
