"""compose.yaml and the image, checked without running anything.

Compose files are easy to get subtly wrong in ways no local test notices (a port bound
to every interface, a Redis without persistence, a service without a health check), so
the shipped file is read here with the same variable interpolation compose applies,
using only the defaults written in the file. The gRPC health probe the image runs is
checked against the real grpc.health.v1 messages and a real server.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from collections.abc import Iterator, Mapping
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[3]
HPD_SERVICES = {"registry": 50051, "scheduler": 50052, "kvbroker": 50053}
DEFAULT_SERVICES = {"redis", "certs", "gateway", *HPD_SERVICES}
FLEET_PROFILE = {"replay", "engines"}

_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\})")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}` (unset or empty), `${VAR-default}` (unset), `$$`."""

    def one(m: re.Match[str]) -> str:
        if m.group(1):
            return "$"
        name, op, default = m.group(2), m.group(3), m.group(4) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return _VAR.sub(one, text)


def load_compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    text = interpolate((ROOT / "compose.yaml").read_text(), env or {})
    data = yaml.safe_load(text)
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


def published(service: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(host_ip, host_port, container_port) of each published port, short or long syntax."""
    for port in service.get("ports", []):
        if isinstance(port, dict):
            yield (
                str(port.get("host_ip", "")),
                str(port.get("published", "")),
                str(port["target"]),
            )
            continue
        parts = str(port).split("/")[0].split(":")
        if len(parts) == 3:
            yield parts[0], parts[1], parts[2]
        elif len(parts) == 2:
            yield "", parts[0], parts[1]
        else:
            yield "", "", parts[0]


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        pytest.param("${A:-x}", {}, "x", id="unset-takes-default"),
        pytest.param("${A:-x}", {"A": ""}, "x", id="colon-empty-takes-default"),
        pytest.param("${A-x}", {"A": ""}, "", id="dash-empty-stays-empty"),
        pytest.param("${A:-x}:${B}", {"A": "0.0.0.0", "B": "7"}, "0.0.0.0:7", id="set-wins"),
        pytest.param("$${A}", {"A": "y"}, "${A}", id="dollar-escape"),
    ],
)
def test_interpolation_follows_compose(text: str, env: dict[str, str], expected: str) -> None:
    assert interpolate(text, env) == expected


def test_default_services_and_fleet_profile(compose: dict[str, Any]) -> None:
    default = {name for name, svc in services(compose).items() if not svc.get("profiles")}
    assert default == DEFAULT_SERVICES
    profiled = {
        name: svc["profiles"] for name, svc in services(compose).items() if name not in default
    }
    assert profiled == {name: ["fleet"] for name in FLEET_PROFILE}


@pytest.mark.parametrize("name", sorted(DEFAULT_SERVICES | FLEET_PROFILE))
def test_every_service_has_a_health_check(compose: dict[str, Any], name: str) -> None:
    check = services(compose)[name].get("healthcheck")
    assert check, f"{name} has no healthcheck"
    assert not check.get("disable", False)
    test = check["test"]
    assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1


@pytest.mark.parametrize("name", sorted(HPD_SERVICES))
def test_service_health_check_asks_grpc_health_on_its_own_port(
    compose: dict[str, Any], name: str
) -> None:
    svc = services(compose)[name]
    port = HPD_SERVICES[name]
    assert svc["command"] == ["hpd", name]
    assert svc["environment"]["HPD_PORT"] == str(port)
    assert svc["environment"]["HPD_HOST"] == "0.0.0.0"
    test = svc["healthcheck"]["test"]
    assert "/usr/local/lib/hpd/grpc_health_probe.py" in test
    assert test[test.index("--addr") + 1] == f"127.0.0.1:{port}"
    assert svc["restart"] in ("always", "unless-stopped", "on-failure")


@pytest.mark.parametrize(
    "env",
    [
        pytest.param({}, id="defaults"),
        pytest.param({"HPD_REGISTRY_PORT": "6000", "HPD_KVBROKER_PORT": "6001"}, id="moved-ports"),
    ],
)
def test_every_published_port_binds_loopback_by_default(env: dict[str, str]) -> None:
    compose = load_compose(env)
    seen = 0
    for name, svc in services(compose).items():
        for host_ip, host_port, _ in published(svc):
            seen += 1
            assert host_ip == "127.0.0.1", f"{name} publishes on {host_ip or 'every interface'}"
            assert host_port, f"{name} publishes on a random port"
    assert seen >= len(HPD_SERVICES)


def test_bind_address_is_configurable() -> None:
    compose = load_compose({"HPD_BIND": "0.0.0.0"})
    ips = {ip for svc in services(compose).values() for ip, _, _ in published(svc)}
    assert ips == {"0.0.0.0"}


def test_each_grpc_port_is_published(compose: dict[str, Any]) -> None:
    for name, port in HPD_SERVICES.items():
        targets = {target for _, _, target in published(services(compose)[name])}
        assert str(port) in targets, f"{name} does not publish {port}"


def test_redis_is_not_published_and_never_on_6379(compose: dict[str, Any]) -> None:
    assert not services(compose)["redis"].get("ports"), "Redis must stay inside the network"
    for name, svc in services(compose).items():
        for _, host_port, _ in published(svc):
            assert host_port != "6379", f"{name} takes the host's Redis port"


def test_redis_appends_to_a_named_volume(compose: dict[str, Any]) -> None:
    redis = services(compose)["redis"]
    command = [str(part) for part in redis["command"]]
    assert command[0] == "redis-server"
    options = dict(zip(command[1::2], command[2::2], strict=True))
    assert options["--appendonly"] == "yes"
    assert options["--appendfsync"] in ("always", "everysec")
    data_dir = options["--dir"]
    mounts = [str(v).split(":") for v in redis["volumes"]]
    assert [m for m in mounts if m[1] == data_dir] == [["redis-data", data_dir]]
    assert "redis-data" in compose["volumes"], "the volume must be a named (top-level) one"
    assert redis["restart"] in ("always", "unless-stopped")


def test_redis_memory_is_bounded_and_never_evicts(compose: dict[str, Any]) -> None:
    """Eviction would drop leases, reservations or sessions; the services refuse new work
    before the bound instead (redis_memory_limit_ratio)."""
    command = [str(part) for part in services(compose)["redis"]["command"]]
    options = dict(zip(command[1::2], command[2::2], strict=True))
    assert options["--maxmemory"] not in ("", "0")
    assert options["--maxmemory-policy"] == "noeviction"


def test_services_reach_redis_by_its_service_name(compose: dict[str, Any]) -> None:
    for name in HPD_SERVICES:
        svc = services(compose)[name]
        assert svc["environment"]["HPD_REDIS_URL"] == "redis://redis:6379/0"
        assert "redis" in svc["depends_on"]


# ---- the image -------------------------------------------------------------------------


def test_dockerfile_base_user_and_health_check() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in ("root", "0"), users
    assert re.search(r"^HEALTHCHECK .*\n?.*grpc_health_probe\.py", text, re.M)
    assert "--no-index --find-links" in text, "a wheelhouse must install offline"


def test_dockerignore_keeps_the_context_small() -> None:
    text = (ROOT / ".dockerignore").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "the context is an allow-list"
    assert "!services/" in lines and "!scripts/grpc_health_probe.py" in lines
    assert "!.venv" not in lines and "!.git" not in lines


# ---- the health probe ------------------------------------------------------------------


@pytest.fixture(scope="module")
def probe() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "grpc_health_probe", ROOT / "scripts" / "grpc_health_probe.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "service",
    [
        pytest.param("", id="whole-server"),
        pytest.param("hetero_pd.v1.RegistryService", id="named"),
        pytest.param("x" * 300, id="two-byte-length"),
    ],
)
def test_probe_request_matches_protobuf(probe: ModuleType, service: str) -> None:
    expected = health_pb2.HealthCheckRequest(service=service).SerializeToString()
    assert probe.encode_request(service) == expected


@pytest.mark.parametrize(
    "status", [0, 1, 2, 3], ids=["unknown", "serving", "not-serving", "unknown-svc"]
)
def test_probe_decodes_protobuf_status(probe: ModuleType, status: int) -> None:
    raw = health_pb2.HealthCheckResponse(status=status).SerializeToString()
    assert probe.decode_status(raw) == status
    # An unknown length-delimited field before the status is skipped.
    assert probe.decode_status(b"\x12\x03abc" + raw) == status


@pytest.fixture(scope="module")
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


@pytest.mark.parametrize(
    ("status", "service", "code"),
    [
        pytest.param(health_pb2.HealthCheckResponse.SERVING, "", 0, id="serving"),
        pytest.param(health_pb2.HealthCheckResponse.NOT_SERVING, "", 1, id="not-serving"),
        pytest.param(health_pb2.HealthCheckResponse.SERVING, "no.such.Service", 2, id="unknown"),
    ],
)
def test_probe_exit_code_against_a_real_server(
    probe: ModuleType,
    health_server: tuple[str, health.HealthServicer],
    status: int,
    service: str,
    code: int,
) -> None:
    addr, servicer = health_server
    servicer.set("", status)
    args = ["-q", "--addr", addr, "--timeout", "2"] + (["--service", service] if service else [])
    assert probe.main(args) == code


def test_probe_gives_up_on_a_closed_port(probe: ModuleType) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    assert probe.main(["-q", "--addr", addr, "--timeout", "1"]) == 2


@pytest.mark.parametrize("name", sorted(HPD_SERVICES))
def test_the_shipped_stack_runs_mutual_tls_with_certificate_identities(
    compose: dict[str, Any], name: str
) -> None:
    """compose.yaml as shipped: each service serves TLS, asks for client certificates,
    takes roles from the tokens file of `hpd certs`, presents the scheduler certificate to
    the others, reads the folder read-only, waits for the certificates, and is not told to
    listen in plaintext."""
    svc = services(compose)[name]
    env = svc["environment"]
    assert str(env.get("HPD_INSECURE", "false")).lower() in ("false", "0", "no")
    assert env["HPD_TLS_CERT_FILE"] == "/tls/server.pem" and env["HPD_TLS_KEY_FILE"]
    assert env["HPD_TLS_CLIENT_CA_FILE"] == "/tls/ca.pem"
    assert env["HPD_AUTH_TOKENS_FILE"] == "/tls/tokens.yaml"
    assert env["HPD_CALL_CERT_FILE"] == "/tls/role-scheduler.pem"
    assert env["HPD_CA_FILE"] and env["HPD_CERT_FILE"]  # the health check's TLS
    assert svc["volumes"] == ["./tls:/tls:ro"]
    assert svc["depends_on"]["certs"] == {"condition": "service_healthy"}


def test_the_certs_service_makes_them_once_for_every_service_name(
    compose: dict[str, Any],
) -> None:
    """`certs`: `hpd certs` into the mounted folder (writable), a server certificate naming
    every service, files given to the image's uid, healthy once they are written. A fixed
    host name, since the certificate also names the host it was made on and a new name per
    run would make a new CA under running services. It stays up (podman restarts a service
    only while the containers it depends on run)."""
    certs = services(compose)["certs"]
    script = certs["command"][-1]
    line = next(x for x in script.splitlines() if x.startswith("hpd certs"))
    args = line.split("||")[0].split()
    assert args[:3] == ["hpd", "certs", "/tls"]
    hosts = {args[i + 1] for i, arg in enumerate(args) if arg == "--host"}
    assert hosts == {*HPD_SERVICES, "gateway"}
    assert args[args.index("--owner") + 1] == "10001"
    marker = certs["healthcheck"]["test"][-1]
    assert script.index(line) < script.index(f"touch {marker}")
    assert "sleep infinity" in script and certs["restart"] == "unless-stopped"
    assert certs["hostname"] and str(certs["user"]) == "0"
    assert certs["volumes"] == ["./tls:/tls"]


def test_the_fleet_replay_presents_role_certificates(compose: dict[str, Any]) -> None:
    replay = services(compose)["replay"]
    cmd = replay["command"]
    assert cmd[cmd.index("--tls-dir") + 1] == "/tls"
    assert "./tls:/tls:ro" in replay["volumes"]


def test_the_e2e_plaintext_overlay_overrides_no_list() -> None:
    """tests/compose/compose.e2e.yaml turns TLS and auth off for the shared component tests
    by emptying the variables; a list there would be appended to, not replace, the base
    one's (podman-compose), so it has none."""
    overlay = yaml.safe_load((ROOT / "tests/compose/compose.e2e.yaml").read_text())
    base = services(load_compose())
    assert set(overlay["services"]) == set(HPD_SERVICES)
    for name, svc in overlay["services"].items():
        env = svc["environment"]
        assert env["HPD_INSECURE"] == "true"
        for key, value in base[name]["environment"].items():
            if key.startswith(("HPD_TLS_", "HPD_CALL_", "HPD_AUTH_TOKENS")):
                assert env[key] == "", f"{name}: {key} stays {value}"
        assert not any(isinstance(v, list) for v in svc.values()), name


# ---- the gateway and the emulated engines it serves --------------------------------------


def replica_config(gateway: dict[str, Any]) -> tuple[str, str]:
    """(path, text) of the `hpd scheduler` settings file the gateway's command writes for
    its embedded replica (a here-document), as the shell writes it: `$(hostname)` is the
    container's host name."""
    script = gateway["command"][-1]
    m = re.search(r"^cat >(\S+) <<EOF\n(.*?)^EOF$", script, re.M | re.S)
    assert m, f"no here-document in the gateway's command: {script!r}"
    return m.group(1), m.group(2).replace("$(hostname)", "c0ffee")


def gateway_settings(gateway: dict[str, Any], tmp_path: Path) -> Any:
    """The gateway's settings as `hpd gateway` reads them in its container (its command's
    flags, its environment), with the replica's file written where the test can read it."""
    from hpd_common.settings import load_settings
    from hpd_gateway.__main__ import GatewaySettings

    path, text = replica_config(gateway)
    argv = gateway["command"][-1].rsplit("exec ", 1)[1].split()
    assert argv[:2] == ["hpd", "gateway"] and argv[2:] == ["--scheduler-config", path], argv
    (tmp_path / "replica.yaml").write_text(text)
    args = argparse.Namespace(config=None, scheduler_config=str(tmp_path / "replica.yaml"))
    env = {k: str(v) for k, v in gateway["environment"].items()}
    return load_settings(GatewaySettings, args, env=env)


def test_the_gateway_plans_in_its_own_process_over_the_stacks_redis(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    """Embedded mode: no scheduler to plan at, the stack's Redis, registry and broker; the
    replica's settings name the scheduler certificate for its own calls (OpenSession,
    SendDirective), the stack's key prefix (moved with HPD_KEY_PREFIX) and a name of its
    own in route records."""
    from hpd_gateway.__main__ import embedded_settings

    gateway = services(compose)["gateway"]
    s = gateway_settings(gateway, tmp_path)
    assert not s.scheduler and s.redis_url == "redis://redis:6379/0"
    assert (s.registry, s.broker) == ("registry:50051", "kvbroker:50053")
    replica = embedded_settings(s)
    assert replica is not None
    assert replica.call_ca_file == "/tls/ca.pem"
    assert replica.call_cert_file == "/tls/role-scheduler.pem"
    assert replica.call_key_file == "/tls/role-scheduler.key"
    assert replica.key_prefix == services(compose)["scheduler"]["environment"]["HPD_KEY_PREFIX"]
    assert replica.scheduler_id == "gateway-c0ffee"
    moved = services(load_compose({"HPD_KEY_PREFIX": "elsewhere"}))["gateway"]
    assert 'key_prefix: "elsewhere"' in replica_config(moved)[1]


def test_the_gateway_calls_the_services_as_the_gateway_role_over_mutual_tls(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    gateway = services(compose)["gateway"]
    s = gateway_settings(gateway, tmp_path)
    assert (s.call_ca_file, s.call_cert_file, s.call_key_file) == (
        "/tls/ca.pem", "/tls/role-gateway.pem", "/tls/role-gateway.key",
    )  # fmt: skip
    assert gateway["volumes"] == ["./tls:/tls:ro"]
    for dep in ("redis", "certs", "registry", "kvbroker"):
        assert gateway["depends_on"][dep] == {"condition": "service_healthy"}, dep
    assert gateway["restart"] in ("always", "unless-stopped", "on-failure")


def test_the_gateway_listens_beyond_loopback_with_api_keys_and_tls(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    """Not told to be insecure: HTTPS with the stack's server certificate (made for the name
    `gateway`) and the API keys file the `certs` service makes, so `check_exposure` lets it
    listen on every address of its container; both ports published (on loopback, as every
    port: test_every_published_port_binds_loopback_by_default)."""
    from hpd_common.exposure import check_exposure, is_loopback

    gateway = services(compose)["gateway"]
    s = gateway_settings(gateway, tmp_path)
    assert not s.insecure and not is_loopback(s.host)
    assert s.tls_cert_file == "/tls/server.pem" and s.tls_key_file == "/tls/server.key"
    check_exposure(s.host, auth=bool(s.api_keys), tls=bool(s.tls_cert_file), insecure=False,
                   what="the stack's gateway")  # fmt: skip
    certs_script = services(compose)["certs"]["command"][-1]
    assert f"hpd gateway-key --file {s.api_keys} " in certs_script
    key_made = certs_script.index("hpd gateway-key")
    assert key_made < certs_script.index("touch /tmp/certs-ready")
    targets = {target for _, _, target in published(gateway)}
    assert {str(s.port), str(s.metrics_port)} <= targets
    assert s.metrics_host == "0.0.0.0"  # (reached through its published port only)


def test_the_gateway_health_check_asks_its_https_health(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    gateway = services(compose)["gateway"]
    s = gateway_settings(gateway, tmp_path)
    test = gateway["healthcheck"]["test"]
    assert test[0] == "CMD"
    code = test[-1]
    assert f"https://127.0.0.1:{s.port}/health" in code and "cafile='/tls/ca.pem'" in code
    compile(code, "healthcheck", "exec")


def test_the_fleet_profile_engines_are_reachable_from_the_gateway(
    compose: dict[str, Any],
) -> None:
    """`engines`: `hpd fleet` listens on every address of its container and registers under
    its service name (which the gateway's container resolves), as the worker role; its
    workers' ids and model are its own, so it never takes the replay's requests."""
    from hpd_fleet.serve import cluster_of, parser

    engines = services(compose)["engines"]
    cmd = engines["command"]
    assert cmd[:2] == ["hpd", "fleet"]
    args = parser().parse_args(cmd[2:])
    assert (args.registry, args.broker) == ("registry:50051", "kvbroker:50053")
    assert args.tls_dir == "/tls" and "./tls:/tls:ro" in engines["volumes"]
    assert args.host == "0.0.0.0" and args.advertise == "engines"
    assert args.id_prefix and args.ready_file
    replay_cluster = cluster_of(parser().parse_args(["--registry", "r:1", "--broker", "b:2"]))
    assert cluster_of(args).model.name != replay_cluster.model.name
    assert engines["healthcheck"]["test"] == ["CMD", "test", "-f", args.ready_file]
    assert engines["depends_on"]["certs"] == {"condition": "service_healthy"}
