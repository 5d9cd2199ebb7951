"""What one worker of a GPU kind in a role costs per request of a bucket, from the shared
performance model (``hpd_common.perfmodel``, with the kind's learned figures applied):
the figures the integer program (``hpd_plan.milp``) sizes the fleet with.

A **group** is a (kind, worker size ``tp``, role) the fleet may hold workers of; a worker
serving both stages is planned at an operating point ``rho``, the share of its time it may
spend prefilling (``BOTH_PREFILL_SHARES``; the rest decodes), since prefills interleaved on
it stretch every token gap of its batch.

Per request of bucket ``b`` on a worker of group ``g`` (times in ms unless said):

* prefill ``S = prefill_ms(prompt - cached, cached) x prefill_scale + prefill_fixed_ms``;
  ``prefill_s`` is its mean over the bucket, in seconds.
* decode at the operating batch ``B*``: the largest ``B <= max_batch`` with
  ``step(B, B x ctx_b) <= TPOT x (1 - rho)`` (``rho = 0`` on a decode worker) and
  ``B x E[prompt + output] <= KV capacity``, where ``step = decode_step_ms x decode_scale +
  decode_seq_ms x B`` and ``ctx_b`` the bucket's token-weighted decode context;
  ``decode_s = E[output - 1] x step(B*) / B* / 1000``: worker-seconds of decoding per
  request. A group whose KV cannot hold the bucket's mean sequence cannot serve it.
* **misses**: the share of the bucket's requests that miss their SLO on the group however
  the fleet is sized: a prompt whose ``S + W + extra > TTFT`` or that does not fit its KV,
  and a multi-token output when even ``step(1)`` exceeds the TPOT budget or its sequence
  does not fit. ``W`` is the mean queueing wait of one M/G/1 server (Pollaczek-Khinchine)
  at the utilisation ``u`` the side runs at (the headroom; ``headroom x rho`` for prefills
  on a both-stage worker): ``W = q(u) x E[S^2] / E[S]``, ``q(u) = u / (2 (1 - u))``, the
  moments over the whole traffic's prompts on that kind and size (rate-weighted), so a
  short prompt waits behind the long ones it shares a worker with. ``extra`` is the KV
  transfer over the link (prefill workers) or one decode step (both-stage workers). A
  both-stage worker misses a request that misses either side:
  ``1 - (1 - miss_p) (1 - miss_d)``.

The wait is that of one worker serving the whole traffic: pessimistic for a pool of
several workers. The verification in the simulator is what holds the plan to account.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hpd_common import perfmodel
from hpd_scheduler.policy import LinkModel, Locality

from .catalogue import Catalogue, GpuKind
from .traffic import Bucket

__all__ = [
    "BOTH_PREFILL_SHARES",
    "ROLES",
    "Cost",
    "CostModel",
    "Group",
    "Headroom",
    "groups",
    "mm1_wait_factor",
]

ROLES = ("prefill", "decode", "both")
BOTH_PREFILL_SHARES = (0.2, 0.4, 0.6)
"""Operating points of a both-stage worker: the share of its time it may prefill. A grid,
not a fit: one point per fifth of the time, from mostly decoding to mostly prefilling."""


@dataclass(frozen=True, slots=True)
class Group:
    """Workers of one kind, size and role (``rho``: a both-stage worker's prefill share)."""

    kind: GpuKind
    tp: int
    role: str
    rho: float = 0.0

    @property
    def price_per_hour(self) -> float:
        """USD per hour of one worker: price per GPU-hour x tp."""
        return self.kind.price_per_hour * self.tp

    @property
    def pool(self) -> tuple[str, int, str]:
        """(kind, tp, role): the pool its workers go to (operating points merge)."""
        return (self.kind.name, self.tp, self.role)

    @property
    def label(self) -> str:
        """``H100-SXM tp1 both@0.4``."""
        at = f"@{self.rho:g}" if self.role == "both" else ""
        return f"{self.kind.name} tp{self.tp} {self.role}{at}"


@dataclass(frozen=True, slots=True)
class Headroom:
    """The share of a worker's capacity the plan may load, per role (module docstring of
    ``hpd_plan.planner`` for the default)."""

    prefill: float
    decode: float
    both: float

    def of(self, role: str) -> float:
        """The headroom of ``role``."""
        return float(getattr(self, role))


@dataclass(frozen=True, slots=True)
class Cost:
    """Per request of a bucket on a group: worker-seconds of prefill and of decode, and the
    share of the bucket's requests that miss their SLO there whatever the fleet's size."""

    prefill_s: float
    decode_s: float
    miss: float


def mm1_wait_factor(u: float) -> float:
    """``q(u) = u / (2 (1 - u))``: the M/D/1 mean queueing wait in service times at
    utilisation ``u`` (2 at 0.8, 4.5 at 0.9)."""
    u = min(max(u, 0.0), 0.99)
    return u / (2.0 * (1.0 - u))


def groups(catalogue: Catalogue) -> list[Group]:
    """Every group the fleet may hold: each kind and worker size that can be had, in each
    role (both-stage workers at each operating point)."""
    out: list[Group] = []
    for kind in catalogue.kinds:
        for tp in kind.tps:
            if kind.available is not None and kind.available < tp:
                continue
            out.append(Group(kind, tp, "prefill", 1.0))
            out.append(Group(kind, tp, "decode", 0.0))
            out += [Group(kind, tp, "both", rho) for rho in BOTH_PREFILL_SHARES]
    return out


class CostModel:
    """The performance model for one model and one link between prefill and decode
    workers (module docstring)."""

    def __init__(
        self,
        model: perfmodel.ModelSpec,
        eff: perfmodel.Efficiency = perfmodel.DEFAULT_EFFICIENCY,
        links: LinkModel | None = None,
        nic_gbps: float = 200.0,
    ) -> None:
        self.model = model
        self.eff = eff
        link = (links or LinkModel()).classes[Locality.SAME_ZONE]
        self.link_gbps = min(link.gbps, nic_gbps)
        self.link_latency_ms = link.latency_ms
        self._step: dict[tuple[GpuKind, int, int, int], float] = {}
        self._prefills: dict[tuple[GpuKind, int, int], tuple[Bucket, list[float]]] = {}
        self._residual: dict[tuple[GpuKind, int], float] = {}

    def prefill_ms(self, kind: GpuKind, tp: int, prompt: int, cached: int) -> float:
        """A prefill's time: the roofline on the uncached tokens, learned figures applied."""
        base = perfmodel.prefill_ms(
            self.model, kind.gpu, tp, max(prompt - cached, 1), self.eff, cached_tokens=cached
        )
        return base * kind.learned.prefill_scale + kind.learned.prefill_fixed_ms

    def prefill_times(self, kind: GpuKind, tp: int, b: Bucket) -> list[float]:
        """:meth:`prefill_ms` of each of the bucket's requests (memoised per bucket)."""
        key = (kind, tp, id(b))
        hit = self._prefills.get(key)
        if hit is None or hit[0] is not b:  # (the bucket kept: an id is reused only once freed)
            hit = (b, [self.prefill_ms(kind, tp, p, c) for p, c, _ in b.reqs])
            self._prefills[key] = hit
        return hit[1]

    def step_ms(self, kind: GpuKind, tp: int, batch: int, ctx: float) -> float:
        """A decode step of ``batch`` sequences of mean context ``ctx``, learned figures
        applied (memoised)."""
        key = (kind, tp, batch, round(batch * ctx))
        hit = self._step.get(key)
        if hit is None:
            base = perfmodel.decode_step_ms(self.model, kind.gpu, tp, batch, key[3], self.eff)
            hit = base * kind.learned.decode_scale + kind.learned.decode_seq_ms * batch
            self._step[key] = hit
        return hit

    def kv_tokens(self, kind: GpuKind, tp: int) -> int:
        """KV tokens one worker holds (``perfmodel.max_kv_tokens``)."""
        return perfmodel.max_kv_tokens(self.model, kind.gpu, tp, kind.memory_fraction)

    def transfer_ms(self, prompt: int, tp: int) -> float:
        """A prompt's KV over the link: ``bytes x 8 / (Gb/s x 1e6) + latency``."""
        nbytes = prompt * self.model.kv_format(tp_size=tp).bytes_per_token()
        return nbytes * 8.0 / (self.link_gbps * 1e6) + self.link_latency_ms

    def decode_point(
        self, kind: GpuKind, tp: int, b: Bucket, budget_ms: float
    ) -> tuple[int, float]:
        """(B*, step ms at B*) for bucket ``b`` within a step budget (module docstring);
        (1, step(1)) when even one sequence is over it, (0, 0) when the KV holds none."""
        ctx = b.decode_ctx
        b_mem = int(self.kv_tokens(kind, tp) // max(b.seq_tokens, 1.0))
        hi = min(kind.max_batch_size, b_mem)
        if hi < 1:
            return 0, 0.0
        if self.step_ms(kind, tp, 1, ctx) > budget_ms:
            return 1, self.step_ms(kind, tp, 1, ctx)
        lo = 1
        while lo < hi:  # the largest B within budget: the step grows with B
            mid = (lo + hi + 1) // 2
            if self.step_ms(kind, tp, mid, ctx) <= budget_ms:
                lo = mid
            else:
                hi = mid - 1
        return lo, self.step_ms(kind, tp, lo, ctx)

    def residuals(self, gs: Sequence[Group], bs: Sequence[Bucket]) -> None:
        """Set, per (kind, tp) of ``gs``, the prefill's ``E[S^2] / E[S]`` (ms) over the
        buckets' requests weighted by their rates: what :meth:`cost`'s wait is made of."""
        for kind, tp in {(g.kind, g.tp) for g in gs}:
            m1 = m2 = 0.0
            for b in bs:
                times = self.prefill_times(kind, tp, b)
                w = b.rate_rps / len(times)
                m1 += w * sum(times)
                m2 += w * sum(t * t for t in times)
            self._residual[(kind, tp)] = m2 / m1 if m1 > 0 else 0.0

    def cost(self, g: Group, b: Bucket, headroom: Headroom) -> Cost | None:
        """The group's cost per request of the bucket (module docstring); None when it
        cannot serve the bucket at all. The prefill wait uses the moments
        :meth:`residuals` set (:meth:`table` sets them; none set: no wait)."""
        kind, tp = g.kind, g.tp
        cap = self.kv_tokens(kind, tp)
        ttft, tpot = b.slo.ttft_ms, b.slo.tpot_ms
        n = len(b.reqs)
        prefill_s = decode_s = miss_p = miss_d = 0.0
        step = 0.0
        if g.role != "prefill":
            point, step = self.decode_point(kind, tp, b, tpot * (1.0 - g.rho))
            if point == 0:
                return None
            over = step > tpot * (1.0 - g.rho)
            decode_s = b.decode_tokens * step / point / 1000.0
            miss_d = sum(1 for p, _, o in b.reqs if p + o > cap or (over and o > 1)) / n
        if g.role != "decode":
            u = headroom.of(g.role) * (g.rho if g.role == "both" else 1.0)
            wait = mm1_wait_factor(u) * self._residual.get((kind, tp), 0.0)
            times = self.prefill_times(kind, tp, b)
            prefill_s = sum(times) / n / 1000.0
            late = 0
            for (p, _, _), s in zip(b.reqs, times, strict=True):
                extra = self.transfer_ms(p, tp) if g.role == "prefill" else step
                late += p > cap or s + wait + extra > ttft
            miss_p = late / n
        miss = 1.0 - (1.0 - miss_p) * (1.0 - miss_d)
        return Cost(prefill_s, decode_s, miss)

    def table(
        self, gs: Sequence[Group], bs: Sequence[Bucket], headroom: Headroom, slack: float
    ) -> dict[tuple[int, int], Cost]:
        """``{(bucket index, group index): cost}`` for every pair that can serve the bucket
        and misses at most ``slack`` more of its requests than the best placement does.

        The best: the least miss of the groups of the pair's role, and for a both-stage
        group also of a prefill group plus a decode group. A kind that would miss a
        request another kind serves in time is no place to plan it: the scheduler does
        not follow the program's split, and would send it more than its share."""
        self.residuals(gs, bs)
        out: dict[tuple[int, int], Cost] = {}
        for j, g in enumerate(gs):
            for i, b in enumerate(bs):
                c = self.cost(g, b, headroom)
                if c is not None:
                    out[(i, j)] = c
        best: dict[tuple[int, str], float] = {}
        for (i, j), c in out.items():
            key = (i, gs[j].role)
            best[key] = min(best.get(key, 1.0), c.miss)
        for (i, j), c in list(out.items()):
            floor = best[(i, gs[j].role)]
            if gs[j].role == "both":
                split = best.get((i, "prefill"), 1.0) + best.get((i, "decode"), 1.0)
                floor = min(floor, split)
            if c.miss > floor + slack + 1e-12:
                del out[(i, j)]
        return out
