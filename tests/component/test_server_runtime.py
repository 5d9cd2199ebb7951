"""The shared server runtime: TLS, mutual TLS, Prometheus metrics, request ids."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import grpc
import pytest

from hetero_pd.v1 import diagnostics_pb2 as d
from hetero_pd.v1 import diagnostics_pb2_grpc as d_grpc
from hpd_common.errors import InvalidArgument
from hpd_common.metrics import serve_metrics
from hpd_common.server import ServerSettings, server_credentials
from hpd_tools.embedded_redis import EmbeddedRedis, free_port
from tests.support.servers import external, start_registry

pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="starts its own servers"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make certs"),
]


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server cert for 127.0.0.1/localhost and a client cert, all signed by the CA."""
    d = tmp_path_factory.mktemp("pki")
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=d,
    )
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=d,
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.cnf",
            "-out",
            f"{name}.pem",
            cwd=d,
        )
    return d


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


async def echo(channel: grpc.aio.Channel) -> bytes:
    resp = await d_grpc.DiagnosticsServiceStub(channel).Echo(
        d.EchoRequest(payload=b"hi"), timeout=5
    )
    return bytes(resp.payload)


async def test_tls_server(pki: Path, redis_server: EmbeddedRedis, key_prefix: str) -> None:
    server = await start_registry(
        redis_server.url,
        key_prefix,
        tls_cert_file=str(pki / "server.pem"),
        tls_key_file=str(pki / "server.key"),
    )
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{server.port}", creds) as ch:
            assert await echo(ch) == b"hi"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await echo(ch)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def test_mutual_tls_requires_a_client_certificate(
    pki: Path, redis_server: EmbeddedRedis, key_prefix: str
) -> None:
    server = await start_registry(
        redis_server.url,
        key_prefix,
        tls_cert_file=str(pki / "server.pem"),
        tls_key_file=str(pki / "server.key"),
        tls_client_ca_file=str(pki / "ca.pem"),
    )
    target = f"127.0.0.1:{server.port}"
    ca = (pki / "ca.pem").read_bytes()
    try:
        with_cert = grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=(pki / "client.key").read_bytes(),
            certificate_chain=(pki / "client.pem").read_bytes(),
        )
        async with grpc.aio.secure_channel(target, with_cert) as ch:
            assert await echo(ch) == b"hi"
        async with grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(ca)) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await echo(ch)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        pytest.param(ServerSettings(tls_cert_file="x.pem"), "tls_cert_file", id="cert-no-key"),
        pytest.param(
            ServerSettings(tls_client_ca_file="ca.pem"), "tls_client_ca_file", id="ca-without-tls"
        ),
        pytest.param(
            ServerSettings(tls_cert_file="/nonexistent.pem", tls_key_file="/k"),
            "tls_cert_file",
            id="unreadable-cert",
        ),
    ],
)
def test_bad_tls_settings_name_the_field(settings: ServerSettings, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        server_credentials(settings)
    assert err.value.field == field


async def test_metrics_endpoint_counts_rpcs(redis_server: EmbeddedRedis, key_prefix: str) -> None:
    port = free_port()
    serve_metrics(port)
    server = await start_registry(redis_server.url, key_prefix)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            await echo(ch)
            with pytest.raises(grpc.aio.AioRpcError):
                await d_grpc.DiagnosticsServiceStub(ch).Echo(
                    d.EchoRequest(payload=b"x" * 70_000), timeout=5
                )
        text = await asyncio.to_thread(scrape, f"http://127.0.0.1:{port}/metrics")
        assert 'hpd_rpc_seconds_count{method="Echo"}' in text
        assert 'hpd_rpc_errors_total{code="INVALID_ARGUMENT",method="Echo"}' in text
        assert 'hpd_redis_up{service="registry"} 1.0' in text
    finally:
        await server.stop(0)


def test_grpc_aio_runtime_outlives_its_last_server() -> None:
    """``pin_grpc_aio_runtime``: freeing the last server must not tear gRPC's asyncio runtime
    down (that teardown can deadlock), so the one poller thread it started keeps running
    across servers started and freed on three event loops."""
    code = textwrap.dedent(
        """
        import asyncio, gc, threading
        import grpc
        from hpd_common.server import pin_grpc_aio_runtime

        async def main() -> None:
            pin_grpc_aio_runtime()
            server = grpc.aio.server()
            server.add_insecure_port("127.0.0.1:0")
            await server.start()
            await server.stop(0)
            del server
            gc.collect()

        for _ in range(3):
            asyncio.run(main())
        print(sum("_poll_wrapper" in t.name for t in threading.enumerate()))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "1"
