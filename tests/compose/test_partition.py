"""A network partition of one service's container: fast failures, then self-healing.

The scheduler is cut off when the stack runs one; until then, the registry. While
cut off, calls through the published port fail within their deadline with UNAVAILABLE
or DEADLINE_EXCEEDED (never a hang); once the network is back, the same client channel
and the service recover with nobody restarting anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from tests.compose.stack import (
    CLIENT_OPTIONS,
    Stack,
    health_status,
    wait_serving,
    wait_until,
)

DEADLINE_S = 2.0
# A failed call may take its deadline plus scheduling noise on a busy 2-core machine.
SLACK_S = 1.5
FAST_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
SERVING = health_pb2.HealthCheckResponse.SERVING


@contextmanager
def partitioned(stack: Stack, service: str) -> Iterator[None]:
    """Disconnects the container from every network; reconnects it with its aliases."""
    container = stack.container(service)
    networks = stack.networks(service)
    assert networks, f"{service} is on no network"
    for name in networks:
        stack.cli("network", "disconnect", name, container)
    try:
        yield
    finally:
        for name, aliases in networks.items():
            alias_args = [arg for alias in aliases for arg in ("--alias", alias)]
            stack.cli("network", "connect", *alias_args, name, container)


def fails_fast(call: Callable[[], Any]) -> tuple[grpc.StatusCode, float]:
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        call()
    elapsed = time.monotonic() - start
    code = info.value.code() if isinstance(info.value, grpc.Call) else grpc.StatusCode.UNKNOWN
    assert code in FAST_FAILURES, f"{code} after {elapsed:.2f} s"
    assert elapsed <= DEADLINE_S + SLACK_S, f"{code} only after {elapsed:.2f} s"
    return code, elapsed


def test_partitioned_service_fails_fast_and_heals(stack: Stack) -> None:
    target = "scheduler" if "scheduler" in stack.services else "registry"
    others = [s for s in stack.services if s != target]
    addr = stack.addr(target)
    with grpc.insecure_channel(addr, options=CLIENT_OPTIONS) as channel:
        assert health_status(channel, timeout_s=DEADLINE_S) == SERVING
        registry = r_grpc.RegistryServiceStub(channel)
        with partitioned(stack, target):
            # An established channel and a brand-new one both fail within the deadline.
            fails_fast(lambda: health_status(channel, timeout_s=DEADLINE_S))
            with grpc.insecure_channel(addr, options=CLIENT_OPTIONS) as fresh:
                fails_fast(lambda: health_status(fresh, timeout_s=DEADLINE_S))
            if target == "registry":
                fails_fast(lambda: registry.ListWorkers(r.ListWorkersRequest(), timeout=DEADLINE_S))
            # The rest of the stack is not dragged down with it.
            for other in others:
                with grpc.insecure_channel(stack.addr(other), options=CLIENT_OPTIONS) as ch:
                    assert health_status(ch, timeout_s=DEADLINE_S) == SERVING, other
        # Healed: the old channel reconnects by itself and the service serves again.
        healed_s = wait_until(
            f"{target} SERVING after the partition",
            lambda: health_status(channel, timeout_s=DEADLINE_S) == SERVING,
            timeout_s=60,
        )
        print(f"{target}: the same channel served again {healed_s:.1f} s after reconnecting")
        if target == "registry":
            registry.ListWorkers(r.ListWorkersRequest(), timeout=DEADLINE_S)
    for service in stack.services:
        wait_serving(stack.addr(service), timeout_s=30)
