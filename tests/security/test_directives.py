"""Directives survive a lost answer and cannot flood the store: delivery is at least once
(kept until the worker acks the id), and a worker that never acks has a capped queue.

Before: a heartbeat popped its directives before its answer was sent, so an answer lost
on the way (a missed deadline, a crash, a broken stream) lost them; the queue had no cap."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hpd_common.metrics import DIRECTIVES_DROPPED
from hpd_registry.store import MAX_PENDING_DIRECTIVES
from tests.component.test_registry_api import register
from tests.support.servers import RegistryHandle, external

pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="reads this process's counters"),
]


async def _send(registry: RegistryHandle, wid: str, size: int) -> str:
    sent = await registry.stub.SendDirective(
        r.SendDirectiveRequest(
            worker_id=wid,
            directive=c.Directive(
                kind=c.DIRECTIVE_KIND_SET_MAX_BATCH_SIZE, max_batch_size=size, reason="test"
            ),
        ),
        timeout=5,
    )
    return str(sent.directive_id)


async def _stream_until_directive(
    registry: RegistryHandle, first: r.StreamHeartbeatsRequest
) -> tuple[Any, c.Directive]:
    async def requests() -> AsyncIterator[r.StreamHeartbeatsRequest]:
        yield first
        await asyncio.Event().wait()  # no more reports: the worker is about to crash

    call = registry.stub.StreamHeartbeats(requests())
    while True:
        msg = await asyncio.wait_for(call.read(), 5)
        if msg.WhichOneof("event") == "directive":
            return call, msg.directive


async def test_a_directive_whose_answer_was_lost_is_delivered_again(
    registry: RegistryHandle,
) -> None:
    wid = registry.prefix + "-lost"
    reg = await register(registry, wid)
    sent = await _send(registry, wid, 64)
    hello = r.StreamHeartbeatsRequest(worker_id=wid, credential=reg.credential)
    call, got = await _stream_until_directive(registry, hello)
    assert got.directive_id == sent
    call.cancel()  # the worker crashed before it could act on (and ack) it
    call, again = await _stream_until_directive(registry, hello)
    assert again.directive_id == sent  # it was lost before: popped when first sent
    call.cancel()
    # acked (on a unary heartbeat here): no longer delivered
    hb = await registry.stub.Heartbeat(
        r.HeartbeatRequest(worker_id=wid, credential=reg.credential, acked_directive_ids=[sent]),
        timeout=5,
    )
    assert list(hb.directives) == []


async def test_another_worker_cannot_ack_a_workers_directives(registry: RegistryHandle) -> None:
    wid, other = registry.prefix + "-victim", registry.prefix + "-other"
    reg = await register(registry, wid)
    reg_other = await register(registry, other)
    sent = await _send(registry, wid, 32)
    # acks ride on the acking worker's own heartbeat: they remove only its own directives
    await registry.stub.Heartbeat(
        r.HeartbeatRequest(
            worker_id=other, credential=reg_other.credential, acked_directive_ids=[sent]
        ),
        timeout=5,
    )
    hb = await registry.stub.Heartbeat(
        r.HeartbeatRequest(worker_id=wid, credential=reg.credential), timeout=5
    )
    assert [d.directive_id for d in hb.directives] == [sent]


async def test_a_worker_that_never_acks_has_a_capped_queue(registry: RegistryHandle) -> None:
    wid = registry.prefix + "-flood"
    reg = await register(registry, wid)
    before = DIRECTIVES_DROPPED._value.get()
    ids = [await _send(registry, wid, 1 + i % 500) for i in range(MAX_PENDING_DIRECTIVES + 5)]
    hb = await registry.stub.Heartbeat(
        r.HeartbeatRequest(worker_id=wid, credential=reg.credential), timeout=5
    )
    # the oldest five went (counted); the answer carries the oldest still queued
    assert hb.directives[0].directive_id == ids[5]
    assert DIRECTIVES_DROPPED._value.get() - before == 5
