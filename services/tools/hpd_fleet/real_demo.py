"""`hpd demo --real`: the control plane in front of real vLLM engines on this machine.

Installs the pinned engine stack once (into a cached virtualenv of its own; the time is
printed), writes a tiny model, starts a prefill and a decode engine with a real NIXL KV
transfer, ``hpd up``, an agent per engine and ``hpd gateway``; shows the workers as the
agents registered them and the KV compatibility matrix; sends a few OpenAI requests
through the gateway; shows where each one ran and how its KV moved; then keeps
everything up for curl and grpcurl until Ctrl-C (``--no-serve`` stops at once).
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .real import RealStack
from .real_install import cache_root, pins_key
from .real_processes import http_json

PROMPTS = [
    "Explain prefill and decode in one sentence.",
    "Why move a KV cache between two GPUs instead of recomputing it? " * 8,
    "Write a haiku about heterogeneous accelerators.",
]


def _hpd(*args: str) -> str:
    hpd = str(Path(sys.executable).with_name("hpd"))
    out = subprocess.run([hpd, *args], capture_output=True, text=True, timeout=30, check=False)
    return out.stdout + out.stderr


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="hpd demo --real",
        description=(__doc__ or "").split("\n\n")[0],
        epilog=(__doc__ or "").split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--no-serve", action="store_true", help="exit after the requests")
    ap.add_argument("--work-dir", type=Path, help="keep logs and the model here")
    args = ap.parse_args(argv)
    cached = (cache_root() / f"venv-{pins_key()}" / ".hpd-engines-ok").exists()
    if not cached:
        print("engines: first run: installing the engine stack (a few minutes, once)")
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        print(f"starting two vLLM engines (prefill, decode; NIXL), hpd up, agents, gateway; "
              f"logs in {work / 'logs'}")  # fmt: skip
        real = stack.enter_context(RealStack(work))
        print(f"up in {time.monotonic() - t0:.0f} s\n")
        reg = real.addrs["registry"]
        print(_hpd("workers", "--registry", reg))
        print(_hpd("compat", "tiny", "--kvbroker", real.addrs["kvbroker"]))
        for i, text in enumerate(PROMPTS):
            rid = f"demo-real-{i}"
            body = {"model": "tiny", "prompt": text, "max_tokens": 16, "temperature": 0}
            t = time.perf_counter()
            out = http_json(
                real.gateway_url + "/v1/completions", body, headers={"x-request-id": rid}
            )
            ms = (time.perf_counter() - t) * 1000
            print(f"{rid}: {out['usage']['prompt_tokens']} prompt tokens -> "
                  f"{out['usage']['completion_tokens']} tokens in {ms:.0f} ms")  # fmt: skip
        time.sleep(0.5)
        print()
        print(_hpd("routes", "--scheduler", real.addrs["scheduler"]))
        print(_hpd("sessions", "--kvbroker", real.addrs["kvbroker"]))
        if args.no_serve:
            return 0
        print(f"gateway: {real.gateway_url}  (try: curl {real.gateway_url}/v1/models)")
        print(f"registry {reg}, scheduler {real.addrs['scheduler']}, "
              f"broker {real.addrs['kvbroker']}; Ctrl-C to stop")  # fmt: skip
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
