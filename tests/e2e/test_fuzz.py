"""The fuzz stage: `hpd fuzz` against `hpd up` started as a process, with auth (as its
operator, so every call passes the token check and reaches the servicer, and the check
itself is fuzzed along) and without (the development setup, where identities come only
from the messages). Every RPC gets ``HPD_FUZZ_CALLS`` mutated calls (300 unless set);
no INTERNAL, no UNKNOWN, no hung call, and every service keeps answering its health
check."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpd_tools.embedded_redis import free_port
from tests.support.processes import stop, wait_serving

HPD = Path(sys.executable).parent / "hpd"


@pytest.fixture(scope="module", params=["auth", "auth-off"])
def control_plane(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[str]]:
    auth = request.param == "auth"
    ports = [free_port(), free_port(), free_port()]
    log = (tmp_path_factory.mktemp("fuzz-logs") / "up.log").open("wb")
    state = tmp_path_factory.mktemp("fuzz-up")
    proc = subprocess.Popen(
        [
            str(HPD), "up", *(["--auth"] if auth else []), "--metrics-port", "0",
            "--state-dir", str(state),
            "--registry-port", str(ports[0]), "--scheduler-port", str(ports[1]),
            "--kvbroker-port", str(ports[2]),
        ],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    addrs = [f"127.0.0.1:{p}" for p in ports]
    try:
        wait_serving(addrs, proc, 60)
        if auth:
            token = subprocess.run(
                [str(HPD), "token", "operator", "--state-dir", str(state)],
                capture_output=True, text=True, check=True,
            ).stdout.strip()  # fmt: skip
            os.environ["HPD_TOKEN"] = token  # the fuzz runs below inherit it
        yield addrs
    finally:
        os.environ.pop("HPD_TOKEN", None)
        stop(proc)
        log.close()


def test_no_mutated_call_gets_internal_unknown_or_hangs(control_plane: list[str]) -> None:
    calls = os.environ.get("HPD_FUZZ_CALLS", "300")
    registry, scheduler, broker = control_plane
    done = subprocess.run(
        [
            str(HPD), "fuzz", "--registry", registry, "--scheduler", scheduler,
            "--kvbroker", broker, "--calls-per-method", calls,
        ],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no INTERNAL, UNKNOWN or hung call" in done.stdout
    # every RPC of the three services was fuzzed, each the number of times asked
    rows = [ln.split() for ln in done.stdout.splitlines() if ln.startswith("  ")]
    assert len(rows) >= 29, done.stdout
    for row in rows:
        assert sum(int(n.rstrip(",")) for n in row[2::2]) == int(calls), row


def test_a_bad_method_name_is_refused_with_the_known_ones(control_plane: list[str]) -> None:
    registry, scheduler, broker = control_plane
    done = subprocess.run(
        [
            str(HPD), "fuzz", "--registry", registry, "--scheduler", scheduler,
            "--kvbroker", broker, "--method", "NoSuchRpc", "--calls-per-method", "1",
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "known:" in done.stderr and "Schedule" in done.stderr
