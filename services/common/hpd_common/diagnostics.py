"""DiagnosticsService: the transport and Redis baselines benchmarks measure against."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from hetero_pd.v1 import diagnostics_pb2 as pb
from hetero_pd.v1 import diagnostics_pb2_grpc as pb_grpc
from hpd_common import rpc
from hpd_common.errors import InvalidArgument, Unavailable

MAX_PAYLOAD = 64 * 1024
_ECHO_LUA = "return ARGV[1]"


class DiagnosticsApi(pb_grpc.DiagnosticsServiceServicer):
    """Echo (E) and Echo plus one EVALSHA round trip (E+R)."""

    def __init__(self, redis: aioredis.Redis | None) -> None:
        self._redis = redis
        self._script = redis.register_script(_ECHO_LUA) if redis is not None else None

    @rpc.unary
    async def Echo(self, request: pb.EchoRequest, context: Any) -> pb.EchoResponse:
        if len(request.payload) > MAX_PAYLOAD:
            raise InvalidArgument("payload", f"at most {MAX_PAYLOAD} bytes")
        return pb.EchoResponse(payload=request.payload)

    @rpc.unary
    async def EchoRedis(self, request: pb.EchoRequest, context: Any) -> pb.EchoResponse:
        if len(request.payload) > MAX_PAYLOAD:
            raise InvalidArgument("payload", f"at most {MAX_PAYLOAD} bytes")
        if self._script is None:
            raise Unavailable("this server has no state store")
        out = await self._script(args=[request.payload])
        return pb.EchoResponse(payload=bytes(out or b""))
