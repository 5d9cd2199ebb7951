"""Killing the registry's process: the restart policy brings it back, state from Redis."""

from __future__ import annotations

import os
import signal

from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from tests.compose.stack import (
    Stack,
    deregister,
    heartbeat,
    pool_members,
    register_workers,
    wait_serving,
    wait_until,
)


def test_killed_registry_is_restarted_and_workers_reappear(
    stack: Stack, registry_stub: r_grpc.RegistryServiceStub, pool_id: str
) -> None:
    creds = register_workers(registry_stub, pool_id, 4)
    before = stack.state("registry")
    assert before.running and before.pid > 0
    try:
        # SIGKILL from outside, as a crash or the OOM killer would: not `stop`, which
        # tells the engine the stop was wanted and so suspends the restart policy.
        os.kill(before.pid, signal.SIGKILL)
        back_s = wait_until(
            "registry container restarted by its restart policy",
            lambda: (s := stack.state("registry")).running and s.started_at != before.started_at,
            timeout_s=45,
            every_s=0.5,
        )
        after = stack.state("registry")
        assert after.id == before.id, "compose replaced the container instead of restarting it"
        assert after.pid != before.pid
        serving_s = wait_serving(stack.addr("registry"), timeout_s=60)
        print(f"restarted after {back_s:.1f} s, SERVING {serving_s:.1f} s later")
        # Nothing was re-registered: what the new process lists came from Redis.
        assert pool_members(registry_stub, pool_id) == set(creds)
        for wid, credential in creds.items():
            worker = registry_stub.GetWorker(r.GetWorkerRequest(worker_id=wid), timeout=3).worker
            assert worker.capability.pool_id == pool_id
            heartbeat(registry_stub, wid, credential)
    finally:
        deregister(registry_stub, creds)
