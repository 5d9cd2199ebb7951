"""Roofline performance model: prefill and decode step times from a model and a GPU profile.

One model, shared by the scheduler (recompute estimates, capacity-normalised load), the
emulated fleet (how long a fake worker sleeps) and the simulator (service times), so that the
three never disagree about how fast a GPU is.

Both phases are rooflines, ``time = max(compute time, memory time)``:

* compute time = FLOPs / (peak TFLOP/s x 1e12 x MFU x tp_scale(tp))
* memory time  = bytes one rank reads / (HBM GB/s x 1e9 x MBU x tp_eff(tp))

with ``tp_eff(tp) = tp_efficiency ** log2(tp)`` (each doubling of the TP degree loses a fixed
fraction to the all-reduces between layers; 1 at TP 1, 0.9 at TP 2, 0.81 at TP 4 by default)
and ``tp_scale(tp) = tp x tp_eff(tp)``. The peak is the GPU's FP8 rate for 1-byte weights where
it has FP8 tensor cores, its BF16 rate otherwise.

Prefill of ``n`` new tokens after ``c`` cached ones (FLOPs):

    2 x params x n                              every weight is one multiply-add per token
  + 2 x layers x hidden x n^2                   QK^T and PV over the causal triangle
  + 4 x layers x hidden x n x c                 the new tokens attending to the cached prefix

(QK^T and PV each cost 2 x hidden FLOPs per (query, key) pair per layer, with
hidden = query heads x head dim; a causal mask leaves n^2 / 2 pairs among the new tokens.)
Its memory floor is reading the weights once, which dominates only for a handful of tokens.

A decode step of ``b`` sequences holding ``C`` context tokens in total reads every weight once
and every sequence's KV once: bytes per rank = weights / tp + C x KV bytes per token per rank;
its compute floor is ``2 x params x b + 4 x layers x hidden x C`` FLOPs, which takes over at
large batches. Everything else (activations, sampling, kernel launch gaps, scheduling) is
folded into the efficiency factors.

Units: milliseconds for times, bytes for memory, tokens for lengths.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from hpd_common.gpus import GpuProfile
from hpd_common.kvformat import GIB, KvDtype, KvFormat, KvLayout

__all__ = [
    "MODELS",
    "Efficiency",
    "ModelSpec",
    "UnknownModelError",
    "decode_step_ms",
    "kv_bytes",
    "max_kv_tokens",
    "model_spec",
    "prefill_flops",
    "prefill_ms",
    "prefill_tokens_per_s",
    "tp_efficiency_factor",
]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The few architecture numbers a roofline needs.

    ``params_b`` is the parameter count in billions; ``hidden_size`` equals query heads x head
    dim for the models listed here (it sizes the attention FLOPs); ``weight_dtype_bytes`` is 2
    for bf16/fp16 weights and 1 for fp8 or int8 weights.
    """

    name: str
    params_b: float
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    weight_dtype_bytes: float = 2

    def __post_init__(self) -> None:
        for attr in (
            "params_b",
            "num_layers",
            "num_kv_heads",
            "head_dim",
            "hidden_size",
            "weight_dtype_bytes",
        ):
            value = getattr(self, attr)
            if not value > 0:
                raise ValueError(f"ModelSpec.{attr} must be positive, got {value!r}")

    @property
    def params(self) -> float:
        """Parameter count (params_b x 1e9)."""
        return self.params_b * 1e9

    def weight_bytes(self) -> float:
        """Bytes of weights for the whole model: params x weight_dtype_bytes."""
        return self.params * self.weight_dtype_bytes

    def kv_format(
        self,
        dtype: KvDtype = KvDtype.BF16,
        layout: KvLayout = KvLayout.PAGED_NHD,
        block_size_tokens: int = 16,
        tp_size: int = 1,
        attention_backend: str = "flash_attn",
        model_revision: str | None = None,
    ) -> KvFormat:
        """This model's KV format descriptor.

        ``model_revision`` defaults to the model's name, because two models with the same KV
        geometry (Llama-3-8B and Mistral-7B: 32 layers, 8 KV heads, head dim 128) must still
        never exchange KV.
        """
        return KvFormat(
            dtype=dtype,
            layout=layout,
            block_size_tokens=block_size_tokens,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            tp_size=tp_size,
            attention_backend=attention_backend,
            model_revision=self.name if model_revision is None else model_revision,
        )


