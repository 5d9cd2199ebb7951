"""The `fleet` profile's replay, run from the host against the stack's published ports:
an emulated heterogeneous fleet registers, a trace slice goes through the stack's
scheduler and KV broker, and every request is accounted for in the route records. Run in
both phases: plaintext, and as shipped on mutual TLS (the fleet then presents the worker
certificate, the replay the gateway one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.compose.stack import HPD_SERVICES, Stack, tls_dir, wait_serving


def test_replay_through_the_stack_accounts_for_every_request(stack: Stack, tmp_path: Path) -> None:
    for service in HPD_SERVICES:
        wait_serving(stack.addr(service), timeout_s=60)
    hpd = Path(sys.executable).parent / "hpd"
    attach = ",".join(stack.addr(s) for s in ("registry", "scheduler", "kvbroker"))
    tls = ["--tls-dir", tls_dir()] if tls_dir() else []
    done = subprocess.run(
        [str(hpd), "demo", "--attach", attach, "--duration", "6", "--rate-scale", "3",
         "--no-live", "--no-serve", "--lease-ttl-ms", "10000", "--out", str(tmp_path), *tls],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "all accounted for" in done.stdout
    assert "(agree with the report)" in done.stdout
    assert (tmp_path / "report.json").exists()
