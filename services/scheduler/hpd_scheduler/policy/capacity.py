"""Per-worker capacity figures, derived once per fleet snapshot from the shared performance
model and corrected by what the worker reports.

Why: the seeds score load as utilisation fractions and queue lengths, which treats an L4 and
an H100 at queue depth 8 as equally loaded. Here every load figure becomes *time on that
worker*: queued prefill work in seconds of its own prefill throughput, decode pressure as its
own predicted step time. A fast GPU at queue 8 then beats a slow one at queue 6.

Formulas (ms unless stated):

* prefill time of ``n`` tokens: ``max(floor, a n + b n^2) x m_p`` where ``a n + b n^2`` is the
  roofline compute time (``perfmodel.prefill_ms`` fitted exactly at 1,024 and 2,048 tokens:
  the linear weight term and the quadratic attention term), ``floor`` the weight-read time,
  and ``m_p`` the observed correction (below).
* prefill throughput ``tps = ref / prefill_ms(ref) x 1000 x replicas`` with
  ``replicas = max(1, gpu_count // tp)`` engines in the worker.
* decode step (memory-bound roofline): ``(weights_ms + context_tokens x kv_ms_per_token)
  x m_d``, where ``weights_ms`` is ``perfmodel.decode_step_ms`` with no context (one read of
  the weights) and ``kv_ms_per_token`` its slope in resident context tokens; both are read
  off the performance model once per model x GPU x TP. Admitting a sequence of ``t``
  context tokens adds ``t x kv_ms_per_token``. The compute floor, which only matters at
  very large batches, is left out of this linear form.
* observed correction with confidence ``c`` (see :func:`confidence`):
  ``m = c x clamp(observed / nominal, 0.25, 4) + (1 - c)``, for prefill from the reported
  prefill tokens/s (``nominal_tps / observed_tps``), for decode from the reported ITL p50.
* recompute on a decode worker = its own prefill time for the prompt (its GPU, its TP, its
  observed throughput), not a constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from hpd_common import perfmodel
from hpd_common.gpus import GpuProfile, UnknownGpuError, gpu_profile
from hpd_common.kvformat import KvDtype

from .domain import WorkerView

__all__ = [
    "Capacity",
    "StalenessPolicy",
    "capacity_for",
    "confidence",
    "resolve_gpu",
    "resolve_model",
]


@dataclass(frozen=True, slots=True)
class StalenessPolicy:
    """A report younger than ``fresh_s`` is trusted fully; confidence falls linearly to 0 at
    ``stale_s``; a worker with no report at all has confidence 0."""

    fresh_s: float = 2.0
    stale_s: float = 10.0


def confidence(reported_at_s: float | None, now_s: float, policy: StalenessPolicy) -> float:
    """``1`` if ``age <= fresh``; ``(stale - age) / (stale - fresh)`` in between; ``0`` beyond
    (and with no report). A report from the future (clock skew) counts as fresh."""
    if reported_at_s is None:
        return 0.0
    age = now_s - reported_at_s
    if age <= policy.fresh_s:
        return 1.0
    if age >= policy.stale_s:
        return 0.0
    return (policy.stale_s - age) / (policy.stale_s - policy.fresh_s)


def resolve_gpu(view: WorkerView) -> GpuProfile | None:
    """The worker's GPU profile: table entry, with per-GPU overrides applied; None when the
    name is unknown and no figures were given."""
    try:
        base = gpu_profile(view.gpu_type)
    except UnknownGpuError:
        if view.peak_tflops and view.hbm_gbps:
            return GpuProfile(view.gpu_type, view.peak_tflops, 0.0, 0.0, view.hbm_gbps, 0.0, 0.0)
        return None
    if view.peak_tflops or view.hbm_gbps:
        return GpuProfile(
            base.name,
            view.peak_tflops or base.peak_tflops_bf16,
            base.peak_tflops_fp8,
            base.hbm_gib,
            view.hbm_gbps or base.hbm_gbps,
            base.nvlink_gbps,
            base.price_per_hour_usd,
        )
    return base


def resolve_model(view: WorkerView) -> perfmodel.ModelSpec:
    """The model's spec; for a model not in the table, one from the KV format (its layers,
    KV heads and head dim) and the size the agent read from the model's ``config.json``
    (labels ``model-params``, parameters a token goes through, and
    ``model-attention-width``); without those labels, a last resort of 8 B parameters and
    hidden size 4,096 per 32 layers, so capacity still orders GPUs correctly relative to
    each other (but prices a small model's compute far too high: a 3 M parameter model's
    prefill was predicted 65-100x slower than its engine ran, and admission refused it)."""
    try:
        return perfmodel.model_spec(view.model_id)
    except KeyError:
        f = view.kv_format
        layers = max(f.num_layers, 1)
        params = _label_int(view, "model-params")
        width = _label_int(view, "model-attention-width")
        return perfmodel.ModelSpec(
            view.model_id or "unknown",
            params / 1e9 if params else 8.0,
            num_layers=layers,
            num_kv_heads=max(f.num_kv_heads, 1),
            head_dim=max(f.head_dim, 1),
            hidden_size=width or max(128, 4096 * layers // 32),
        )


def _label_int(view: WorkerView, name: str) -> int:
    """A positive integer label, 0 when absent or not one."""
    raw = view.labels.get(name, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else 0


@dataclass(frozen=True, slots=True)
class _Coeffs:
    lin_ms: float
    quad_ms: float
    floor_ms: float
    kv_ms_per_token: float
    weights_ms: float


@lru_cache(maxsize=4096)
def _coeffs(model: perfmodel.ModelSpec, gpu: GpuProfile, tp: int, dtype: KvDtype) -> _Coeffs:
    t1 = perfmodel.prefill_ms(model, gpu, tp, 1024)
    t2 = perfmodel.prefill_ms(model, gpu, tp, 2048)
    # t(n) = a n + b n^2 through (1024, t1) and (2048, t2)
    quad = (t2 - 2.0 * t1) / (2048.0 * 2048.0 - 2.0 * 1024.0 * 1024.0)
    lin = (t1 - quad * 1024.0 * 1024.0) / 1024.0
    floor = perfmodel.prefill_ms(model, gpu, tp, 1)
    w = perfmodel.decode_step_ms(model, gpu, tp, 1, 0, kv_dtype=dtype)
    big = perfmodel.decode_step_ms(model, gpu, tp, 1, 100_000, kv_dtype=dtype)
    return _Coeffs(max(lin, 0.0), max(quad, 0.0), floor, (big - w) / 100_000.0, w)


@dataclass(frozen=True, slots=True)
class Capacity:
    """Nominal speed of one worker (before observed corrections)."""

    lin_ms: float
    quad_ms: float
    floor_ms: float
    replicas: int
    kv_ms_per_token: float
    weights_ms: float
    prefill_tps: float
    hbm_gbps_total: float
    kv_bytes_per_token: int

    def prefill_ms(self, tokens: int) -> float:
        """Nominal prefill time of ``tokens`` prompt tokens on one engine of this worker."""
        n = float(tokens)
        return max(self.floor_ms, self.lin_ms * n + self.quad_ms * n * n)

    def decode_step_ms(self, context_tokens: float) -> float:
        """Nominal memory-bound decode step with ``context_tokens`` resident: the weights
        read once plus every resident token's KV read."""
        return self.weights_ms + context_tokens * self.kv_ms_per_token


def capacity_for(view: WorkerView, gpu: GpuProfile, ref_tokens: int = 1024) -> Capacity:
    """Derive the worker's :class:`Capacity` (cached per model x GPU x TP)."""
    model = resolve_model(view)
    tp = max(view.tp_size, 1)
    co = _coeffs(model, gpu, tp, view.kv_format.dtype)
    replicas = max(1, view.gpu_count // tp)
    n = float(ref_tokens)
    ref_ms = max(co.floor_ms, co.lin_ms * n + co.quad_ms * n * n)
    return Capacity(
        lin_ms=co.lin_ms,
        quad_ms=co.quad_ms,
        floor_ms=co.floor_ms,
        replicas=replicas,
        kv_ms_per_token=co.kv_ms_per_token,
        weights_ms=co.weights_ms,
        prefill_tps=n / ref_ms * 1000.0 * replicas,
        hbm_gbps_total=gpu.hbm_gbps * max(view.gpu_count, 1),
        kv_bytes_per_token=view.kv_format.bytes_per_token(),
    )