def _models(*rows: ModelSpec) -> Mapping[str, ModelSpec]:
    return MappingProxyType({row.name: row for row in rows})


# Figures from each model's published config.json (num_hidden_layers, num_key_value_heads,
# hidden_size / num_attention_heads) and model card (parameter count).
MODELS: Mapping[str, ModelSpec] = _models(
    ModelSpec("llama-3-8b", 8.03, num_layers=32, num_kv_heads=8, head_dim=128, hidden_size=4096),
    ModelSpec("llama-3-70b", 70.6, num_layers=80, num_kv_heads=8, head_dim=128, hidden_size=8192),
    ModelSpec("mistral-7b", 7.24, num_layers=32, num_kv_heads=8, head_dim=128, hidden_size=4096),
    ModelSpec("qwen2.5-7b", 7.61, num_layers=28, num_kv_heads=4, head_dim=128, hidden_size=3584),
    ModelSpec("qwen2.5-32b", 32.5, num_layers=64, num_kv_heads=8, head_dim=128, hidden_size=5120),
)


class UnknownModelError(KeyError):
    """A model name not in :data:`MODELS`."""

    def __init__(self, name: str, known: tuple[str, ...]) -> None:
        super().__init__(name)
        self.name = name
        self.known = known

    def __str__(self) -> str:
        return f"unknown model {self.name!r}; known: {', '.join(self.known)}"


def model_spec(name: str) -> ModelSpec:
    """Look a model up by name, ignoring case and surrounding blanks."""
    spec = MODELS.get(name.strip().lower())
    if spec is None:
        raise UnknownModelError(name, tuple(sorted(MODELS)))
    return spec


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Fractions of the datasheet peaks that real kernels reach.

    ``prefill_mfu``: model FLOPs utilisation of the matmuls (also used for decode's compute
    floor); ``decode_mbu``: memory bandwidth utilisation of a decode step; ``tp_efficiency``:
    the fraction kept per doubling of the TP degree (see :func:`tp_efficiency_factor`).
    """

    prefill_mfu: float = 0.5
    decode_mbu: float = 0.7
    tp_efficiency: float = 0.9

    def __post_init__(self) -> None:
        for attr in ("prefill_mfu", "decode_mbu", "tp_efficiency"):
            value = getattr(self, attr)
            if not 0 < value <= 1:
                raise ValueError(f"Efficiency.{attr} must be in (0, 1], got {value!r}")


DEFAULT_EFFICIENCY = Efficiency()


def tp_efficiency_factor(tp: int, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Per-rank efficiency at TP degree ``tp``: tp_efficiency ** log2(tp) (1.0 at TP 1)."""
    _check_tp(tp)
    return float(eff.tp_efficiency ** math.log2(tp))


