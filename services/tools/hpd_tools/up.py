"""`hpd up`: the whole control plane in one process, for one machine.

With no --redis-url it starts an embedded Redis (a private redis-server child with
append-only persistence under --state-dir) and stops it on exit; restarting
`hpd up` with the same --state-dir finds every registration again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import secrets
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

from hpd_common import auth, tracing
from hpd_common.errors import InvalidArgument
from hpd_common.exposure import check_exposure
from hpd_common.logging import configure_logging, get_logger
from hpd_common.metrics import serve_metrics
from hpd_common.server import freeze_startup_heap
from hpd_common.settings import coerce
from hpd_tools.controlplane import ControlPlane, ControlPlaneSettings
from hpd_tools.embedded_redis import EmbeddedRedis

log = get_logger("up")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpd up",
        description="Run the hetero-pd control plane (registry, scheduler, KV broker) on this "
        "machine, in one process.",
        epilog="Then try: grpcurl -plaintext 127.0.0.1:50051 list",
    )
    p.add_argument(
        "--config",
        default="",
        help="YAML file of these settings (keys: the flags' names with _); flags win over "
        "HPD_<FLAG> environment variables, which win over the file",
    )
    p.add_argument("--redis-url", default="", help="use this Redis instead of an embedded one")
    p.add_argument("--state-dir", default=".hpd", help="embedded Redis data (AOF) directory")
    p.add_argument("--redis-port", type=int, default=0, help="embedded Redis port (0 = free port)")
    p.add_argument(
        "--redis-fsync",
        choices=("everysec", "always"),
        default="everysec",
        help="embedded Redis's appendfsync: everysec may lose about the last second of "
        "acknowledged writes if the host dies (not if only the process does); always loses "
        "none, at a disk flush per write",
    )
    p.add_argument(
        "--redis-min-replicas",
        type=int,
        default=0,
        help="embedded Redis's min-replicas-to-write: refuse writes while fewer replicas are "
        "connected (lag under 10 s); pair with redis_url ?wait_replicas=N on the services",
    )
    p.add_argument(
        "--redis-maxmemory",
        default="1gb",
        help="embedded Redis's maxmemory (policy noeviction); new plans and KV sessions are "
        "refused at 90%% of it, before Redis refuses writes (README: sizing)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the services listen on; anything but loopback needs --auth and --tls "
        "(or --insecure)",
    )
    p.add_argument("--registry-port", type=int, default=50051)
    p.add_argument("--scheduler-port", type=int, default=50052)
    p.add_argument("--kvbroker-port", type=int, default=50053)
    p.add_argument(
        "--scheduler-processes",
        type=int,
        default=1,
        help="scheduler processes on the scheduler port, one per core (SO_REUSEPORT; each its "
        "own fleet view, sharing Redis like replicas); process i's metrics on "
        "--metrics-port + i. Clients spread over them by connection: open several",
    )
    p.add_argument("--metrics-port", type=int, default=9451, help="Prometheus port (0 = off)")
    p.add_argument("--lease-ttl-ms", type=int, default=10_000, help="default worker lease")
    _security_flags(p)
    p.add_argument("--log-level", default="info")
    p.add_argument("--json-logs", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument(
        "--tracing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="OpenTelemetry traces of the services' RPCs, exported over OTLP as the standard "
        "OTEL_* variables say (docs/tracing.md)",
    )
    return p


def _security_flags(p: argparse.ArgumentParser) -> None:
    """Who may call the services, over what, and the way to insist on neither."""
    p.add_argument(
        "--auth",
        action="store_true",
        help="check every caller's bearer token (roles worker, gateway, scheduler, operator): "
        "a tokens file with one fresh token per role is made in --state-dir on first use "
        "(mode 0600) and kept; callers send `authorization: Bearer <token>` (hpd CLI and "
        "agents: HPD_TOKEN)",
    )
    p.add_argument(
        "--auth-tokens-file",
        default="",
        help="check callers against this tokens file instead (implies --auth; it must hold a "
        "plain `token` of role scheduler, which the scheduler and broker present)",
    )
    p.add_argument(
        "--open-reads",
        action="store_true",
        help="with auth, let read-only RPCs through without a token (default: reads need any "
        "known token or certificate: worker endpoints and route records are not for strangers)",
    )
    p.add_argument(
        "--closed-reads", action="store_true", help="the default now; kept for older scripts"
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="run every service on mutual TLS with a throwaway CA made in --state-dir/tls "
        "(reused while valid); clients trust tls/ca.pem and present tls/client.pem + "
        "tls/client.key (hpd CLI and agents: HPD_CA_FILE, HPD_CERT_FILE, HPD_KEY_FILE); "
        "with --auth, tls/role-<role>.pem + .key identify a caller as that role without "
        "a token",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="listen beyond loopback without auth and TLS anyway (never in production: "
        "anyone who reaches the ports may register workers and receive prompts)",
    )


PASSWORD_FILE = "password"


def redis_password(state: Path) -> str:
    """The embedded Redis's password: made once (random, mode 0600, in a 0700 directory) and
    kept, so a local user without it can neither read nor rewrite credentials and plans."""
    state.mkdir(parents=True, exist_ok=True)
    state.chmod(0o700)
    path = state / PASSWORD_FILE
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def embedded_redis_url(state_dir: Path, port: int) -> str:
    """The URL of the Redis ``hpd up --state-dir STATE_DIR --redis-port PORT`` embeds, for a
    process that shares it (``hpd gateway --redis-url``, planning in its own process): its
    password is read from the state folder, where ``hpd up`` made it (or makes it now)."""
    password = quote(redis_password(Path(state_dir).resolve() / "redis"), safe="")
    return f"redis://:{password}@127.0.0.1:{port}/0"


def _auth(args: argparse.Namespace) -> tuple[str, str]:
    """(tokens file, the scheduler-role token the services present), or ('', '') for off."""
    if args.auth_tokens_file:
        path = Path(args.auth_tokens_file)
    elif args.auth:
        path = Path(args.state_dir).resolve() / "tokens.yaml"
        if not path.exists():
            from hpd_tools.tlsgen import role_cert_names

            # the role certificates `--tls` makes (tls/role-<role>.pem) identify callers too
            auth.write_tokens_file(path, cert_names=role_cert_names())
            print(f"hpd: wrote a token per role to {path} (keep it secret)", flush=True)
    else:
        return "", ""
    auth.TokenBook.load(path)  # a bad file is refused here, naming the entry
    token = auth.read_tokens_file(path).get(auth.Role.SCHEDULER, "")
    if not token:
        raise SystemExit(
            f"hpd up: {path} has no plain `token` of role scheduler for the services to present"
        )
    return str(path), token


async def _tls(args: argparse.Namespace) -> dict[str, str]:
    """With ``--tls``: a throwaway CA and certificates in the state folder, as the control
    plane's TLS settings; else none."""
    if not args.tls:
        return {}
    from hpd_tools.tlsgen import ensure_pki

    pki = await asyncio.to_thread(ensure_pki, Path(args.state_dir) / "tls", [args.host])
    return {
        "tls_ca_file": str(pki.ca),
        "tls_server_cert_file": str(pki.server_cert),
        "tls_server_key_file": str(pki.server_key),
        "tls_client_cert_file": str(pki.client_cert),
        "tls_client_key_file": str(pki.client_key),
    }


