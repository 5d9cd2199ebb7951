"""The discrete-event cluster simulator: a simulated clock, an event heap, no sleeping.

Every scheduling decision is made by the policy core itself (``Planner.plan`` on a
``Fleet`` built from :class:`~hpd_scheduler.policy.WorkerView` values that this module derives
from its own worker state), exactly as the scheduler service calls it; the simulator only
plays the cluster. Service times come from the shared performance model
(``hpd_common.perfmodel``), so simulator, emulated fleet and scheduler agree on GPU speed.

The model of one worker (one engine on ``tp`` GPUs) is a single serial executor running
*iterations*, as vLLM- and SGLang-style engines do:

* **prefill iteration**: the head of the worker's prefill queue, ``perfmodel.prefill_ms``
  for its prompt. A worker with prefills waiting runs them before its next decode step
  (prefill-first scheduling without chunking); on a worker that also decodes (recompute,
  colocated) the running sequences wait, which is the interference disaggregation removes.
* **decode iteration** (continuous batching): one token for every running sequence,
  ``perfmodel.decode_step_ms(batch, total context)``; sequences whose KV arrived during the
  previous iteration join at the next boundary, finished ones leave at the end of theirs.
* **prefix cache** (requests with prefix-block ids, as the Mooncake trace's ``hash_ids``):
  each worker keeps the ids of the blocks it computed or received, LRU, up to its KV memory
  in blocks of ``prefix_block_tokens`` (an engine's prefix cache is its free KV blocks, so
  this is an upper bound). A prefill computes only the tokens after the longest held prefix
  of its request's ids (``perfmodel.prefill_ms(.., cached_tokens)``, at least the last
  token); a worker that ran a prefill or received a transfer then holds all of the
  request's blocks. The policy sees every worker's cache live (``Fleet.build(prefix=..)``),
  as a scheduler following engines' KV events does, slightly idealised. A KV transfer
  moves only the blocks the decode worker's cache lacks (vLLM's decode side counts its own
  prefix hits before it pulls the rest).
* **KV memory**: a sequence reserves ``prompt + output`` tokens of KV on its decode worker at
  admission (no preemption) and frees them when it finishes; capacity is
  ``perfmodel.max_kv_tokens``. Admission is FIFO and also bounded by the worker's max batch.
  KV held on prefill workers until the transfer ends is not modelled.
* **hand-off** (pull, as DistServe and Mooncake do): after a remote prefill the request waits
  in its decode worker's admission queue; once admitted its KV
  (``prompt x bytes per token`` of the prefill worker's format) crosses the pipe between the
  two (``cluster.ClusterSpec.pipe_key``), whose bandwidth concurrent transfers share equally
  (processor sharing); link latency and any format conversion
  (``kvformat.negotiate(...).cost_ms_per_gib``) are added after the bytes. RECOMPUTE and
  SAME_POOL run the prefill on the decode worker after admission.

Latencies: TTFT = first token - arrival, where the first token is produced when the KV is on
the decode worker (transfer delivered, or local prefill done); TPOT = (finish - first token)
/ (output - 1); per-token gaps are the decode iteration ends a sequence took part in, so a
prefill iteration interleaved on its worker shows up as a long gap (Mooncake's TBT).

Load reports (what the policy sees): queue depth (admission + prefill queues), running
prefills, batch size, ITL p50/p99 of the last 32 steps, free KV, GPU utilisation (busy
fraction, exponentially weighted over ``util_tau_s``), the prefill busy share (the part of
that time spent in prefill iterations, weighted the same way) and memory utilisation.
``report_interval_s = 0`` gives every decision a fresh report of every worker (a Fleet is
built per decision: O(workers), measured cheap for tens of workers); a positive interval
publishes reports at those ticks only, builds the Fleet once per tick and counts the
decisions in between through ``apply_reservations`` (reports then lag reality by up to an
interval, which is what a scheduler fed by heartbeats sees). Requests routed to a decode
worker but not yet admitted there are shown as pending reservations either way, and those
whose prefill on another worker is not done yet as its inbound transfers
(``Fleet.build(inbound_transfers=..)``, which the service counts from its own plans).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Callable, Sequence

from hpd_common import perfmodel
from hpd_common.kvformat import GIB, negotiate
from hpd_scheduler.policy import (
    DecisionKind,
    Fleet,
    LoadReport,
    Mode,
    Planner,
    Profile,
    PromptMix,
    Request,
    StalenessPolicy,
    WorkerView,
    apply_reservations,
)
from hpd_scheduler.policy.prefix import PrefixIndex, cached_tokens
from hpd_sim.traces import TraceRequest

from .cluster import ClusterSpec, PoolSpec
from .learning import SimLearner
from .outcomes import Judge, RequestOutcome, SimConfig, SimResult, tbt_ms
from .resources import Pipe, SimWorker

__all__ = ["RequestOutcome", "SimConfig", "SimResult", "Simulator", "simulate", "tbt_ms"]

_ARRIVAL, _ITER, _PIPE, _DELIVER = 0, 1, 2, 3
_EPS_BITS = 1e-3


# size: one event loop: its handlers share the clock, the event heap and the worker table,
# and an event's path (arrival, plan, admission, transfer, first token, steps, finish) reads
# in one place; the run's values are in outcomes.py and its moving parts in resources.py
def _actual(pool: PoolSpec) -> tuple[float, float, float, float, float, int]:
    """How the pool's engines really run: (prefill x, + prefill ms, decode x, + decode ms
    per sequence, the share of the fixed prefill cost each further prompt of a batched
    prefill iteration adds, the iteration's prompt-token budget)."""
    return (
        pool.prefill_scale,
        pool.prefill_fixed_ms,
        pool.decode_scale,
        pool.decode_seq_ms,
        pool.prefill_queue_share,
        pool.prefill_batch_tokens,
    )


