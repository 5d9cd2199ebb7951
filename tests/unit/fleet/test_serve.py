"""`hpd fleet` (the compose stack's `engines`): the emulated engines listen where they are
told and register under the name callers in other containers resolve; a setting that
could not work is refused before anything starts, naming it."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from hpd_common.clock import SystemClock
from hpd_fleet import serve
from hpd_fleet.engine import EmuTime
from hpd_fleet.engine_http import FleetHttp
from hpd_fleet.fleet import Fleet, advertised_host


@pytest.mark.parametrize(
    ("host", "advertise", "expected"),
    [
        pytest.param("127.0.0.1", "", "127.0.0.1", id="loopback-by-itself"),
        pytest.param("0.0.0.0", "engines", "engines", id="wildcard-with-a-name"),
        pytest.param("127.0.0.1", "engines", "engines", id="the-name-wins"),
        pytest.param("0.0.0.0", "", None, id="wildcard-alone-refused"),
        pytest.param("", "", None, id="empty-refused"),
    ],
)
def test_advertised_host(host: str, advertise: str, expected: str | None) -> None:
    if expected is None:
        with pytest.raises(ValueError, match="advertise"):
            advertised_host(host, advertise)
    else:
        assert advertised_host(host, advertise) == expected


async def test_workers_register_the_advertised_name_and_listen_on_the_bound_address() -> None:
    registry, broker = (grpc.aio.insecure_channel("127.0.0.1:1") for _ in range(2))
    cluster = serve.cluster_of(serve.parser().parse_args(["--registry", "r:1", "--broker", "b:1"]))
    emu = EmuTime(1.0, time.monotonic, asyncio.sleep, start=time.monotonic())
    fleet = Fleet(cluster, registry, broker, emu, SystemClock(), random.Random(1), id_prefix="e-")
    http = FleetHttp(fleet, "0.0.0.0", "engines")
    try:
        for w in fleet:
            endpoint = w.client.capability.endpoint
            srv = http.servers[w.worker_id]
            assert w.worker_id.startswith("e-")
            assert endpoint == http.endpoint(w.worker_id) == f"engines:{srv.port}"
            assert srv.sock.getsockname()[0] == "0.0.0.0"
    finally:
        await http.stop()
        await registry.close()
        await broker.close()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        pytest.param(["--host", "0.0.0.0"], "--advertise", id="wildcard-without-a-name"),
        pytest.param(["--model", "gpt-9"], "--model 'gpt-9'", id="unknown-model"),
        pytest.param(["--cluster", "/no/such.yaml"], "such.yaml", id="missing-cluster"),
        pytest.param(["--report-interval-s", "0"], "--report-interval-s", id="no-interval"),
        pytest.param(["--tls-dir", "/no/such/dir"], "role-worker.pem", id="no-certificates"),
    ],
)
def test_a_bad_setting_is_refused_before_anything_starts(
    extra: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve.main(["--registry", "127.0.0.1:1", "--broker", "127.0.0.1:1", *extra]) == 2
    assert named in capsys.readouterr().err


def test_another_model_replaces_the_clusters() -> None:
    args = serve.parser().parse_args(["--registry", "r:1", "--broker", "b:1", "--model",
                                      "qwen2.5-7b"])  # fmt: skip
    cluster = serve.cluster_of(args)
    assert cluster.model.name == "qwen2.5-7b"
    assert {v.model_id for v in cluster.worker_views()} == {"qwen2.5-7b"}
