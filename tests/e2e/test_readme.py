"""The README's commands, parsed from the README itself and run as written, so it cannot rot.

Every ``sh`` block of the README is either run here, against ``hpd demo`` serving on free
ports (the CLI's address flags default to ``HPD_REGISTRY``, ``HPD_SCHEDULER`` and
``HPD_KVBROKER``, and the blocks' ``127.0.0.1:5005x`` addresses are pointed at the demo),
or named in ``ELSEWHERE`` with the test that covers it. A new block fails
:func:`test_every_block_is_run_or_covered_elsewhere` until it is placed.

Also: the README's first command (the demo) prints no warning the project could have
avoided on stderr.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpd_tools.embedded_redis import free_port
from tests.e2e.test_grpcurl import GRPCURL
from tests.support.processes import stop

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
pytestmark = [
    pytest.mark.skipif(GRPCURL is None, reason="no grpcurl binary"),
]

# first line of a block -> where it is covered instead (and why not here)
ELSEWHERE = {
    "./scripts/hpd.sh demo": "test_the_demo_prints_no_avoidable_warning runs it (shorter); "
    "the test command is what runs this file",
    "# a vLLM prefill instance with NIXL, as you already run it": "needs a vLLM engine: "
    "tests/real_engine (scripts/real-engines-e2e.sh) runs the agent against real ones",
    ".venv/bin/hpd up --auth": "runs a control plane of its own with auth on: "
    "tests/e2e/test_up_auth.py runs these commands against `hpd up --auth`",
    ".venv/bin/hpd gateway --port 8000": "needs engines that speak HTTP: "
    "tests/real_engine/test_gateway.py runs the gateway in front of real vLLM engines",
    ".venv/bin/hpd gateway-key --file keys.yaml": "makes a key, then runs a keyed gateway on "
    "a certificate: tests/security/test_front_door.py runs `hpd gateway-key` and a keyed "
    "front door; tests/real_engine/test_front_door.py a keyed gateway over real engines",
    "hpd certs ./tls --host registry --host scheduler --host kvbroker --host gateway": "needs "
    "a Kubernetes cluster: tests/unit/deploy/test_kubernetes.py renders every overlay with "
    "`kubectl kustomize` and checks it (the Secrets' files are those `hpd certs` writes)",
    ".venv/bin/python bench/goodput.py --suite": "minutes of simulation (a benchmark, not a "
    "test): tests/unit/sim/test_suite.py runs one cell of the same matrix",
}
# run here against the demo; a block may be scaled down by appending flags (argparse keeps
# the last value) or have paths moved out of the source tree
SCALED = {
    ".venv/bin/hpd sim": " --max-requests 120 --no-progress",
    ".venv/bin/hpd fuzz": " --calls-per-method 5",  # the full count runs in tests/e2e/test_fuzz.py
}


@dataclass
class Block:
    heading: str
    text: str

    @property
    def first(self) -> str:
        return self.text.strip().splitlines()[0]


def sh_blocks() -> list[Block]:
    blocks, heading = [], ""
    lines = README.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            heading = line.lstrip("#").strip()
        if line.strip() == "```sh":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            blocks.append(Block(heading, "\n".join(lines[i + 1 : j])))
            i = j
        i += 1
    return blocks


def covered_elsewhere(block: Block) -> bool:
    return any(block.first.startswith(k) for k in ELSEWHERE)


def test_every_block_is_run_or_covered_elsewhere() -> None:
    blocks = sh_blocks()
    assert len(blocks) >= 5
    for key in ELSEWHERE:
        assert any(b.first.startswith(key) for b in blocks), f"stale ELSEWHERE entry {key!r}"


@dataclass
class Demo:
    ports: dict[str, int]
    proc: subprocess.Popen[str]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["HPD_REGISTRY"] = f"127.0.0.1:{self.ports['registry']}"
        env["HPD_SCHEDULER"] = f"127.0.0.1:{self.ports['scheduler']}"
        env["HPD_KVBROKER"] = f"127.0.0.1:{self.ports['kvbroker']}"
        return env

    def script(self, block: Block, tmp: Path) -> str:
        text = block.text
        for default, name in (("50051", "registry"), ("50052", "scheduler"), ("50053", "kvbroker")):
            text = text.replace(f"127.0.0.1:{default}", f"127.0.0.1:{self.ports[name]}")
            text = text.replace(f" :{default}", f" :{self.ports[name]}")
        text = text.replace("--out out/", f"--out {tmp}/")
        out = []
        for line in text.splitlines():
            # a stream the reader stops with Ctrl-C: three seconds of it
            if line.rstrip().endswith("# Ctrl-C to stop"):
                line = f"timeout 3 {line.split('#')[0].strip()} || [ $? = 124 ]"
            for prefix, extra in SCALED.items():
                if line.startswith(prefix):
                    line = line.split("#")[0].rstrip() + extra
            out.append(line)
        return "set -euo pipefail\n" + "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    ports = {k: free_port() for k in ("registry", "scheduler", "kvbroker")}
    out = tmp_path_factory.mktemp("demo")
    hpd = Path(sys.executable).parent / "hpd"
    proc = subprocess.Popen(
        [
            str(hpd), "demo", "--duration", "4", "--time-scale", "8", "--no-live",
            "--out", str(out), "--registry-port", str(ports["registry"]),
            "--scheduler-port", str(ports["scheduler"]),
            "--kvbroker-port", str(ports["kvbroker"]),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout

    def pump() -> None:
        for x in stdout:
            lines.put(x)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + 180
    while not any(x.startswith("serving:") for x in seen):
        assert proc.poll() is None, "hpd demo exited:\n" + "".join(seen)
        assert time.monotonic() < deadline, "hpd demo never served:\n" + "".join(seen)
        with contextlib.suppress(queue.Empty):
            seen.append(lines.get(timeout=1))
    try:
        yield Demo(ports, proc)
    finally:
        stop(proc)


def run_here() -> list[pytest.ParameterSet]:
    return [
        pytest.param(b, id=re.sub(r"[^a-z0-9]+", "-", b.first.lower())[:40].strip("-"))
        for b in sh_blocks()
        if not covered_elsewhere(b)
    ]


@pytest.mark.parametrize("block", run_here())
def test_the_readme_block_runs_as_written(block: Block, demo: Demo, tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", "-c", demo.script(block, tmp_path)],
        cwd=ROOT, env=demo.env(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{block.text}\n--- stdout\n{done.stdout}\n--- {done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    if "SchedulerService/Schedule" in block.text:
        assert '"mode": "EXECUTION_MODE_' in done.stdout, done.stdout
        assert "REQUEST" in done.stdout  # the `hpd routes` table
    if "RegisterWorker" in block.text:
        assert '"credential"' in done.stdout, done.stdout


# what a first run may print on stderr that the project cannot avoid: none so far
ALLOWED_STDERR: list[str] = []


def test_the_demo_prints_no_avoidable_warning(tmp_path: Path) -> None:
    """The README's first command, shortened: no warning, no traceback on stderr."""
    done = subprocess.run(
        [
            str(ROOT / "scripts" / "hpd.sh"), "demo", "--duration", "4", "--time-scale", "8",
            "--no-serve", "--no-live", "--out", str(tmp_path),
            "--registry-port", "0", "--scheduler-port", "0", "--kvbroker-port", "0",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    noisy = [
        line
        for line in done.stderr.splitlines()
        if re.search(r"warn|traceback|error|deprecat", line, re.IGNORECASE)
        and not any(a in line for a in ALLOWED_STDERR)
    ]
    assert not noisy, "\n".join(noisy)
    assert "What just happened" in done.stdout, done.stdout
