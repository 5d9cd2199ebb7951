"""grpcurl (the real binary) against `hpd up` started as a process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpd_tools.embedded_redis import free_port
from tests.support.fleet import capability

ROOT = Path(__file__).resolve().parents[2]


def grpcurl_path() -> str | None:
    local = Path(sys.executable).parent / "grpcurl"
    if local.exists():
        return str(local)
    return shutil.which("grpcurl")


GRPCURL = grpcurl_path()
if GRPCURL is None and os.environ.get("CI"):
    raise RuntimeError("grpcurl is required in CI: scripts/bootstrap.sh installs it")
pytestmark = [pytest.mark.skipif(GRPCURL is None, reason="no grpcurl binary")]


def grpcurl(port: int, *args: str, data: object | None = None) -> subprocess.CompletedProcess[str]:
    assert GRPCURL is not None
    # -format-error prints the status as JSON; field names print as in the .proto files
    cmd = [GRPCURL, "-plaintext", "-max-time", "10", "-format-error"]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    cmd += [f"127.0.0.1:{port}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)


PORTS: dict[str, int] = {}


@pytest.fixture(scope="module")
def hpd_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    PORTS["kvbroker"] = free_port()
    PORTS["scheduler"] = free_port()
    state = tmp_path_factory.mktemp("hpd-up")
    hpd = Path(sys.executable).parent / "hpd"
    proc = subprocess.Popen(
        [
            str(hpd),
            "up",
            "--state-dir",
            str(state),
            "--registry-port",
            str(port),
            "--kvbroker-port",
            str(PORTS["kvbroker"]),
            "--scheduler-port",
            str(PORTS["scheduler"]),
            "--metrics-port",
            "0",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        outs = [grpcurl(p, "grpc.health.v1.Health/Check") for p in (port, *PORTS.values())]
        if all(o.returncode == 0 and '"SERVING"' in o.stdout for o in outs):
            break
        time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError(f"hpd up did not come up: {proc.communicate()[0]}")
    yield port
    proc.terminate()
    proc.wait(timeout=20)


def test_list_shows_registry_health_and_reflection(hpd_up: int) -> None:
    out = grpcurl(hpd_up, "list")
    assert out.returncode == 0, out.stderr
    services = set(out.stdout.split())
    assert {
        "hetero_pd.v1.RegistryService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= services


def test_describe_works(hpd_up: int) -> None:
    out = grpcurl(hpd_up, "describe", "hetero_pd.v1.RegistryService")
    assert out.returncode == 0, out.stderr
    assert "rpc RegisterWorker" in out.stdout and "rpc WatchWorkers" in out.stdout


def test_register_from_json_then_read_back(hpd_up: int) -> None:
    from google.protobuf.json_format import MessageToDict

    cap = MessageToDict(capability("grpcurl-w1"))
    out = grpcurl(
        hpd_up,
        "hetero_pd.v1.RegistryService/RegisterWorker",
        data={"capability": cap, "leaseTtlMs": 60000},
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["worker_id"] == "grpcurl-w1"
    got = grpcurl(
        hpd_up, "hetero_pd.v1.RegistryService/GetWorker", data={"worker_id": "grpcurl-w1"}
    )
    assert got.returncode == 0, got.stderr
    worker = json.loads(got.stdout)["worker"]
    assert worker["capability"]["gpu_type"] == "H100-SXM"
    assert worker["status"]["health"] == "HEALTH_STATE_HEALTHY"
    listed = grpcurl(
        hpd_up, "hetero_pd.v1.RegistryService/ListWorkers", data={"pool_id": "h100-prefill"}
    )
    assert listed.returncode == 0, listed.stderr
    assert [w["capability"]["worker_id"] for w in json.loads(listed.stdout)["workers"]] == [
        "grpcurl-w1"
    ]


def test_health_check_serving(hpd_up: int) -> None:
    for service in ("", "hetero_pd.v1.RegistryService"):
        out = grpcurl(hpd_up, "grpc.health.v1.Health/Check", data={"service": service})
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["status"] == "SERVING"


def test_kvbroker_negotiates_two_registered_workers(hpd_up: int) -> None:
    from google.protobuf.json_format import MessageToDict

    from hetero_pd.v1 import common_pb2 as c

    for cap in (
        capability("neg-p1"),
        capability(
            "neg-d1", pool_id="a100-decode", stages=(c.STAGE_DECODE,), gpu="A100-80G", block=32
        ),
    ):
        out = grpcurl(
            hpd_up,
            "hetero_pd.v1.RegistryService/RegisterWorker",
            data={"capability": MessageToDict(cap), "leaseTtlMs": 60000},
        )
        assert out.returncode == 0, out.stderr
    broker = PORTS["kvbroker"]
    listed = grpcurl(broker, "list")
    assert "hetero_pd.v1.KvBrokerService" in listed.stdout.split()
    out = grpcurl(
        broker,
        "hetero_pd.v1.KvBrokerService/Negotiate",
        data={
            "source_worker_id": "neg-p1",
            "destination_worker_id": "neg-d1",
            "kv_bytes": str(2**30),
        },
    )
    assert out.returncode == 0, out.stderr
    verdict = json.loads(out.stdout)
    assert verdict["negotiation"]["verdict"] == "COMPATIBILITY_VERDICT_CONVERTIBLE", verdict
    assert "block_size_mismatch" in json.dumps(verdict)


def test_schedule_from_json_then_its_route_record(hpd_up: int) -> None:
    from google.protobuf.json_format import MessageToDict

    from hetero_pd.v1 import common_pb2 as c

    # A model of this test's own: the earlier tests' workers (neg-d1 in the same decode pool)
    # cannot answer for it, so the first plan waits for both of these to reach the scheduler's
    # view instead of racing the feed (Schedule is idempotent per id: the first plan is kept).
    model = "llama-3-8b-grpcurl"
    for cap in (
        capability("sch-p1", model=model),
        capability(
            "sch-d1", pool_id="a100-decode", stages=(c.STAGE_DECODE,), gpu="A100-80G", model=model
        ),
    ):
        out = grpcurl(
            hpd_up,
            "hetero_pd.v1.RegistryService/RegisterWorker",
            data={"capability": MessageToDict(cap), "leaseTtlMs": 60000},
        )
        assert out.returncode == 0, out.stderr
    sched = PORTS["scheduler"]
    request = {
        "request_id": "grpcurl-req-1",
        "model_id": model,
        "prompt_tokens": 2000,
        "expected_output_tokens": 128,
        "tier": "standard",
    }
    deadline = time.monotonic() + 15
    while True:  # the scheduler's view follows the registry's feed within moments
        out = grpcurl(sched, "hetero_pd.v1.SchedulerService/Schedule", data=request)
        if out.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert out.returncode == 0, out.stdout + out.stderr
    plan = json.loads(out.stdout)["plan"]
    assert plan["prefill_worker_id"] == "sch-p1"
    assert plan["decode_worker_id"] == "sch-d1"
    assert plan["mode"] == "EXECUTION_MODE_TRANSFER"
    rec = grpcurl(
        sched, "hetero_pd.v1.SchedulerService/GetRouteRecord", data={"request_id": "grpcurl-req-1"}
    )
    assert rec.returncode == 0, rec.stderr
    record = json.loads(rec.stdout)["record"]
    assert "grpcurl-req-1" in json.dumps(record) and "sch-d1" in json.dumps(record)


def test_demo_attaches_a_fleet_and_a_replay_to_hpd_up(hpd_up: int, tmp_path: Path) -> None:
    hpd = Path(sys.executable).parent / "hpd"
    attach = f"127.0.0.1:{hpd_up},127.0.0.1:{PORTS['scheduler']},127.0.0.1:{PORTS['kvbroker']}"
    done = subprocess.run(
        [str(hpd), "demo", "--attach", attach, "--duration", "5", "--rate-scale", "3",
         "--no-live", "--no-serve", "--lease-ttl-ms", "10000", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "all accounted for" in done.stdout
    assert "(agree with the report)" in done.stdout
