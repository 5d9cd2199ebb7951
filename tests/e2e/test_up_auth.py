"""`hpd up --auth` as an operator meets it: a tokens file made on first start (mode 0600,
kept across restarts), `hpd token ROLE` for the CLI's identity, the operator commands
refused without a token and for the wrong role, allowed for an operator (and audited),
and a worker registered with the worker token. Also the README's auth block (it runs
`hpd up --auth`, so it is covered here, not against the demo)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common.channels import CallIdentity, sync_channel
from hpd_tools.embedded_redis import free_port
from tests.support.fleet import capability, load
from tests.support.processes import schedule_when_ready, stop, wait_serving

HPD = Path(sys.executable).parent / "hpd"


@dataclass
class Up:
    registry: str
    state: Path
    log: Path
    proc: subprocess.Popen[bytes]

    def hpd(self, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "HPD_TOKEN"}
        env["HPD_REGISTRY"] = self.registry
        if token is not None:
            env["HPD_TOKEN"] = token
        return subprocess.run(
            [str(HPD), *args], capture_output=True, text=True, timeout=60, env=env, check=False
        )

    def token(self, role: str) -> str:
        done = self.hpd("token", role, "--state-dir", str(self.state))
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()


def _start(state: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    ports = [free_port(), free_port(), free_port()]
    proc = subprocess.Popen(
        [
            str(HPD), "up", "--auth", "--state-dir", str(state), "--metrics-port", "0",
            "--registry-port", str(ports[0]), "--scheduler-port", str(ports[1]),
            "--kvbroker-port", str(ports[2]),
        ],
        stdout=log.open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    addrs = [f"127.0.0.1:{p}" for p in ports]
    wait_serving(addrs, proc, 60)
    return proc, addrs[0]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    state = tmp_path_factory.mktemp("up-auth")
    log = state / "up.log"
    proc, registry = _start(state, log)
    handle = Up(registry, state, log, proc)
    try:
        yield handle
    finally:
        stop(handle.proc)


def test_the_tokens_file_is_private_and_names_every_role(up: Up) -> None:
    path = up.state / "tokens.yaml"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    tokens = {role: up.token(role) for role in ("operator", "gateway", "scheduler", "worker")}
    assert len(set(tokens.values())) == 4 and all(len(t) >= 32 for t in tokens.values())
    assert "auth on" in up.log.read_text()


def test_the_embedded_redis_is_bounded_and_never_evicts(up: Up) -> None:
    owner = json.loads((up.state / "redis" / "owner.json").read_text())
    password = (up.state / "redis" / "password").read_text().strip()
    assert password not in up.log.read_text()  # the URL it prints is masked
    with pytest.raises(redis.AuthenticationError):  # a local process without the password
        redis.Redis(port=int(owner["port"])).ping()
    client = redis.Redis(port=int(owner["port"]), password=password)
    try:
        assert int(client.config_get("maxmemory")["maxmemory"]) == 2**30  # --redis-maxmemory
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    finally:
        client.close()


def test_operator_commands_need_an_operator(up: Up) -> None:
    worker = up.token("worker")
    with sync_channel(up.registry, CallIdentity(token=worker)) as ch:
        r_grpc.RegistryServiceStub(ch).RegisterWorker(
            r.RegisterWorkerRequest(capability=capability("auth-e2e")), timeout=5
        )
    # no token, then a gateway's: refused, and the worker untouched
    done = up.hpd("cordon", "auth-e2e", "--reason", "bad NIC")
    assert done.returncode == 1 and "UNAUTHENTICATED" in done.stderr, done.stderr
    done = up.hpd("cordon", "auth-e2e", token=up.token("gateway"))
    assert done.returncode == 1 and "PERMISSION_DENIED" in done.stderr, done.stderr
    assert "needs role operator" in done.stderr
    # a worker token may not deregister someone else's worker without its credential
    done = up.hpd("deregister", "auth-e2e", token=worker)
    assert done.returncode == 1 and "PERMISSION_DENIED" in done.stderr, done.stderr
    with sync_channel(up.registry, CallIdentity(token=worker)) as ch:  # reads need a token
        got = r_grpc.RegistryServiceStub(ch).GetWorker(
            r.GetWorkerRequest(worker_id="auth-e2e"), timeout=5
        )
    assert not got.worker.status.cordoned
    # an operator: done, and the registry's log says who did it
    done = up.hpd("cordon", "auth-e2e", "--reason", "bad NIC", token=up.token("operator"))
    assert done.returncode == 0, done.stderr
    assert "cordoned=True" in done.stdout
    done = up.hpd("deregister", "auth-e2e", token=up.token("operator"))
    assert done.returncode == 0 and "deregistered" in done.stdout, done.stderr
    log = up.log.read_text()
    assert '"audit"' in log or "audit" in log
    audit = [ln for ln in log.splitlines() if "audit" in ln and "CordonWorker" in ln]
    assert audit and "hpd-operator" in audit[-1], audit


def test_a_restart_keeps_the_tokens(up: Up) -> None:
    before = up.token("operator")
    stop(up.proc)
    up.proc, up.registry = _start(up.state, up.log)
    assert up.token("operator") == before
    with (
        sync_channel(up.registry, CallIdentity(token=before)) as ch,
        pytest.raises(grpc.RpcError) as err,
    ):
        r_grpc.RegistryServiceStub(ch).CordonWorker(
            r.CordonWorkerRequest(worker_id="nobody"), timeout=5
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND  # past the gate: the token holds


# size: one end-to-end scenario whose steps build on each other, read in order
def test_up_tls_runs_the_whole_plane_on_mutual_tls_with_closed_reads(
    tmp_path: Path,
) -> None:
    """`hpd up --tls --auth` (reads closed by default): plaintext and certificate-less callers get
    nothing; the CLI with the CA, the client certificate and a token reads the fleet; and
    the services reach each other (the scheduler plans for workers it saw through the
    registry's closed, TLS-only watch)."""
    ports = [free_port(), free_port(), free_port()]
    log = tmp_path / "up.log"
    proc = subprocess.Popen(
        [
            str(HPD), "up", "--tls", "--auth", "--state-dir", str(tmp_path),
            "--metrics-port", "0", "--registry-port", str(ports[0]),
            "--scheduler-port", str(ports[1]), "--kvbroker-port", str(ports[2]),
        ],
        stdout=log.open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    tls = tmp_path / "tls"
    addrs = [f"127.0.0.1:{p}" for p in ports]
    try:
        bare = CallIdentity(
            ca_file=str(tls / "ca.pem"),
            cert_file=str(tls / "client.pem"),
            key_file=str(tls / "client.key"),
        )
        deadline = time.monotonic() + 60
        while not (tls / "client.key").exists():  # made before the servers start
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.1)
        wait_serving(addrs, proc, 60, identity=bare)
        assert stat.S_IMODE((tls / "client.key").stat().st_mode) == 0o600
        tokens = {
            role: subprocess.run(
                [str(HPD), "token", role, "--state-dir", str(tmp_path)],
                capture_output=True, text=True, check=True,
            ).stdout.strip()
            for role in ("worker", "gateway", "operator")
        }  # fmt: skip
        # plaintext, and TLS without a client certificate: refused at the handshake
        for ident in (CallIdentity(token=tokens["operator"]),
                      CallIdentity(ca_file=bare.ca_file, token=tokens["operator"])):  # fmt: skip
            with sync_channel(addrs[0], ident) as ch, pytest.raises(grpc.RpcError) as err:
                r_grpc.RegistryServiceStub(ch).ListWorkers(r.ListWorkersRequest(), timeout=3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        worker = CallIdentity(tokens["worker"], bare.ca_file, bare.cert_file, bare.key_file)
        with sync_channel(addrs[0], worker) as ch:
            stub = r_grpc.RegistryServiceStub(ch)
            for wid, stage in (("tls-p", c.STAGE_PREFILL), ("tls-d", c.STAGE_DECODE)):
                cred = stub.RegisterWorker(
                    r.RegisterWorkerRequest(
                        capability=capability(wid, pool_id=f"pool-{wid}", stages=(stage,))
                    ),
                    timeout=5,
                ).credential
                stub.Heartbeat(
                    r.HeartbeatRequest(worker_id=wid, credential=cred, load=load()), timeout=5
                )
        # the CLI as an operator over mTLS: the table lists both
        env = {**os.environ, "HPD_TOKEN": tokens["operator"], "HPD_CA_FILE": bare.ca_file,
               "HPD_CERT_FILE": bare.cert_file, "HPD_KEY_FILE": bare.key_file}  # fmt: skip
        done = subprocess.run(
            [str(HPD), "workers", "--registry", addrs[0]],
            capture_output=True, text=True, env=env, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0 and "tls-p" in done.stdout and "tls-d" in done.stdout, (
            done.stdout + done.stderr
        )
        # the gateway's call plans on both: the scheduler's own view came over mTLS
        gateway = CallIdentity(tokens["gateway"], bare.ca_file, bare.cert_file, bare.key_file)
        with sync_channel(addrs[1], gateway) as ch:
            sched = s_grpc.SchedulerServiceStub(ch)
            plan = schedule_when_ready(
                sched,
                s.ScheduleRequest(request_id="tls-r1", model_id="llama-3-8b",
                                  prompt_tokens=800, expected_output_tokens=40),
            ).plan  # fmt: skip
        assert plan is not None and plan.decode_worker_id == "tls-d", log.read_text()[-3000:]
        assert "informer_stream_broken" not in log.read_text()

        # a role certificate is an identity: no token, and the role is the certificate's
        def as_role(role: str) -> CallIdentity:
            return CallIdentity(
                ca_file=str(tls / "ca.pem"),
                cert_file=str(tls / f"role-{role}.pem"),
                key_file=str(tls / f"role-{role}.key"),
            )

        cordon = r.CordonWorkerRequest(worker_id="tls-d", reason="mTLS identity test")
        with sync_channel(addrs[1], as_role("gateway")) as ch:
            got = s_grpc.SchedulerServiceStub(ch).Schedule(
                s.ScheduleRequest(request_id="tls-r2", model_id="llama-3-8b",
                                  prompt_tokens=800, expected_output_tokens=40),
                timeout=5,
            )  # fmt: skip
            assert got.plan.decode_worker_id == "tls-d"
        for role, code in (
            ("gateway", grpc.StatusCode.PERMISSION_DENIED),
            ("worker", grpc.StatusCode.PERMISSION_DENIED),
        ):
            with sync_channel(addrs[0], as_role(role)) as ch, pytest.raises(grpc.RpcError) as e:
                r_grpc.RegistryServiceStub(ch).CordonWorker(cordon, timeout=5)
            assert e.value.code() == code and f"hpd-{role}-certificate" in str(e.value.details())
        with sync_channel(addrs[0], bare) as ch, pytest.raises(grpc.RpcError) as e:
            r_grpc.RegistryServiceStub(ch).CordonWorker(cordon, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED  # a certificate of no role
        with sync_channel(addrs[0], as_role("operator")) as ch:
            r_grpc.RegistryServiceStub(ch).CordonWorker(cordon, timeout=5)
        assert "hpd-operator-certificate" in log.read_text()  # audited by name

        # `hpd demo --attach --tls-dir`: the emulated fleet registers as the worker
        # certificate, the replay plans as the gateway one, over the closed reads
        demo = [str(HPD), "demo", "--attach", ",".join(addrs), "--duration", "4",
                "--no-live", "--no-serve", "--lease-ttl-ms", "10000",
                "--out", str(tmp_path / "demo")]  # fmt: skip
        lost = subprocess.run([*demo, "--tls-dir", str(tmp_path / "nowhere")],
                              capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert lost.returncode == 2 and "role-worker.pem" in lost.stderr, lost.stderr
        done = subprocess.run([*demo, "--tls-dir", str(tls)],
                              capture_output=True, text=True, timeout=180, check=False)  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "all accounted for" in done.stdout and "(agree with the report)" in done.stdout
    finally:
        stop(proc)