def _announce(
    args: argparse.Namespace,
    cp: ControlPlane,
    tls: Mapping[str, str],
    tokens_file: str,
    redis_url: str,
) -> None:
    """What an operator needs once the control plane serves: addresses, TLS and auth."""
    for name, target in (
        ("registry", cp.registry_target),
        ("scheduler", cp.scheduler_target),
        ("kvbroker", cp.kvbroker_target),
    ):
        print(f"hpd: {name} listening on {target}", flush=True)
    if args.scheduler_processes > 1:
        print(
            f"hpd: scheduler: {args.scheduler_processes} processes share its port (metrics "
            f"of process i on --metrics-port + i)",
            flush=True,
        )
    if tls:
        print(
            f"hpd: mutual TLS on; clients: HPD_CA_FILE={tls['tls_ca_file']} "
            f"HPD_CERT_FILE={tls['tls_client_cert_file']} "
            f"HPD_KEY_FILE={tls['tls_client_key_file']}",
            flush=True,
        )
    if tokens_file:
        reads = "are open (--open-reads)" if args.open_reads else "need a token"
        print(f"hpd: auth on (tokens: {tokens_file}); reads {reads}", flush=True)
    shown = re.sub(r"//([^@/]*):[^@/]*@", r"//\1:***@", redis_url)  # never print a password
    print(f"hpd: state store {shown}; Ctrl-C to stop", flush=True)