_AS_DECLARED = (1.0, 0.0, 1.0, 0.0, 1.0, 0)


class Simulator:
    """One run of one policy over one trace on one cluster (see the module docstring).

    ``profile``: a policy-core profile (``builtin_profile(...)`` or ``load_profile(...)``);
    a ``colocated`` pairing runs on :meth:`ClusterSpec.colocated` (every pool serves both
    stages). ``on_progress(done, total)`` is called every 1 % of completed requests.

    ``stop_below`` (with ``judge``): the run only has to say whether the share of requests
    meeting their targets reaches ``stop_below``; it stops as soon as the requests that
    certainly missed (rejected, first token too late, or finished out of target, by
    ``judge``) make that share unreachable, with ``SimResult.stopped_early`` set. A rate
    search needs no more than that at a rate the fleet cannot serve, and an overloaded run is
    the longest one: the queues it builds make every later decision see them.
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        profile: Profile,
        requests: Sequence[TraceRequest],
        config: SimConfig | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        judge: Judge | None = None,
        stop_below: float = 0.0,
    ) -> None:
        self.config = config or SimConfig()
        if profile.pairing == "colocated":
            cluster = cluster.colocated()
        self.cluster = cluster
        self.profile = profile
        self.planner = Planner(profile)
        self.requests = list(requests)
        self.on_progress = on_progress
        self._judge = judge if stop_below > 0 else None
        self._stop_below = stop_below
        self._misses = 0
        self._stop = False
        self.rng = random.Random(self.config.seed)
        self.tier_rng = random.Random(self.config.seed + 1)
        views = cluster.worker_views()
        pool_of = {p.pool_id: p for p in cluster.pools}
        self.workers = [
            SimWorker(i, v, pool_of[v.pool_id].gpu, _actual(pool_of[v.pool_id]))
            for i, v in enumerate(views)
        ]
        learn = self.config.learn
        if learn is None:
            learn = any(_actual(p)[:4] != _AS_DECLARED[:4] for p in cluster.pools)
        # the decode step is learned where a pool's decode runs otherwise than declared: the
        # simulated engines prefill first and stall their batch for it, which the learned
        # step (taken as the engine's own interleaving, not stretched again) averages over
        # (on a cluster whose decode runs as declared, learning it cost the admitted
        # requests 0.5 % of attainment, tests/unit/sim/test_learning.py)
        steps = any(_actual(p)[2:4] != _AS_DECLARED[2:4] for p in cluster.pools)
        self.learn = SimLearner(learn_steps=steps) if learn else None
        self.by_id = {w.view.worker_id: w for w in self.workers}
        bt = self.config.prefix_block_tokens
        self._prefix = self.config.prefix_cache and any(r.hash_ids for r in self.requests)
        # every worker's prefix cache, as the scheduler's own index models one (policy.prefix)
        self.prefix = PrefixIndex()
        for w in self.workers:
            self.prefix.stored(w.view.worker_id, (), bt)
            self.prefix.set_capacity(w.view.worker_id, max(1, w.kv_cap // bt if bt > 0 else 1))
        self._cached_tokens = 0
        self._prefill_tokens = 0
        self.prompt_mix = PromptMix()
        self.output_mix = PromptMix(initial_tokens=None)
        self.model = cluster.model
        self.eff = cluster.efficiency
        self.pipes: dict[tuple[str, ...], Pipe] = {}
        self.pipe_list: list[Pipe] = []
        self._pipe_of: dict[tuple[int, int], tuple[int, float, float]] = {}
        self.staleness = StalenessPolicy()
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._xfer_dst: dict[int, tuple[int, float]] = {}
        self._xfer_id = 0
        self.now = 0.0
        self.outcomes: list[RequestOutcome] = []
        self._plans: list[tuple[int, int, int]] = []
        self._planned_tokens: dict[int, int] = {}
        self._join_step: list[int] = []
        self._done = 0
        self._fleet: Fleet | None = None
        self._next_tick = 0.0
        self.fleet_builds = 0
        self.decisions = 0
        self.events = 0
        self.modes: dict[str, int] = {}
        self.kinds: dict[str, int] = {}
        self.reject_reasons: dict[str, int] = {}

    # -- helpers --------------------------------------------------------------------------

    def _push(self, t: float, kind: int, a: int, b: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, a, b))

    def _pick_tier(self) -> str:
        tiers = self.config.tiers
        if len(tiers) == 1:
            return tiers[0][0]
        total = sum(w for _, w in tiers)
        x = self.tier_rng.random() * total
        for name, w in tiers:
            x -= w
            if x < 0:
                return name
        return tiers[-1][0]

    def _pipe_for(self, src: SimWorker, dst: SimWorker) -> tuple[int, float, float]:
        """(pipe index, fixed delay s = latency + conversion per byte later, conv ms/byte)."""
        key = (src.idx, dst.idx)
        hit = self._pipe_of.get(key)
        if hit is not None:
            return hit
        _, link = self.cluster.links.between(src.view, dst.view)
        pkey = self.cluster.pipe_key(src.view, dst.view)
        pipe = self.pipes.get(pkey)
        if pipe is None:
            pipe = Pipe(link.gbps)
            self.pipes[pkey] = pipe
            self.pipe_list.append(pipe)
        neg = negotiate(src.view.kv_format, dst.view.kv_format)
        conv_ms_per_byte = neg.cost_ms_per_gib / GIB if neg.transferable else 0.0
        hit = (self.pipe_list.index(pipe), link.latency_ms * 1e-3, conv_ms_per_byte)
        self._pipe_of[key] = hit
        return hit

    # -- load reports and the policy call -----------------------------------------------------

    def _share(self, avg: float, since: float, on: bool, now: float) -> float:
        """An on/off indicator's time share, exponentially weighted with time constant
        ``util_tau_s``: ``avg`` as of ``since``, ``on`` ever since."""
        decay = math.exp(-(now - since) / self.config.util_tau_s) if now > since else 1.0
        target = 1.0 if on else 0.0
        return target + (avg - target) * decay

    def _util(self, w: SimWorker, now: float) -> float:
        """Busy fraction (:meth:`_share` of being busy)."""
        return self._share(w.util, w.util_t, w.active, now)

    def _set_active(self, w: SimWorker, active: bool, now: float) -> None:
        """Utilisation bookkeeping, updated only when the worker turns busy or idle (back to
        back iterations are one busy period)."""
        if w.active == active:
            return
        w.util = self._util(w, now)
        w.util_t = now
        if active:
            w.busy_since = now
        else:
            w.busy_total += now - w.busy_since
        w.active = active

    def _pduty(self, w: SimWorker, now: float) -> float:
        """Share of recent time spent in prefill iterations (the report's ``prefill_busy``;
        :meth:`_share` of prefilling)."""
        return self._share(w.pduty, w.pduty_t, w.in_prefill, now)

    def _set_prefill(self, w: SimWorker, on: bool, now: float) -> None:
        """Prefill-share bookkeeping, updated when the worker starts or stops prefilling."""
        if w.in_prefill == on:
            return
        w.pduty = self._pduty(w, now)
        w.pduty_t = now
        w.in_prefill = on

    def view_of(self, w: SimWorker, now: float) -> WorkerView:
        """The worker as the scheduler would see it now (capability + fresh load report)."""
        v = w.view
        bpt = w.bpt
        free = (w.kv_cap - w.kv_used) * bpt
        if w.itl:
            recent = sorted(w.itl)
            p50 = recent[len(recent) // 2]
            p99 = recent[min(len(recent) - 1, (len(recent) * 99) // 100)]
        else:
            p50 = p99 = 0.0
        blocks_total = w.kv_cap // v.kv_format.block_size_tokens
        load = LoadReport(
            reported_at_ms=round(now * 1000),
            queue_depth=len(w.admit_q) + len(w.prefill_q),
            queue_max=0,
            running_prefills=1 if (w.busy and w.iter_kind == 0) else 0,
            batch_size=w.batch + len(w.joiners),
            itl_p50_ms=p50,
            itl_p99_ms=p99,
            prefill_tokens_per_s=0.0,
            kv_blocks_free=(w.kv_cap - w.kv_used) // v.kv_format.block_size_tokens,
            kv_blocks_total=blocks_total,
            gpu_util=self._util(w, now),
            prefill_busy=self._pduty(w, now),
            memory_util=w.kv_used / w.kv_cap if w.kv_cap else 1.0,
        )
        return WorkerView(
            v.spec,
            kv_available_bytes=free,
            load=load,
            pending_requests=w.pending_reqs,
            pending_kv_bytes=w.pending_kv,
            pending_prefill_tokens=w.planned_tokens,
            learned=self.learn.prefill(v.worker_id) if self.learn is not None else None,
            learned_step=self.learn.step(v.worker_id) if self.learn is not None else None,
        )

    def _fleet_now(self, now: float) -> Fleet:
        interval = self.config.report_interval_s
        if self._fleet is not None and interval > 0 and now < self._next_tick:
            return self._fleet
        if interval > 0:
            tick = math.floor(now / interval) * interval
            self._next_tick = tick + interval
            stamp = tick
        else:
            stamp = now
        views = [self.view_of(w, stamp) for w in self.workers]
        on_way = [w for w in self.workers if w.pending_reqs]  # transfers whose prefill runs
        ix = self.prefix
        self._fleet = Fleet.build(
            views,
            now,
            links=self.cluster.links,
            staleness=self.staleness,
            ref_prompt_tokens=self.prompt_mix.ref_tokens(),
            ref_output_tokens=self.output_mix.ref_tokens(),
            previous=self._fleet,
            prefix=ix.entries if self._prefix else None,
            prefix_heads=ix.heads if self._prefix else None,
            inbound_transfers={w.view.worker_id: w.pending_reqs for w in on_way},
            # the prefills planned on each worker and not done count by their own prompt
            # tokens, as the scheduler service counts its own plans (``PrefillDue``); the
            # report's queue beyond them is priced at the mean prompt. At the mean prompt
            # alone, a heavy-tailed mix's queue of long prompts looked a third as long as it
            # was (bench/README.md, 2026-12-06, "Token-true views")
            known_prefills={w.view.worker_id: w.planned_n for w in self.workers if w.planned_n},
        )
        self.fleet_builds += 1
        return self._fleet

    # -- events ---------------------------------------------------------------------------------

    def _arrive(self, i: int, now: float) -> None:
        r = self.requests[i]
        out = self.outcomes[i]
        self.prompt_mix.observe(r.prompt_tokens)
        self.output_mix.observe(r.output_tokens)
        fleet = self._fleet_now(now)
        req = Request(
            request_id=f"r{i}",
            model_id=self.model.name,
            prompt_tokens=r.prompt_tokens,
            expected_output_tokens=r.output_tokens,
            tier=out.tier,
            prefix_blocks=r.hash_ids if self._prefix else (),
            prefix_block_tokens=self.config.prefix_block_tokens if self._prefix else 0,
        )
        decision = self.planner.plan(req, fleet, now, self.rng)
        self.decisions += 1
        kind = str(decision.kind.value)
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        out.kind = kind
        plan = decision.plan
        if decision.kind is DecisionKind.REJECT or plan is None:
            out.rejected = True
            reason = decision.reject_reasons[0] if decision.reject_reasons else "rejected"
            out.reject_reason = reason
            self.reject_reasons[reason] = self.reject_reasons.get(reason, 0) + 1
            if self._judge is not None:
                self._missed()
            self._complete_count()
            return
        if self.config.report_interval_s > 0:
            apply_reservations(fleet, decision)
        mode = str(plan.mode.value)
        self.modes[mode] = self.modes.get(mode, 0) + 1
        out.mode = mode
        out.prefill_worker = plan.prefill_worker_id
        out.decode_worker = plan.decode_worker_id
        pw = self.by_id[plan.prefill_worker_id]
        dw = self.by_id[plan.decode_worker_id]
        local = plan.mode is not Mode.TRANSFER or pw is dw
        if self.learn is not None:
            self.learn.planned(i, plan, now)
        self._plans[i] = (pw.idx, dw.idx, 1 if local else 0)
        prefiller = dw if local else pw
        prefiller.planned_n += 1
        prefiller.planned_tokens += plan.prefill_tokens
        self._planned_tokens[i] = plan.prefill_tokens
        dw.pending_kv += (r.prompt_tokens + r.output_tokens) * dw.bpt
        if local:
            dw.admit_q.append(i)
            self._admit(dw, now)
        else:
            dw.pending_reqs += 1
            pw.prefill_q.append(i)
            self._kick(pw, now)

    def _admit(self, w: SimWorker, now: float) -> None:
        """Admit from the head of the queue while KV memory and the batch bound allow."""
        q = w.admit_q
        kicked = False
        while q:
            i = q[0]
            r = self.requests[i]
            need = r.prompt_tokens + r.output_tokens
            if w.kv_used + need > w.kv_cap or w.admitted >= w.max_batch:
                break
            q.popleft()
            w.kv_used += need
            w.admitted += 1
            w.pending_kv -= need * w.bpt
            p_idx, _, local = self._plans[i]
            if local:
                w.prefill_q.append(i)
                kicked = True
            else:
                self._start_transfer(i, self.workers[p_idx], w, now)
        if kicked:
            self._kick(w, now)

    def _start_transfer(self, i: int, src: SimWorker, dst: SimWorker, now: float) -> None:
        r = self.requests[i]
        pidx, delay_s, conv_ms_per_byte = self._pipe_for(src, dst)
        held = 0
        if self._prefix and r.hash_ids:  # the decode engine pulls only what it lacks
            held = cached_tokens(
                r.hash_ids,
                self.prefix.held(dst.view.worker_id),
                self.config.prefix_block_tokens,
                r.prompt_tokens,
            )
        nbytes = (r.prompt_tokens - held) * src.bpt
        extra_s = delay_s + nbytes * conv_ms_per_byte * 1e-3
        pipe = self.pipe_list[pidx]
        pipe.advance(now)
        self._xfer_id += 1
        xid = self._xfer_id
        pipe.active[xid] = nbytes * 8.0
        self._xfer_dst[xid] = (i, extra_s)
        pipe.version += 1
        self._push(pipe.next_finish(now), _PIPE, pidx, pipe.version)

    def _pipe_event(self, pidx: int, version: int, now: float) -> None:
        pipe = self.pipe_list[pidx]
        if version != pipe.version:
            return
        pipe.advance(now)
        # anything due within a nanosecond is done (float time cannot resolve less)
        eps = _EPS_BITS + pipe.bits_per_s / max(1, len(pipe.active)) * 1e-9
        done = [x for x, left in pipe.active.items() if left <= eps]
        for x in done:
            del pipe.active[x]
            i, extra_s = self._xfer_dst.pop(x)
            self._push(now + extra_s, _DELIVER, i, 0)
        if pipe.active:
            pipe.version += 1
            self._push(pipe.next_finish(now), _PIPE, pidx, pipe.version)

    def _deliver(self, i: int, now: float) -> None:
        """KV arrived on the decode worker: first token; join the batch."""
        _, d_idx, _ = self._plans[i]
        dw = self.workers[d_idx]
        if self._prefix:
            self._hold(dw, self.requests[i].hash_ids)
        self._first_token(i, dw, now)

    def _hold(self, w: SimWorker, ids: Sequence[int]) -> None:
        """The worker now holds these prefix blocks (a trace's ids start at its prompt's
        first block), most recent."""
        self.prefix.stored(w.view.worker_id, ids, self.config.prefix_block_tokens, head=True)

    def _first_token(self, i: int, w: SimWorker, now: float) -> None:
        out = self.outcomes[i]
        out.first_s = now
        judge = self._judge
        if judge is not None and judge.ttft_missed(out):
            self._missed()
        if out.output_tokens <= 1:
            self._finish(i, w, now, from_step=False)
            self._admit(w, now)
            return
        w.joiners.append(i)
        self._kick(w, now)

    def _kick(self, w: SimWorker, now: float) -> None:
        """Start the next iteration if the worker is idle: prefills first, then a decode
        step over the running batch (joiners merged); otherwise go idle."""
        if w.busy:
            return
        if w.prefill_q:
            batch = self._prefill_batch(w)
            dur = 0.0
            for i in batch:
                dur += self._prefill_compute_ms(w, i)
            dur = dur * w.p_scale + w.p_fixed_ms * (1.0 + w.p_share * (len(batch) - 1))
            w.iter_kind = 0
            w.iter_payload = batch[0]
            w.iter_batch = batch
            w.busy = True
            self._set_active(w, True, now)
            self._set_prefill(w, True, now)
            self._push(now + dur * 1e-3, _ITER, w.idx, batch[0])
            return
        if w.joiners:
            sc = w.step_count
            heap = w.finish_heap
            join_step = self._join_step
            for i in w.joiners:
                r = self.requests[i]
                w.ctx += r.prompt_tokens + 1
                w.batch += 1
                # joins after step sc; takes part in steps sc+1 .. sc+output-1
                heapq.heappush(heap, (sc + r.output_tokens - 1, i))
                join_step[i] = sc
            w.joiners.clear()
        if w.batch:
            dur = perfmodel.decode_step_ms(
                self.model, w.gpu, w.tp, w.batch, w.ctx, self.eff, w.dtype
            )
            dur = dur * w.d_scale + w.d_seq_ms * w.batch
            w.iter_kind = 1
            w.step_start = now
            w.busy = True
            self._set_active(w, True, now)
            self._set_prefill(w, False, now)
            self._push(now + dur * 1e-3, _ITER, w.idx, -1)
            return
        self._set_active(w, False, now)
        self._set_prefill(w, False, now)

    def _prefill_batch(self, w: SimWorker) -> list[int]:
        """The prompts of the next prefill iteration, from the head of the queue: one, or
        with a token budget (``p_budget``, as vLLM's ``max_num_batched_tokens``) as many as
        fit in it whole (a longer first prompt goes alone; chunking it is not modelled)."""
        batch = [w.prefill_q.popleft()]
        if w.p_budget > 0:
            used = self.requests[batch[0]].prompt_tokens
            q = w.prefill_q
            while q and used + self.requests[q[0]].prompt_tokens <= w.p_budget:
                used += self.requests[q[0]].prompt_tokens
                batch.append(q.popleft())
        return batch

    def _prefill_compute_ms(self, w: SimWorker, i: int) -> float:
        """The declared compute of request ``i``'s prefill on ``w`` (its cached prefix
        not recomputed), counting its tokens and holding its blocks."""
        r = self.requests[i]
        cached = 0
        if self._prefix and r.hash_ids:
            cached = cached_tokens(
                r.hash_ids,
                self.prefix.held(w.view.worker_id),
                self.config.prefix_block_tokens,
                r.prompt_tokens,
            )
            self._hold(w, r.hash_ids)
        self._cached_tokens += cached
        self._prefill_tokens += r.prompt_tokens
        return perfmodel.prefill_ms(
            self.model, w.gpu, w.tp, r.prompt_tokens - cached, self.eff, cached
        )

    def _iter_done(self, w: SimWorker, now: float) -> None:
        if w.iter_kind == 0:
            # still busy while the batch's requests move on, so that none of them starts
            # the worker's next iteration before the others have joined
            for i in w.iter_batch:
                _, d_idx, local = self._plans[i]
                w.planned_n -= 1
                w.planned_tokens -= self._planned_tokens.pop(i)
                if self.learn is not None:
                    self.learn.prefill_done(i, now)
                if local:
                    self._first_token(i, w, now)
                else:
                    dw = self.workers[d_idx]
                    dw.pending_reqs -= 1
                    dw.admit_q.append(i)
                    self._admit(dw, now)
            w.busy = False
        else:
            w.busy = False
            w.step_count += 1
            w.ctx += w.batch
            w.step_ends.append(now)
            w.itl.append((now - w.step_start) * 1e3)
            sc = w.step_count
            heap = w.finish_heap
            freed = False
            while heap and heap[0][0] <= sc:
                _, i = heapq.heappop(heap)
                r = self.requests[i]
                w.batch -= 1
                w.ctx -= r.prompt_tokens + r.output_tokens
                self._finish(i, w, now, from_step=True)
                freed = True
            if freed:
                self._admit(w, now)
        self._kick(w, now)

    def _finish(self, i: int, w: SimWorker, now: float, from_step: bool) -> None:
        """Record the last token, free the KV reservation and the batch slot."""
        out = self.outcomes[i]
        r = self.requests[i]
        out.finish_s = now
        if from_step:
            j = self._join_step[i]
            ends = w.step_ends[j : j + r.output_tokens - 1]
            g = [(ends[0] - out.first_s) * 1e3]
            g += [(b - a) * 1e3 for a, b in itertools.pairwise(ends)]
            out.tbt_ms = tbt_ms(g)
            if self.config.keep_gaps:
                out.gaps_ms = tuple(g)
        w.kv_used -= r.prompt_tokens + r.output_tokens
        w.admitted -= 1
        if self.learn is not None:
            self.learn.finished(i, out.first_s, now, r.output_tokens)
        judge = self._judge
        if judge is not None and not judge.ttft_missed(out) and not judge.met(out):
            self._missed()  # a late first token was counted when it came
        self._complete_count()

    def _missed(self) -> None:
        """One more request certainly out of target: stop when the share that can still
        meet them is below ``stop_below`` (the same division as ``metrics.attainment``)."""
        self._misses += 1
        n = len(self.requests)
        if (n - self._misses) / n < self._stop_below:
            self._stop = True

    def _complete_count(self) -> None:
        self._done += 1
        cb = self.on_progress
        if cb is not None:
            n = len(self.requests)
            step = max(1, n // 100)
            if self._done % step == 0 or self._done == n:
                cb(self._done, n)

    # -- run ------------------------------------------------------------------------------------

    def run(self, rate_scale: float = 1.0) -> SimResult:
        """Simulate until every request has completed or been rejected."""
        t0 = time.perf_counter()
        n = len(self.requests)
        self.outcomes = [
            RequestOutcome(i, self._pick_tier(), r.arrival_s, r.prompt_tokens, r.output_tokens)
            for i, r in enumerate(self.requests)
        ]
        self._plans = [(-1, -1, 0)] * n
        self._planned_tokens = {}
        self._join_step = [0] * n
        for i, r in enumerate(self.requests):
            self._push(r.arrival_s, _ARRIVAL, i, 0)
        heap = self._heap
        workers = self.workers
        pop = heapq.heappop
        events = 0
        now = 0.0
        while heap and not self._stop:
            now, _, kind, a, b = pop(heap)
            events += 1
            if kind == _ITER:
                self._iter_done(workers[a], now)
            elif kind == _ARRIVAL:
                self._arrive(a, now)
            elif kind == _PIPE:
                self._pipe_event(a, b, now)
            else:
                self._deliver(a, now)
        for w in workers:
            self._set_active(w, False, now)
        self.now = now
        end = max(now, 1e-9)
        return SimResult(
            policy=self.profile.name,
            cluster=self.cluster.name,
            rate_scale=rate_scale,
            outcomes=self.outcomes,
            sim_end_s=now,
            wall_s=time.perf_counter() - t0,
            decisions=self.decisions,
            events=events,
            fleet_builds=self.fleet_builds,
            modes=dict(self.modes),
            kinds=dict(self.kinds),
            reject_reasons=dict(self.reject_reasons),
            busy_fraction={w.view.worker_id: w.busy_total / end for w in workers},
            cached_prompt_tokens=self._cached_tokens,
            prompt_tokens=self._prefill_tokens,
            prefix_blocks_max=max((self.prefix.size(w.view.worker_id) for w in workers), default=0),
            stopped_early=self._stop,
        )


def simulate(
    cluster: ClusterSpec,
    profile: Profile,
    requests: Sequence[TraceRequest],
    config: SimConfig | None = None,
    rate_scale: float = 1.0,
    on_progress: Callable[[int, int], None] | None = None,
    judge: Judge | None = None,
    stop_below: float = 0.0,
) -> SimResult:
    """Run one simulation; ``requests`` are used as given (rate-scale them beforehand with
    ``hpd_sim.traces.reshape``; ``rate_scale`` is only recorded in the result).
    ``judge``/``stop_below``: stop once that share of requests meeting their targets is out of
    reach (:class:`Simulator`)."""
    sim = Simulator(cluster, profile, requests, config, on_progress, judge, stop_below)
    return sim.run(rate_scale)
