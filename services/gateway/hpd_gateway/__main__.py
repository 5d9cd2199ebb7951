"""`hpd gateway`: the OpenAI-compatible front door of a hetero-pd fleet.

Point OpenAI clients at it; every request is counted, scheduled and run on the engines
with their own KV hand-off (vLLM's NIXL protocol), with the plan's fallbacks:

    hpd gateway --port 8000 --scheduler 127.0.0.1:50052 --broker 127.0.0.1:50053 \\
        --registry 127.0.0.1:50051
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 16}'

Every setting is also HPD_<NAME> and a key of the YAML file given by ``--config``. The
gateway runs on uvloop; HPD_EVENT_LOOP=asyncio runs it on the standard library's loop.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry

from hpd_common import aio
from hpd_common.channels import CallSettings
from hpd_common.errors import InvalidArgument
from hpd_common.logging import configure_logging, get_logger
from hpd_common.metrics import watch_gc
from hpd_common.server import freeze_startup_heap
from hpd_common.settings import load_settings, settings_parser, split_csv

from .api import build_app
from .control_client import ControlPlane
from .engine_client import EngineHttp
from .metrics import GatewayMetrics
from .service import Gateway, GatewayConfig
from .tokens import LocalTokenizers

log = get_logger("gateway")


@dataclass(frozen=True)
class GatewaySettings(CallSettings):
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "HTTP port of the OpenAI API"})
    scheduler: str = field(default="127.0.0.1:50052", metadata={"help": "scheduler host:port"})
    broker: str = field(default="127.0.0.1:50053", metadata={"help": "KV broker host:port"})
    registry: str = field(default="127.0.0.1:50051", metadata={"help": "registry host:port"})
    gateway_token: str = field(
        default="", metadata={"help": "the KV broker's gateway token (if it has one)"}
    )
    prefix_routing: bool = field(
        default=True,
        metadata={
            "help": "send the prompt's block chain (its token ids keyed at the engines' KV"
            " block size) with every Schedule, so prefill goes where the prefix is cached"
        },
    )
    tokenizer: str = field(
        default="",
        metadata={
            "help": "model=folder,... of tokenizer.json files: count prompt tokens here "
            "instead of asking an engine's /tokenize"
        },
    )
    default_tier: str = field(default="standard", metadata={"help": "tier without a header"})
    api_key_tiers: str = field(
        default="", metadata={"help": "tier per API key, key=tier,key=tier (Bearer keys)"}
    )
    default_output_tokens: int = field(
        default=256, metadata={"help": "expected output tokens when max_tokens is not given"}
    )
    max_body_bytes: int = field(default=4 << 20, metadata={"help": "larger bodies are 413"})
    max_concurrent: int = field(
        default=1024, metadata={"help": "requests in flight; past it 429 with Retry-After"}
    )
    schedule_stream: bool = field(
        default=True,
        metadata={
            "help": "plan every request over one ScheduleStream to the scheduler (false: a "
            "unary Schedule call per request)"
        },
    )
    scheduler_channels: int = field(
        default=1,
        metadata={
            "help": "connections to the scheduler, each with its own ScheduleStream, used in "
            "turn; set it to at least the scheduler's --processes so every process serves"
        },
    )
    rpc_timeout_ms: int = field(default=2000, metadata={"help": "deadline of control-plane RPCs"})
    connect_timeout_s: float = field(default=2.0, metadata={"help": "engine connect timeout"})
    read_timeout_s: float = field(
        default=300.0, metadata={"help": "longest silence of an engine before the step fails"}
    )
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})
    json_logs: bool | None = field(default=None, metadata={"help": "JSON logs (default: no TTY)"})


def _pairs(text: str, name: str) -> tuple[tuple[str, str], ...]:
    out = []
    for item in split_csv(text):
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise InvalidArgument(name, f"{item!r} is not key=value")
        out.append((key, value))
    return tuple(out)


def _tiers(text: str) -> tuple[tuple[str, str], ...]:
    return _pairs(text, "api_key_tiers")


class GatewayServer:
    """``hpd gateway``'s whole assembly (control-plane clients, engine pool, the use case, the
    aiohttp app) started and stopped as one; ``hpd demo`` runs this same server in front of
    its emulated engines. ``clock`` times TTFT and TPOT (seconds; the demo passes its
    emulated clock); ``metrics_registry`` is where the gateway's metrics go (the process's
    default registry for ``hpd gateway``)."""

    def __init__(
        self,
        s: GatewaySettings,
        clock: Callable[[], float] | None = None,
        metrics_registry: CollectorRegistry = REGISTRY,
    ) -> None:
        self.settings = s
        self.control = ControlPlane(
            s.scheduler,
            s.broker,
            s.registry,
            s.gateway_token,
            timeout_s=s.rpc_timeout_ms / 1000,
            identity=s.call_identity(),
            stream=s.schedule_stream,
            scheduler_channels=s.scheduler_channels,
        )
        self.engines = EngineHttp(s.connect_timeout_s, s.read_timeout_s)
        extra = {"clock": clock} if clock is not None else {}
        self.gateway = Gateway(
            self.control,
            self.engines,
            GatewayMetrics(metrics_registry),
            GatewayConfig(
                s.default_tier, s.default_output_tokens, _tiers(s.api_key_tiers), s.prefix_routing
            ),
            tokenizers=LocalTokenizers(dict(_pairs(s.tokenizer, "tokenizer"))),
            **extra,
        )
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, fleet_wait_s: float = 5.0) -> str:
        """Connect, listen, wait (at most ``fleet_wait_s``) for the first fleet view; returns
        the base URL (the port is the OS's choice when the settings say 0)."""
        s = self.settings
        await self.control.start()
        await self.engines.start()
        app = build_app(self.gateway, s.max_body_bytes, s.max_concurrent)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=3.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, s.host, s.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        await self.control.fleet.wait_synced(fleet_wait_s)
        return self.url

    async def stop(self, flush_s: float = 5.0) -> None:
        """Stop listening (requests in flight get the runner's shutdown grace), then give
        the outcome and session reports still on their way up to ``flush_s`` to land."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        await self.gateway.flush(flush_s)
        await self.engines.close()
        await self.control.close()


async def serve(s: GatewaySettings, ready: asyncio.Event | None = None) -> None:
    server = GatewayServer(s)
    url = await server.start()
    print(f"hpd: gateway listening on {url}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    watch_gc()
    freeze_startup_heap()
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    prog = "hpd gateway"
    parser = settings_parser(prog, __doc__, GatewaySettings)
    args = parser.parse_args(argv)
    try:
        settings = load_settings(GatewaySettings, args)
        configure_logging(settings.log_level, settings.json_logs)
        _tiers(settings.api_key_tiers)
        LocalTokenizers(dict(_pairs(settings.tokenizer, "tokenizer")))  # fails fast
        aio.event_loop()  # an unknown HPD_EVENT_LOOP, before anything starts
    except (InvalidArgument, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    aio.run(serve(settings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