def _check_tp(tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")


def _compute_ms(flops: float, model: ModelSpec, gpu: GpuProfile, tp: int, eff: Efficiency) -> float:
    """FLOPs / (peak x 1e12 x MFU x tp x tp_eff), in ms."""
    rate = gpu.peak_tflops(model.weight_dtype_bytes) * 1e12 * eff.prefill_mfu
    return flops / (rate * tp * tp_efficiency_factor(tp, eff)) * 1e3


def _memory_ms(rank_bytes: float, gpu: GpuProfile, tp: int, eff: Efficiency) -> float:
    """Bytes one rank reads / (HBM x 1e9 x MBU x tp_eff), in ms."""
    rate = gpu.hbm_gbps * 1e9 * eff.decode_mbu * tp_efficiency_factor(tp, eff)
    return rank_bytes / rate * 1e3


def prefill_flops(model: ModelSpec, tokens: int, cached_tokens: int = 0) -> float:
    """FLOPs to prefill ``tokens`` new tokens after ``cached_tokens`` (module docstring)."""
    if tokens < 0 or cached_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got {tokens} and {cached_tokens}")
    n, c = float(tokens), float(cached_tokens)
    linear = 2.0 * model.params * n
    attention = 2.0 * model.num_layers * model.hidden_size * n * n
    prefix = 4.0 * model.num_layers * model.hidden_size * n * c
    return linear + attention + prefix


def prefill_ms(
    model: ModelSpec,
    gpu: GpuProfile,
    tp: int,
    tokens: int,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    cached_tokens: int = 0,
) -> float:
    """Prefill time in ms: max(FLOPs / effective compute, weights / effective bandwidth).

    0.0 for zero new tokens (nothing runs). Llama-3-8B on one H100-SXM, 1,024 tokens:
    (2 x 8.03e9 x 1024 + 2 x 32 x 4096 x 1024^2) / (989.5e12 x 0.5) = 33.80 ms.
    """
    _check_tp(tp)
    if tokens < 0 or cached_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got {tokens} and {cached_tokens}")
    if tokens == 0:
        return 0.0
    compute = _compute_ms(prefill_flops(model, tokens, cached_tokens), model, gpu, tp, eff)
    weights = _memory_ms(model.weight_bytes() / tp, gpu, tp, eff)
    return max(compute, weights)


def prefill_tokens_per_s(
    model: ModelSpec,
    gpu: GpuProfile,
    tp: int,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    ref_tokens: int = 1024,
) -> float:
    """Prefill throughput at a reference prompt length: ref_tokens / prefill_ms x 1000.

    The attention term makes throughput fall with prompt length, hence the reference length.
    """
    if ref_tokens < 1:
        raise ValueError(f"ref_tokens must be >= 1, got {ref_tokens}")
    return ref_tokens / prefill_ms(model, gpu, tp, ref_tokens, eff) * 1e3


def decode_step_ms(
    model: ModelSpec,
    gpu: GpuProfile,
    tp: int,
    batch_size: int,
    context_tokens_total: int,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    kv_dtype: KvDtype = KvDtype.BF16,
) -> float:
    """One decode step (one token for each of ``batch_size`` sequences), in ms.

    Memory: per rank, weights / tp + context_tokens_total x KV bytes per token per rank (with
    replicated KV heads at TP above the head count each rank reads a full head's KV); compute
    floor: 2 x params x batch + 4 x layers x hidden x context_tokens_total FLOPs; the larger
    wins. Llama-3-8B on one H100-SXM, batch 1, 1,024 context tokens:
    (16.06e9 + 1024 x 131072) B / (3350e9 x 0.7) B/s = 6.906 ms.
    """
    _check_tp(tp)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if context_tokens_total < 0:
        raise ValueError(f"context_tokens_total must be >= 0, got {context_tokens_total}")
    per_rank_kv = model.kv_format(kv_dtype, tp_size=tp).bytes_per_token_per_rank()
    rank_bytes = model.weight_bytes() / tp + float(context_tokens_total) * per_rank_kv
    memory = _memory_ms(rank_bytes, gpu, tp, eff)
    flops = 2.0 * model.params * batch_size + 4.0 * model.num_layers * model.hidden_size * float(
        context_tokens_total
    )
    compute = _compute_ms(flops, model, gpu, tp, eff)
    return max(memory, compute)


def kv_bytes(model: ModelSpec, tokens: int, dtype: KvDtype = KvDtype.BF16) -> int:
    """KV bytes of ``tokens`` tokens for the whole model (all ranks, no replication)."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    return tokens * model.kv_format(dtype).bytes_per_token()


def max_kv_tokens(
    model: ModelSpec,
    gpu: GpuProfile,
    tp: int,
    memory_fraction: float = 0.9,
    dtype: KvDtype = KvDtype.BF16,
) -> int:
    """Tokens of KV a worker of ``tp`` such GPUs can hold.

    Per rank: floor((hbm_gib x 2^30 x memory_fraction - weights / tp) / KV bytes per token per
    rank), 0 when the weights do not fit. ``memory_fraction`` is the share of each GPU the
    engine may use for weights and KV together (vLLM's gpu_memory_utilization); activations
    and graphs live in the rest.
    """
    _check_tp(tp)
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    budget = gpu.hbm_gib * GIB * memory_fraction - model.weight_bytes() / tp
    if budget <= 0:
        return 0
    per_rank = model.kv_format(dtype, tp_size=tp).bytes_per_token_per_rank()
    return int(budget // per_rank)
