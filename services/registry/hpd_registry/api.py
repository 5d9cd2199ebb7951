"""RegistryService servicer: validate, convert, call the use case, convert back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hpd_common import auth, rpc
from hpd_common.errors import InvalidArgument, PermissionDenied
from hpd_common.server import ServiceComponent
from hpd_common.worker_model import Health, LoadReport, Stage
from hpd_registry import convert as cv
from hpd_registry.domain import WorkerFilter
from hpd_registry.feed import WatchEvent
from hpd_registry.heartbeats import HeartbeatInput, LeaseInfo
from hpd_registry.service import RegistryService

SERVICE_NAME = r.DESCRIPTOR.services_by_name["RegistryService"].full_name


MAX_ACKS = 256  # directive ids one heartbeat acks (a worker has at most as many queued)


def _hb_input(m: r.HeartbeatRequest | r.StreamHeartbeatsRequest) -> HeartbeatInput:
    load: LoadReport | None = cv.load_from_pb(m.load) if m.HasField("load") else None
    return HeartbeatInput(
        worker_id=m.worker_id,
        credential=m.credential,
        load=load,
        health=cv.reported_health(m.reported_health, "reported_health"),
        reason=m.health_reason,
        acked=tuple(m.acked_directive_ids[:MAX_ACKS]),
    )


# sent whatever the watcher's event_types filter says: without them its view drifts
ALWAYS_SENT = frozenset({r.WATCH_EVENT_TYPE_SNAPSHOT_END, r.WATCH_EVENT_TYPE_RESYNC})


class RegistryApi(r_grpc.RegistryServiceServicer):
    def __init__(self, service: RegistryService) -> None:
        self.svc = service

    def _worker(self, rec: Any) -> c.Worker:
        return cv.worker_to_pb(rec, self.svc.health(rec))

    @rpc.unary
    async def RegisterWorker(
        self, request: r.RegisterWorkerRequest, context: Any
    ) -> r.RegisterWorkerResponse:
        if not request.HasField("capability"):
            raise InvalidArgument("capability", "is required")
        spec = cv.spec_from_pb(request.capability)
        who = auth.current()
        if who is not None and who.role is auth.Role.WORKER:
            refusal = who.may_register(spec.worker_id, spec.pool_id)
            if refusal:
                raise PermissionDenied(refusal)
        reg = await self.svc.register(spec, request.credential, request.lease_ttl_ms)
        return r.RegisterWorkerResponse(
            worker_id=reg.worker_id,
            lease_ttl_ms=reg.lease_ttl_ms,
            heartbeat_interval_ms=reg.heartbeat_interval_ms,
            credential=reg.credential,
            revision=reg.revision,
            changed=reg.changed,
        )

    @rpc.unary
    async def Heartbeat(self, request: r.HeartbeatRequest, context: Any) -> r.HeartbeatResponse:
        out = await self.svc.heartbeat(_hb_input(request))
        return r.HeartbeatResponse(
            lease_ttl_ms=out.lease.lease_ttl_ms,
            lease_expires_at_unix_ms=out.lease.lease_expires_at_ms,
            directives=[cv.directive_to_pb(d) for d in out.directives],
            health=cv.HEALTH_TO_PB[out.health],
        )

    @rpc.stream_stream
    async def StreamHeartbeats(
        self, requests: AsyncIterator[r.StreamHeartbeatsRequest], context: Any
    ) -> AsyncIterator[r.StreamHeartbeatsResponse]:
        it = requests.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            return
        if not first.worker_id:
            raise InvalidArgument("worker_id", "the first message must name the worker")

        async def rest() -> AsyncIterator[HeartbeatInput]:
            async for m in it:
                yield _hb_input(m)

        async for item in self.svc.heartbeat_stream(_hb_input(first), rest()):
            if isinstance(item, LeaseInfo):
                yield r.StreamHeartbeatsResponse(
                    ack=r.LeaseAck(
                        lease_ttl_ms=item.lease_ttl_ms,
                        heartbeat_interval_ms=item.heartbeat_interval_ms,
                        lease_expires_at_unix_ms=item.lease_expires_at_ms,
                    )
                )
            else:
                yield r.StreamHeartbeatsResponse(directive=cv.directive_to_pb(item))

    @rpc.unary
    async def DeregisterWorker(
        self, request: r.DeregisterWorkerRequest, context: Any
    ) -> r.DeregisterWorkerResponse:
        forced = not request.credential and auth.may_act_for_others()
        if not request.credential and not forced:
            if auth.current() is not None:  # auth on: a worker, not an operator
                raise PermissionDenied(
                    "only an operator may deregister a worker without its credential"
                )
            raise InvalidArgument("credential", "is required")
        rev = await self.svc.deregister(request.worker_id, request.credential, forced)
        return r.DeregisterWorkerResponse(revision=rev)

    @rpc.unary
    async def DrainWorker(
        self, request: r.DrainWorkerRequest, context: Any
    ) -> r.DrainWorkerResponse:
        who = auth.current()
        if request.credential or (who is not None and not who.operator):
            # a worker drains only itself (its agent, on a drain directive)
            await self.svc.check_own(request.worker_id, request.credential)
        rec = await self.svc.admin(request.worker_id, "drain", request.reason)
        return r.DrainWorkerResponse(worker=self._worker(rec))

    @rpc.unary
    async def CordonWorker(
        self, request: r.CordonWorkerRequest, context: Any
    ) -> r.CordonWorkerResponse:
        rec = await self.svc.admin(request.worker_id, "cordon", request.reason)
        return r.CordonWorkerResponse(worker=self._worker(rec))

    @rpc.unary
    async def UncordonWorker(
        self, request: r.UncordonWorkerRequest, context: Any
    ) -> r.UncordonWorkerResponse:
        rec = await self.svc.admin(request.worker_id, "uncordon", "")
        return r.UncordonWorkerResponse(worker=self._worker(rec))

    @rpc.unary
    async def GetWorker(self, request: r.GetWorkerRequest, context: Any) -> r.GetWorkerResponse:
        return r.GetWorkerResponse(worker=self._worker(await self.svc.get(request.worker_id)))

    @rpc.unary
    async def ListWorkers(
        self, request: r.ListWorkersRequest, context: Any
    ) -> r.ListWorkersResponse:
        stage: Stage | None = None
        if request.stage:
            stage = cv.enum_value("stage", cv.STAGE_FROM_PB, request.stage)
        health: Health | None = None
        if request.health:
            health = cv.enum_value("health", cv.HEALTH_FROM_PB, request.health)
        flt = WorkerFilter(
            pool_id=request.pool_id,
            model_id=request.model_id,
            stage=stage,
            health=health,
            labels=tuple(sorted(request.labels.items())),
        )
        records, token, rev = await self.svc.list_workers(
            flt, request.page_size, request.page_token
        )
        return r.ListWorkersResponse(
            workers=[self._worker(x) for x in records], next_page_token=token, revision=rev
        )

    @rpc.unary
    async def ListPools(self, request: r.ListPoolsRequest, context: Any) -> r.ListPoolsResponse:
        pools, rev = await self.svc.pools(request.model_id)
        return r.ListPoolsResponse(pools=[cv.pool_to_pb(p) for p in pools], revision=rev)

    @rpc.server_stream
    async def WatchWorkers(
        self, request: r.WatchWorkersRequest, context: Any
    ) -> AsyncIterator[r.WatchWorkersResponse]:
        wanted = set(request.event_types)
        if wanted:
            known = set(cv.WATCH_TYPES.values())
            bad = sorted(t for t in wanted if t not in known)
            if bad:
                raise InvalidArgument("event_types", f"unknown event type(s) {bad}")
            wanted |= ALWAYS_SENT
        async for batch in self.svc.watch(request.from_revision, request.model_id):
            events = [
                self._event(ev) for ev in batch if not wanted or cv.WATCH_TYPES[ev.type] in wanted
            ]
            if events:
                yield r.WatchWorkersResponse(events=events, sent_at_unix_ms=self.svc.clock.now_ms())

    def _event(self, ev: WatchEvent) -> r.WorkerEvent:
        out = r.WorkerEvent(
            type=cv.WATCH_TYPES[ev.type],
            revision=ev.revision,
            worker_id=ev.worker_id,
            reason=ev.reason,
        )
        if ev.record is not None:
            out.worker.CopyFrom(self._worker(ev.record))
        elif ev.load is not None:
            out.worker.load.CopyFrom(cv.load_to_pb(ev.load))
            out.worker.status.last_heartbeat_unix_ms = ev.last_heartbeat_ms
            out.worker.capability.worker_id = ev.worker_id
        return out

    @rpc.unary
    async def ReportKvEvents(
        self, request: r.ReportKvEventsRequest, context: Any
    ) -> r.ReportKvEventsResponse:
        events = kv_events_from_pb(request)
        n = await self.svc.report_kv_events(
            request.worker_id, request.credential, int(request.block_tokens), events
        )
        return r.ReportKvEventsResponse(accepted=n)

    @rpc.unary
    async def SendDirective(
        self, request: r.SendDirectiveRequest, context: Any
    ) -> r.SendDirectiveResponse:
        if not request.HasField("directive"):
            raise InvalidArgument("directive", "is required")
        directive = cv.directive_from_pb(request.directive)
        who = auth.current()
        if who is not None:  # the issuer is who called, not what the caller wrote
            directive = replace(directive, issuer=f"{who.role.value}:{who.name}")
        directive_id, now = await self.svc.send_directive(request.worker_id, directive)
        return r.SendDirectiveResponse(directive_id=directive_id, delivered_now=now)


MAX_KV_EVENTS = 1024
MAX_KV_KEYS = 4096


def kv_events_from_pb(request: r.ReportKvEventsRequest) -> list[list[Any]]:
    """The batch as the feed stores it: ``[kind, keys]`` per event (``keys.py``)."""
    if not 1 <= request.block_tokens <= 4096:
        raise InvalidArgument("block_tokens", "must be in [1, 4096]")
    if not request.events:
        raise InvalidArgument("events", "at least one event")
    if len(request.events) > MAX_KV_EVENTS:
        raise InvalidArgument("events", f"at most {MAX_KV_EVENTS} per call")
    out: list[list[Any]] = []
    for i, ev in enumerate(request.events):
        kind = ev.WhichOneof("change")
        if kind is None:
            raise InvalidArgument(f"events[{i}]", "names no change")
        if kind == "all_cleared":
            if not ev.all_cleared:
                raise InvalidArgument(f"events[{i}].all_cleared", "must be true when set")
            out.append(["c", []])
            continue
        blocks = ev.stored if kind == "stored" else ev.removed
        if len(blocks.block_hashes) > MAX_KV_KEYS:
            raise InvalidArgument(f"events[{i}].{kind}", f"at most {MAX_KV_KEYS} blocks")
        if kind == "stored":
            out.append(["h" if blocks.from_prompt_start else "s", list(blocks.block_hashes)])
        else:
            out.append(["r", list(blocks.block_hashes)])
    return out


class RegistryComponent(ServiceComponent):
    """The registry as the server bootstrap sees it."""

    service_names = (SERVICE_NAME,)
    service: RegistryService

    def add_to_server(self, server: grpc.aio.Server) -> None:
        r_grpc.add_RegistryServiceServicer_to_server(RegistryApi(self.service), server)

    def drain(self) -> None:
        self.service.drain()
