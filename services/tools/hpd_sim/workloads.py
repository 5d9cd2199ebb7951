"""Synthetic workloads for the simulator: seeded generators of request traces whose shape
differs from the recorded traces in the one way each names, so that a policy is judged on
traffic it was not tuned on (``bench/goodput.py --suite``, ``hpd sim --trace synthetic:NAME``).

Every generator returns a :class:`~hpd_sim.traces.Trace` of ``n`` requests at a mean rate
of 1 request/s (so a goodput search's rate scale reads as requests/s), reproducible from
``seed``. Token counts are log-normal (median ``m``, shape ``sigma``), clipped to
``[lo, hi]``:

=================  ==========================  ======================  =====================
name               prompt tokens (m, sigma,     output tokens           arrivals
                   lo-hi)
=================  ==========================  ======================  =====================
``long_prompts``   6,000, 0.5, 1,500-24,000    150, 0.7, 8-1,024       Poisson
``short_prompts``  200, 0.6, 16-1,200          300, 0.6, 16-1,500      Poisson
``bursts``         1,000, 0.8, 32-8,000        180, 0.9, 4-2,048       on/off: 10 s at 3x
                                                                        the mean rate, 20 s
                                                                        at 0
``decode_heavy``   400, 0.6, 32-2,000          900, 0.5, 128-4,000     Poisson
=================  ==========================  ======================  =====================

Why these: long prompts make prefill the bottleneck and the KV transfer large (where the
hand-off choice and the link matter most); short prompts make decode and the per-request
overheads dominate; bursts test queueing and admission at a rate the mean hides (the Azure
trace's bursts reach 1.37x its mean; these reach 3x); decode-heavy output lengths fill
decode batches and KV memory. The medians bracket the recorded traces (Azure conversation:
prompt p50 1,020, output p50 129; Mooncake: prompts of 13k on average) rather than copy one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from hpd_sim.traces import Trace, TraceRequest

__all__ = ["SYNTHETIC", "Shape", "synthetic_trace"]


@dataclass(frozen=True, slots=True)
class Shape:
    """A log-normal token count: median, shape and clip bounds (tokens)."""

    median: float
    sigma: float
    lo: int
    hi: int

    def draw(self, rng: random.Random) -> int:
        v = self.median * math.exp(rng.gauss(0.0, self.sigma))
        return max(self.lo, min(self.hi, round(v)))


def _poisson(rng: random.Random, n: int) -> list[float]:
    t = 0.0
    out: list[float] = []
    for _ in range(n):
        t += rng.expovariate(1.0)
        out.append(t)
    return out


def _on_off(rng: random.Random, n: int, on_s: float = 10.0, off_s: float = 20.0) -> list[float]:
    """Poisson arrivals at ``(on + off) / on`` x 1 req/s during ``on_s``, none during
    ``off_s``: a mean of 1 req/s in bursts of 3x."""
    peak = (on_s + off_s) / on_s
    t = 0.0
    out: list[float] = []
    while len(out) < n:
        t += rng.expovariate(peak)
        phase = t % (on_s + off_s)
        if phase >= on_s:  # skip the silent phase; the memoryless gap restarts at the next burst
            t += on_s + off_s - phase
            continue
        out.append(t)
    return out


@dataclass(frozen=True, slots=True)
class _Spec:
    prompt: Shape
    output: Shape
    arrivals: Callable[[random.Random, int], list[float]]


SYNTHETIC: dict[str, _Spec] = {
    "long_prompts": _Spec(Shape(6000, 0.5, 1500, 24000), Shape(150, 0.7, 8, 1024), _poisson),
    "short_prompts": _Spec(Shape(200, 0.6, 16, 1200), Shape(300, 0.6, 16, 1500), _poisson),
    "bursts": _Spec(Shape(1000, 0.8, 32, 8000), Shape(180, 0.9, 4, 2048), _on_off),
    "decode_heavy": _Spec(Shape(400, 0.6, 32, 2000), Shape(900, 0.5, 128, 4000), _poisson),
}
"""The generators by name (module docstring)."""


def synthetic_trace(name: str, n: int = 2000, seed: int = 0) -> Trace:
    """``n`` requests of the named synthetic workload, mean rate 1 request/s, arrivals from 0.

    Raises ``ValueError`` naming the known workloads for an unknown name."""
    spec = SYNTHETIC.get(name)
    if spec is None:
        raise ValueError(f"unknown synthetic workload {name!r}; known: {', '.join(SYNTHETIC)}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(f"{name}:{seed}")
    times = spec.arrivals(rng, n)
    t0 = times[0]
    rows = tuple(TraceRequest(t - t0, spec.prompt.draw(rng), spec.output.draw(rng)) for t in times)
    return Trace(f"synthetic:{name}", rows)
