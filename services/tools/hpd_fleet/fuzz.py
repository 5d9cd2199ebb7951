"""`hpd fuzz`: mutation fuzzing of every RPC of a running control plane.

For each RPC of the registry, scheduler and KV broker a *valid* request is built from
live state (a registered prefill and decode worker with their credentials, a planned
request, an open KV session), then one to three of its fields, at any depth, are given a
hostile value: zero, negative, huge, NaN, infinity, subnormal, empty, 10,000 characters,
control characters, unknown enum numbers, cleared sub-messages, hundreds of repeated
entries. Every answer must be a deliberate status: INTERNAL and UNKNOWN are failures, and
so is a call that misses its 5 s deadline twice in a row (once is reported as slow, not
failed: a shared machine stalls now and then) or a health check that stops answering
between calls (checked every 50). The seed workers are registered again every
100 calls, so later mutations still reach the code behind the identity checks.

    hpd fuzz --calls-per-method 300          # against `hpd up` on the default ports
    hpd fuzz --seed 7 --method Schedule      # one RPC, reproducibly

Exit status 0 when nothing failed, 1 otherwise (the failures are printed, each with the
RPC and the mutation that caused it, so it can be replayed with the same seed).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import kvbroker_pb2 as kb
from hetero_pd.v1 import kvbroker_pb2_grpc as kb_grpc
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common.channels import CallIdentity, sync_channel

FAILING_NAMES = {"INTERNAL", "UNKNOWN"}

_F = FieldDescriptor
_INTS = {_F.TYPE_INT32, _F.TYPE_SINT32, _F.TYPE_SFIXED32, _F.TYPE_INT64, _F.TYPE_SINT64,
         _F.TYPE_SFIXED64}  # fmt: skip
_UINTS = {_F.TYPE_UINT32, _F.TYPE_FIXED32, _F.TYPE_UINT64, _F.TYPE_FIXED64}
_FLOATS = {_F.TYPE_FLOAT, _F.TYPE_DOUBLE}
_BITS = {
    _F.TYPE_INT32: 32, _F.TYPE_SINT32: 32, _F.TYPE_SFIXED32: 32, _F.TYPE_UINT32: 32,
    _F.TYPE_FIXED32: 32, _F.TYPE_INT64: 64, _F.TYPE_SINT64: 64, _F.TYPE_SFIXED64: 64,
    _F.TYPE_UINT64: 64, _F.TYPE_FIXED64: 64,
}  # fmt: skip
_STRINGS = [
    "", " ", "x" * 10_000, "a\x00b", "line\nbreak", "\x1b[31m", "../../etc/passwd", "ünï©ødé",
    "🙂" * 64, "*", "%s%s%n", "-1", "NaN", "a" * 129, "hpd:worker:x", "' OR 1=1 --",
]  # fmt: skip


def _hostile(fd: Any, rng: random.Random) -> Any:
    """A hostile value for one scalar field of its type."""
    if fd.type in _FLOATS:
        return rng.choice([0.0, -1.0, 1e-308, 5e-324, 1e308, -1e308, math.inf, -math.inf,
                           math.nan, 1e30, 0.5])  # fmt: skip
    if fd.type in _INTS:
        bits = _BITS[fd.type]
        return rng.choice([0, -1, 1, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1, 10**6])
    if fd.type in _UINTS:
        bits = _BITS[fd.type]
        return rng.choice([0, 1, 2**bits - 1, 2 ** (bits - 1), 10**9 % 2**bits])
    if fd.type == _F.TYPE_BOOL:
        return rng.random() < 0.5
    if fd.type == _F.TYPE_STRING:
        return rng.choice(_STRINGS)
    if fd.type == _F.TYPE_BYTES:
        return rng.choice([b"", b"\x00" * 64, os.urandom(32), b"\xff" * 4096])
    if fd.type == _F.TYPE_ENUM:
        known = [v.number for v in fd.enum_type.values]
        return rng.choice([*known, 0, 999, -5, 2**31 - 1])
    raise TypeError(fd.type)


def _paths(msg: Message, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, Message, Any]]:
    """Every (path, containing message, field descriptor) reachable from ``msg``."""
    fields: list[Any] = list(msg.DESCRIPTOR.fields)
    for fd in fields:
        path = f"{prefix}{fd.name}"
        yield path, msg, fd
        if fd.type == _F.TYPE_MESSAGE and depth < 4 and not fd.message_type.GetOptions().map_entry:
            if _is_repeated(fd):
                for i, sub in enumerate(getattr(msg, fd.name)):
                    yield from _paths(sub, f"{path}[{i}].", depth + 1)
            elif msg.HasField(fd.name):
                yield from _paths(getattr(msg, fd.name), f"{path}.", depth + 1)


def _is_repeated(fd: Any) -> bool:
    flag = getattr(fd, "is_repeated", None)  # newer protobuf; `label` is deprecated there
    if flag is not None:
        return bool(flag() if callable(flag) else flag)
    return bool(fd.label == _F.LABEL_REPEATED)


def mutate(msg: Message, rng: random.Random) -> list[str]:
    """Give one to three fields of ``msg`` (in place) hostile values; what was done."""
    done: list[str] = []
    for _ in range(rng.randint(1, 3)):
        paths = list(_paths(msg))
        if not paths:
            break
        path, owner, fd = rng.choice(paths)
        target = getattr(owner, fd.name)
        try:
            if fd.type == _F.TYPE_MESSAGE:
                if fd.message_type.GetOptions().map_entry:
                    for i in range(rng.choice([1, 100, 300])):
                        key_fd = fd.message_type.fields_by_name["key"]
                        val_fd = fd.message_type.fields_by_name["value"]
                        if val_fd.type == _F.TYPE_MESSAGE:
                            break
                        key = _hostile(key_fd, rng)
                        target[f"{key}{i}" if isinstance(key, str) else key] = _hostile(val_fd, rng)
                    done.append(f"{path}: map entries")
                elif _is_repeated(fd):
                    if rng.random() < 0.5:
                        del target[:]
                        done.append(f"{path}: emptied")
                    else:
                        for _ in range(rng.choice([65, 300])):
                            target.add()
                        done.append(f"{path}: many empty entries")
                else:
                    owner.ClearField(fd.name)
                    done.append(f"{path}: cleared")
            elif _is_repeated(fd):
                n = rng.choice([0, 1, 65, 300])
                del target[:]
                target.extend(_hostile(fd, rng) for _ in range(n))
                done.append(f"{path}: {n} hostile entries")
            else:
                value = _hostile(fd, rng)
                setattr(owner, fd.name, value)
                shown = repr(value) if not isinstance(value, str) else repr(value[:24])
                done.append(f"{path}={shown}")
        except (ValueError, TypeError) as exc:  # the protobuf runtime refused the value
            done.append(f"{path}: not settable ({type(exc).__name__})")
    return done


@dataclass
class Target:
    registry: str
    scheduler: str
    kvbroker: str
    scheduler_token: str = ""


@dataclass
class Seeds:
    """Live state the valid requests are built from."""

    prefill: str = ""
    decode: str = ""
    credentials: dict[str, str] = field(default_factory=dict)
    request_id: str = ""
    session_id: str = ""


@dataclass
class Failure:
    method: str
    code: str
    detail: str
    mutations: list[str]
    request: bytes = b""  # the serialized request, to replay it


@dataclass
class Result:
    calls: dict[str, int] = field(default_factory=dict)
    codes: dict[str, dict[str, int]] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    # calls that missed their deadline once and answered when sent again (reported)
    slow: list[Failure] = field(default_factory=list)


MODEL = "fuzz-model"


def _capability(worker_id: str, stage: Any) -> c.WorkerCapability:
    kv = c.KvFormat(
        dtype=c.KV_DTYPE_BF16, layout=c.KV_LAYOUT_PAGED_NHD, block_size_tokens=16, num_layers=32,
        num_kv_heads=8, head_dim=128, tp_size=1, attention_backend="flash_attn",
        model_revision="rev-fuzz",
    )  # fmt: skip
    return c.WorkerCapability(
        worker_id=worker_id, pool_id=f"fuzz-{worker_id}", endpoint=f"{worker_id}.fuzz:8000",
        stages=[stage], model_id=MODEL, model_revision="rev-fuzz", engine="vllm",
        engine_version="0.0.0", gpu_type="H100-SXM", gpu_count=1, tp_size=1, pp_size=1,
        kv_memory_total_bytes=40 * 2**30, max_batch_size=256, kv_format=kv,
        network=c.NetworkLocation(zone="fz", rack="r", host=worker_id, nic_gbps=200),
    )  # fmt: skip


def _load() -> c.LoadReport:
    return c.LoadReport(
        gpu_util=0.3, memory_util=0.3, kv_blocks_free=900, kv_blocks_total=1000, queue_depth=1,
        queue_max=64, batch_size=2, itl_p50_ms=20, itl_p99_ms=30,
    )  # fmt: skip


class Fuzzer:
    def __init__(self, target: Target, rng: random.Random, run_id: str) -> None:
        self.t = target
        self.rng = rng
        self.run_id = run_id
        # as HPD_TOKEN's caller over HPD_CA_FILE's TLS, when set (a plane with auth on:
        # an operator's token reaches every RPC's servicer)
        ident = CallIdentity.from_env()
        self.channels = [
            sync_channel(a, ident) for a in (target.registry, target.scheduler, target.kvbroker)
        ]
        self.reg = r_grpc.RegistryServiceStub(self.channels[0])
        self.sched = s_grpc.SchedulerServiceStub(self.channels[1])
        self.broker = kb_grpc.KvBrokerServiceStub(self.channels[2])
        self.seeds = Seeds()
        self.n = 0

    def close(self) -> None:
        for ch in self.channels:
            ch.close()

    # -- live state -------------------------------------------------------------------------

    def refresh_seeds(self) -> None:
        """(Re-)register the seed workers, plan a request and open a session on it."""
        sd = self.seeds
        sd.prefill, sd.decode = f"{self.run_id}-p", f"{self.run_id}-d"
        for wid, stage in ((sd.prefill, c.STAGE_PREFILL), (sd.decode, c.STAGE_DECODE)):
            with contextlib.suppress(grpc.RpcError):
                self.reg.DeregisterWorker(
                    r.DeregisterWorkerRequest(
                        worker_id=wid, credential=sd.credentials.get(wid, "")
                    ),
                    timeout=5,
                )
            resp = self.reg.RegisterWorker(
                r.RegisterWorkerRequest(capability=_capability(wid, stage), lease_ttl_ms=60_000),
                timeout=5,
            )
            sd.credentials[wid] = resp.credential
            self.reg.Heartbeat(
                r.HeartbeatRequest(worker_id=wid, credential=resp.credential, load=_load()),
                timeout=5,
            )
        self.n += 1
        sd.request_id = f"{self.run_id}-seed-{self.n}"
        time.sleep(0.1)  # the scheduler's view follows the registry
        with contextlib.suppress(grpc.RpcError):
            self.sched.Schedule(self._schedule_request(sd.request_id), timeout=5)
        try:
            sess = self.broker.OpenSession(self._open_request(), timeout=5)
            sd.session_id = sess.session.session_id
        except grpc.RpcError:
            sd.session_id = sd.session_id or "no-session"

    def _schedule_request(self, rid: str) -> s.ScheduleRequest:
        return s.ScheduleRequest(
            request_id=rid, model_id=MODEL, prompt_tokens=1000, expected_output_tokens=100,
            tier="standard", prefix_hints=[self.seeds.prefill],
        )  # fmt: skip

    def _caller(self) -> kb.SessionCaller:
        return kb.SessionCaller(scheduler_token=self.t.scheduler_token)

    def _open_request(self) -> kb.OpenSessionRequest:
        sd = self.seeds
        self.n += 1
        return kb.OpenSessionRequest(
            request_id=f"{self.run_id}-open-{self.n}", source_worker_id=sd.prefill,
            destination_worker_id=sd.decode, expected_bytes=1 << 20, deadline_ms=30_000,
            caller=self._caller(),
        )  # fmt: skip

    # -- the methods and their valid requests -----------------------------------------------

    # size: one entry per RPC of every service, a table read as one list
    def methods(self) -> dict[str, tuple[Callable[[], Message], Callable[[Message], Any]]]:
        sd = self.seeds

        def worker_cred(wid: str) -> tuple[str, str]:
            return wid, sd.credentials.get(wid, "")

        def fresh_id(kind: str) -> str:
            self.n += 1
            return f"{self.run_id}-{kind}-{self.n}"

        def unary(stub_call: Callable[..., Any]) -> Callable[[Message], Any]:
            return lambda req: stub_call(req, timeout=5)

        def first_of_stream(stub_call: Callable[..., Any]) -> Callable[[Message], Any]:
            def call(req: Message) -> Any:
                stream = stub_call(req, timeout=2)
                try:
                    return next(iter(stream), None)
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        return None  # a quiet stream is not a fault
                    raise
                finally:
                    stream.cancel()

            return call

        def heartbeat_stream(req: Message) -> Any:
            stream = self.reg.StreamHeartbeats(iter([req]), timeout=2)
            try:
                return next(iter(stream), None)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return None
                raise
            finally:
                stream.cancel()

        def schedule_stream(req: Message) -> Any:
            stream = self.sched.ScheduleStream(iter([req]), timeout=5)
            try:
                return next(iter(stream), None)
            finally:
                stream.cancel()

        p, d = sd.prefill, sd.decode
        return {
            "RegisterWorker": (
                lambda: r.RegisterWorkerRequest(
                    capability=_capability(fresh_id("w"), c.STAGE_DECODE), lease_ttl_ms=5_000
                ),
                unary(self.reg.RegisterWorker),
            ),
            "Heartbeat": (
                lambda: r.HeartbeatRequest(worker_id=p, credential=worker_cred(p)[1], load=_load()),
                unary(self.reg.Heartbeat),
            ),
            "StreamHeartbeats": (
                lambda: r.StreamHeartbeatsRequest(
                    worker_id=d, credential=worker_cred(d)[1], load=_load()
                ),
                heartbeat_stream,
            ),
            "DeregisterWorker": (
                lambda: r.DeregisterWorkerRequest(worker_id=fresh_id("gone"), credential="x"),
                unary(self.reg.DeregisterWorker),
            ),
            "DrainWorker": (
                lambda: r.DrainWorkerRequest(worker_id=fresh_id("nobody"), reason="fuzz"),
                unary(self.reg.DrainWorker),
            ),
            "CordonWorker": (
                lambda: r.CordonWorkerRequest(worker_id=fresh_id("nobody"), reason="fuzz"),
                unary(self.reg.CordonWorker),
            ),
            "UncordonWorker": (
                lambda: r.UncordonWorkerRequest(worker_id=p),
                unary(self.reg.UncordonWorker),
            ),
            "GetWorker": (lambda: r.GetWorkerRequest(worker_id=p), unary(self.reg.GetWorker)),
            "ListWorkers": (
                lambda: r.ListWorkersRequest(model_id=MODEL, page_size=10),
                unary(self.reg.ListWorkers),
            ),
            "ListPools": (lambda: r.ListPoolsRequest(model_id=MODEL), unary(self.reg.ListPools)),
            "WatchWorkers": (
                lambda: r.WatchWorkersRequest(model_id=MODEL),
                first_of_stream(self.reg.WatchWorkers),
            ),
            "ReportKvEvents": (
                lambda: r.ReportKvEventsRequest(
                    worker_id=p,
                    credential=worker_cred(p)[1],
                    block_tokens=128,
                    events=[
                        r.KvCacheEvent(stored=r.KvBlocks(block_hashes=[1, 2, 3])),
                        r.KvCacheEvent(removed=r.KvBlocks(block_hashes=[3])),
                    ],
                ),
                unary(self.reg.ReportKvEvents),
            ),
            "SendDirective": (
                lambda: r.SendDirectiveRequest(
                    worker_id=p,
                    directive=c.Directive(
                        kind=c.DIRECTIVE_KIND_SET_MAX_BATCH_SIZE,
                        max_batch_size=64,
                        reason="fuzz",
                        issuer="fuzz",
                    ),
                ),
                unary(self.reg.SendDirective),
            ),
            "Schedule": (
                lambda: self._schedule_request(fresh_id("req")),
                unary(self.sched.Schedule),
            ),
            "ScheduleStream": (
                lambda: self._schedule_request(fresh_id("req")),
                schedule_stream,
            ),
            "ReportOutcome": (
                lambda: s.ReportOutcomeRequest(
                    request_id=sd.request_id,
                    success=True,
                    ttft_ms=100,
                    tpot_ms=20,
                    output_tokens=10,
                ),
                unary(self.sched.ReportOutcome),
            ),
            "GetRouteRecord": (
                lambda: s.GetRouteRecordRequest(request_id=sd.request_id),
                unary(self.sched.GetRouteRecord),
            ),
            "ListRouteRecords": (
                lambda: s.ListRouteRecordsRequest(page_size=5),
                unary(self.sched.ListRouteRecords),
            ),
            "GetPolicy": (lambda: s.GetPolicyRequest(), unary(self.sched.GetPolicy)),
            "ReloadPolicy": (
                lambda: s.ReloadPolicyRequest(builtin_profile="default", dry_run=True),
                unary(self.sched.ReloadPolicy),
            ),
            "GetRecommendations": (
                lambda: s.GetRecommendationsRequest(),
                unary(self.sched.GetRecommendations),
            ),
            "Negotiate": (
                lambda: kb.NegotiateRequest(
                    source_worker_id=p, destination_worker_id=d, kv_bytes=1 << 20
                ),
                unary(self.broker.Negotiate),
            ),
            "GetCompatibilityMatrix": (
                lambda: kb.GetCompatibilityMatrixRequest(model_id=MODEL),
                unary(self.broker.GetCompatibilityMatrix),
            ),
            "OpenSession": (self._open_request, unary(self.broker.OpenSession)),
            "ReportProgress": (
                lambda: kb.ReportProgressRequest(
                    session_id=sd.session_id,
                    caller=self._caller(),
                    bytes_done=1024,
                    state=kb.SESSION_STATE_TRANSFERRING,
                ),
                unary(self.broker.ReportProgress),
            ),
            "CompleteSession": (
                lambda: kb.CompleteSessionRequest(session_id=sd.session_id, caller=self._caller()),
                unary(self.broker.CompleteSession),
            ),
            "AbortSession": (
                lambda: kb.AbortSessionRequest(
                    session_id=sd.session_id, caller=self._caller(), reason="fuzz"
                ),
                unary(self.broker.AbortSession),
            ),
            "GetSession": (
                lambda: kb.GetSessionRequest(session_id=sd.session_id),
                unary(self.broker.GetSession),
            ),
            "WatchSession": (
                lambda: kb.WatchSessionRequest(session_id=sd.session_id),
                first_of_stream(self.broker.WatchSession),
            ),
            "ListSessions": (
                lambda: kb.ListSessionsRequest(page_size=5),
                unary(self.broker.ListSessions),
            ),
        }

    # -- the run ----------------------------------------------------------------------------

    def healthy(self) -> str | None:
        """None when every service answers SERVING within 2 s, else which did not."""
        for ch, name in zip(self.channels, ("registry", "scheduler", "kvbroker"), strict=True):
            try:
                resp = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=2
                )
                if resp.status != health_pb2.HealthCheckResponse.SERVING:
                    return f"{name}: {resp.status}"
            except grpc.RpcError as exc:
                return f"{name}: {exc.code().name}"
        return None

    last_detail = ""

    def _call(self, call: Callable[[Message], Any], req: Message) -> str:
        try:
            call(req)
        except grpc.RpcError as exc:
            self.last_detail = (exc.details() or "")[:300]
            return str(exc.code().name)
        return "OK"

    def run(
        self,
        calls_per_method: int,
        only: Sequence[str] = (),
        progress: Callable[[int, int], None] | None = None,
    ) -> Result:
        self.refresh_seeds()
        table = self.methods()
        unknown = [m for m in only if m not in table]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; known: {sorted(table)}")
        names = list(only) or sorted(table)
        res = Result()
        total, done = calls_per_method * len(names), 0
        for name in names:
            build, call = table[name]
            res.calls[name] = 0
            res.codes[name] = {}
            for i in range(calls_per_method):
                if i and i % 50 == 0:
                    sick = self.healthy()
                    if sick is not None:
                        res.failures.append(Failure(name, "HEALTH", sick, []))
                        return res
                if i and i % 100 == 0:
                    self.refresh_seeds()
                    table = self.methods()
                    build, call = table[name]
                req = build()
                done_mutations = mutate(req, self.rng)
                code = self._call(call, req)
                if code == "DEADLINE_EXCEEDED":
                    # once may be the machine; the same call missing its deadline twice hangs
                    code = "SLOW" if self._call(call, req) != "DEADLINE_EXCEEDED" else code
                    if code == "SLOW":
                        res.slow.append(Failure(name, code, "", done_mutations))
                if code in FAILING_NAMES or code == "DEADLINE_EXCEEDED":
                    res.failures.append(
                        Failure(
                            name, code, self.last_detail, done_mutations, req.SerializeToString()
                        )
                    )
                res.calls[name] += 1
                res.codes[name][code] = res.codes[name].get(code, 0) + 1
                done += 1
                if progress is not None:
                    progress(done, total)
        sick = self.healthy()
        if sick is not None:
            res.failures.append(Failure("(end)", "HEALTH", sick, []))
        return res


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hpd fuzz",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--registry", default=os.environ.get("HPD_REGISTRY", "127.0.0.1:50051"))
    p.add_argument("--scheduler", default=os.environ.get("HPD_SCHEDULER", "127.0.0.1:50052"))
    p.add_argument("--kvbroker", default=os.environ.get("HPD_KVBROKER", "127.0.0.1:50053"))
    p.add_argument("--scheduler-token", default="", help="the broker's scheduler token, if set")
    p.add_argument("--calls-per-method", type=int, default=300, help="mutated calls per RPC")
    p.add_argument("--method", action="append", default=[], help="only this RPC (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="random seed (0 = from the clock)")
    args = p.parse_args(argv)
    if args.calls_per_method < 1:
        p.error("--calls-per-method must be at least 1")
    seed = args.seed or int(time.time())
    target = Target(args.registry, args.scheduler, args.kvbroker, args.scheduler_token)
    fuzzer = Fuzzer(target, random.Random(seed), f"fz{seed % 100000}")
    tty = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if tty and (done % 25 == 0 or done == total):
            print(f"\rhpd fuzz: {done}/{total} calls", end="", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    try:
        res = fuzzer.run(args.calls_per_method, args.method, progress)
    except grpc.RpcError as exc:
        print(f"\nhpd fuzz: cannot set up its seed state: {exc.code().name}: {exc.details()}",
              file=sys.stderr)  # fmt: skip
        return 2
    except ValueError as exc:
        print(f"hpd fuzz: {exc}", file=sys.stderr)
        return 2
    finally:
        fuzzer.close()
    if tty:
        print(file=sys.stderr)
    calls = sum(res.calls.values())
    print(f"hpd fuzz: seed {seed}, {calls} calls over {len(res.calls)} RPCs in "
          f"{time.monotonic() - t0:.0f} s")  # fmt: skip
    for name in sorted(res.codes):
        codes = ", ".join(f"{k} {v}" for k, v in sorted(res.codes[name].items()))
        print(f"  {name:<24} {codes}")
    for f in res.slow:
        print(f"slow once (answered when sent again): {f.method} <- {'; '.join(f.mutations)}")
    if res.failures:
        print(f"FAILED: {len(res.failures)} calls")
        for f in res.failures[:50]:
            print(f"  {f.method}: {f.code}: {f.detail} <- {'; '.join(f.mutations)}")
            if f.request:
                print(f"    request (base64 of the serialized message): "
                      f"{base64.b64encode(f.request).decode()[:2000]}")  # fmt: skip
        return 1
    print("no INTERNAL, UNKNOWN or hung call; every service answered its health check")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
