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
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
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
from hpd_fleet.fuzz_mutate import mutate
from hpd_fleet.fuzz_rpcs import MODEL, RpcTable, load_report, rpc_table, worker_capability

FAILING_NAMES = {"INTERNAL", "UNKNOWN"}


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
                r.RegisterWorkerRequest(
                    capability=worker_capability(wid, stage), lease_ttl_ms=60_000
                ),
                timeout=5,
            )
            sd.credentials[wid] = resp.credential
            self.reg.Heartbeat(
                r.HeartbeatRequest(worker_id=wid, credential=resp.credential, load=load_report()),
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

    def methods(self) -> RpcTable:
        return rpc_table(self)

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
