"""Restarting the Redis container loses no registration: append-only file on a volume."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2

from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from tests.compose.stack import (
    CLIENT_OPTIONS,
    Stack,
    deregister,
    health_status,
    heartbeat,
    pool_members,
    register_workers,
    wait_serving,
    wait_until,
)


def test_redis_restart_keeps_every_registration(
    stack: Stack, registry_stub: r_grpc.RegistryServiceStub, pool_id: str
) -> None:
    creds = register_workers(registry_stub, pool_id, 5)
    before = {
        wid: registry_stub.GetWorker(r.GetWorkerRequest(worker_id=wid), timeout=3).worker
        for wid in creds
    }
    redis_before = stack.state("redis")
    try:
        # Graceful restart straight after the writes: what was acknowledged must be there.
        stack.cli("restart", "-t", "10", stack.container("redis"), timeout_s=60)
        redis_after = stack.state("redis")
        assert redis_after.running
        assert redis_after.started_at != redis_before.started_at, "Redis did not restart"

        addr = stack.addr("registry")
        wait_serving(addr, timeout_s=60)
        with grpc.insecure_channel(addr, options=CLIENT_OPTIONS) as channel:
            assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        wait_until("workers listed", lambda: pool_members(registry_stub, pool_id) == set(creds), 30)
        for wid, credential in creds.items():
            after = registry_stub.GetWorker(r.GetWorkerRequest(worker_id=wid), timeout=3).worker
            assert after.capability == before[wid].capability
            assert after.revision >= before[wid].revision
            # The credential hash survived too: the worker can still prove who it is.
            heartbeat(registry_stub, wid, credential)
    finally:
        deregister(registry_stub, creds)
