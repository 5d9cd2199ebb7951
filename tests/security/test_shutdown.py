"""Every process stops within a bound on SIGTERM and SIGINT, whatever its clients did: here
the gateway with hundreds of half-sent bodies and idle connections open (the demo's gateway
was found not to exit after such a run)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpd_tools.embedded_redis import free_port

HPD = Path(sys.executable).parent / "hpd"
STOP_BOUND_S = 15.0  # the runner's shutdown grace (3 s) and the reports' flush (5 s), and slack


async def _hostile(port: int, n: int) -> list[asyncio.StreamWriter]:
    out = []
    for i in range(n):
        _, w = await asyncio.open_connection("127.0.0.1", port)
        if i % 2:  # half-sent bodies; the others connect and say nothing
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999\r\n\r\n{")
            await w.drain()
        out.append(w)
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_the_gateway_stops_within_a_bound_whatever_its_clients_do(
    sig: signal.Signals, tmp_path: Path
) -> None:
    port, nowhere = free_port(), free_port()
    log = (tmp_path / "gateway.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        str(HPD), "gateway", "--port", str(port), "--registry", f"127.0.0.1:{nowhere}",
        "--scheduler", f"127.0.0.1:{nowhere}", "--broker", f"127.0.0.1:{nowhere}",
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        for _ in range(200):
            if b"listening on" in (tmp_path / "gateway.log").read_bytes():
                break
            assert proc.returncode is None, (tmp_path / "gateway.log").read_text()
            await asyncio.sleep(0.1)
        writers = await _hostile(port, 300)
        t0 = time.monotonic()
        proc.send_signal(sig)
        await asyncio.wait_for(proc.wait(), STOP_BOUND_S)
        assert time.monotonic() - t0 < STOP_BOUND_S
        for w in writers:
            w.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()