async def _serve(args: argparse.Namespace, redis_url: str) -> None:
    from hpd_kvbroker.settings import KvBrokerSettings
    from hpd_registry.settings import RegistrySettings
    from hpd_scheduler.settings import SchedulerSettings

    reg, kvb, sch = RegistrySettings(), KvBrokerSettings(), SchedulerSettings()
    tokens_file, service_token = _auth(args)
    tls = await _tls(args)
    cp = ControlPlane(
        ControlPlaneSettings(  # the services' own defaults: this is the long-lived setup
            redis_url=redis_url,
            host=args.host,
            registry_port=args.registry_port,
            scheduler_port=args.scheduler_port,
            kvbroker_port=args.kvbroker_port,
            key_prefix=reg.key_prefix,
            lease_ttl_ms=args.lease_ttl_ms,
            sweep_interval_ms=reg.sweep_interval_ms,
            bookmark_interval_ms=reg.bookmark_interval_ms,
            staleness_bound_ms=sch.staleness_bound_ms,
            session_lease_ttl_ms=kvb.lease_ttl_ms,
            session_deadline_ms=kvb.default_deadline_ms,
            profile=sch.profile,
            directive_interval_ms=sch.directive_interval_ms,
            informer_max_backoff_ms=sch.informer_max_backoff_ms,
            scheduler_id=sch.scheduler_id,
            scheduler_processes=args.scheduler_processes,
            metrics_port=args.metrics_port,
            log_level=args.log_level,
            auth_tokens_file=tokens_file,
            auth_open_reads=args.open_reads,
            service_token=service_token,
            insecure=args.insecure,
            tracing=tracing.enabled(),
            **tls,  # type: ignore[arg-type]
        )
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await cp.start()
        _announce(args, cp, tls, tokens_file, redis_url)
        log.info("startup_heap_frozen", objects=freeze_startup_heap())
        await stop.wait()
        log.info("shutdown_requested")
    finally:
        await cp.stop(grace_s=None)


def parse(argv: Sequence[str] | None, env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Flags over ``HPD_<FLAG>`` environment variables over a ``--config`` YAML file (keys
    are the flags' names with ``_``) over the defaults, as every service reads its settings."""
    env = os.environ if env is None else env
    p = parser()
    first, _ = p.parse_known_args(argv)
    values: dict[str, Any] = {}
    config = first.config or env.get("HPD_CONFIG", "")
    if config:
        try:
            doc = yaml.safe_load(Path(config).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise InvalidArgument("config", f"cannot read {config}: {exc}") from exc
        if not isinstance(doc, dict):
            raise InvalidArgument("config", f"{config} must hold a mapping of settings")
        values.update({str(k).replace("-", "_"): v for k, v in doc.items()})
    for action in p._actions:
        name = "HPD_" + action.dest.upper()
        if action.dest not in ("help", "config") and env.get(name, ""):
            values[action.dest] = env[name]
    known = {a.dest: a for a in p._actions}
    defaults: dict[str, Any] = {}
    for key, raw in values.items():
        found = known.get(key)
        if found is None or key in ("help", "config"):
            raise InvalidArgument(f"config.{key}", f"unknown setting; known: {sorted(known)}")
        defaults[key] = _typed(key, found, raw)
    p.set_defaults(**defaults)
    return p.parse_args(argv)


def _typed(key: str, action: argparse.Action, raw: Any) -> Any:
    flag = action.nargs == 0  # --auth, --tls, --open-reads: booleans
    kind: Any = bool if flag else (action.type if callable(action.type) else str)
    return coerce(key, kind, raw)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    configure_logging(args.log_level, args.json_logs)
    try:
        check_exposure(
            args.host,
            auth=bool(args.auth or args.auth_tokens_file),
            tls=bool(args.tls),
            insecure=bool(args.insecure),
            what="hpd up",
        )
    except InvalidArgument as exc:
        print(f"hpd up: {exc}", file=sys.stderr)
        return 2
    serve_metrics(args.metrics_port, args.host)
    tracing.configure(bool(args.tracing), "hpd-up")
    try:
        return _run(args)
    finally:
        tracing.shutdown()


def _run(args: argparse.Namespace) -> int:
    if args.redis_url:
        asyncio.run(_serve(args, args.redis_url))
        return 0
    state = Path(args.state_dir).resolve() / "redis"
    limits = ["--maxmemory", str(args.redis_maxmemory), "--maxmemory-policy", "noeviction"]
    limits += ["--appendfsync", args.redis_fsync]
    if args.redis_min_replicas:
        limits += ["--min-replicas-to-write", str(args.redis_min_replicas)]
        limits += ["--min-replicas-max-lag", "10"]
    password = redis_password(state)
    with EmbeddedRedis(
        state, port=args.redis_port, persist=True, extra_args=limits, password=password
    ) as redis:
        print(
            f"hpd: embedded Redis on 127.0.0.1:{redis.port} (AOF in {state}, fsync "
            f"{args.redis_fsync}; password in {state / PASSWORD_FILE})",
            flush=True,
        )
        asyncio.run(_serve(args, redis.url))
    return 0
