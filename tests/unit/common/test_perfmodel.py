"""Roofline performance model against hand-computed values (arithmetic in the comments).

Profiles used: H100-SXM (989.5 dense BF16 TFLOP/s, 1,979 FP8, 3,350 GB/s, 80 GiB) and A100-80G
(312 TFLOP/s, no FP8, 2,039 GB/s, 80 GiB). Models: Llama-3-8B (8.03e9 params, 32 layers,
hidden 4096, 8 KV heads x 128, bf16 weights 16.06e9 B, KV 131,072 B/token) and Llama-3-70B
(70.6e9 params, 80 layers, hidden 8192, 8 KV heads x 128, weights 141.2e9 B, KV 327,680
B/token). Default efficiency: MFU 0.5, MBU 0.7, TP efficiency 0.9 per doubling
(TP 4 -> 0.81, TP 8 -> 0.729, TP 16 -> 0.6561).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpd_common.gpus import GPU_PROFILES, GpuProfile
from hpd_common.kvformat import KvDtype, Verdict, negotiate
from hpd_common.perfmodel import (
    MODELS,
    Efficiency,
    ModelSpec,
    UnknownModelError,
    decode_step_ms,
    kv_bytes,
    max_kv_tokens,
    model_spec,
    prefill_flops,
    prefill_ms,
    prefill_tokens_per_s,
    tp_efficiency_factor,
)

KIB = 1024
L8, L70 = MODELS["llama-3-8b"], MODELS["llama-3-70b"]
H100, A100 = GPU_PROFILES["H100-SXM"], GPU_PROFILES["A100-80G"]


# --- model table and KV sizes ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "layers", "kv_heads", "head_dim"),
    [
        pytest.param("llama-3-8b", 32, 8, 128, id="llama-3-8b"),
        pytest.param("llama-3-70b", 80, 8, 128, id="llama-3-70b"),
        pytest.param("qwen2.5-32b", 64, 8, 128, id="qwen2.5-32b"),
        pytest.param("mistral-7b", 32, 8, 128, id="mistral-7b"),
    ],
)
def test_model_geometry(name: str, layers: int, kv_heads: int, head_dim: int) -> None:
    spec = model_spec(name)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (layers, kv_heads, head_dim)


@pytest.mark.parametrize(
    ("model", "dtype", "per_token"),
    [
        pytest.param(L8, KvDtype.BF16, 128 * KIB, id="llama-3-8b-bf16-128KiB"),
        pytest.param(L70, KvDtype.BF16, 320 * KIB, id="llama-3-70b-bf16-320KiB"),
        pytest.param(L8, KvDtype.FP8_E4M3, 64 * KIB, id="llama-3-8b-fp8-64KiB"),
        pytest.param(L70, KvDtype.FP8_E4M3, 160 * KIB, id="llama-3-70b-fp8-160KiB"),
    ],
)
def test_kv_bytes_per_token(model: ModelSpec, dtype: KvDtype, per_token: int) -> None:
    assert model.kv_format(dtype).bytes_per_token() == per_token
    assert kv_bytes(model, 1000, dtype) == 1000 * per_token
    assert kv_bytes(model, 0, dtype) == 0


def test_kv_format_from_model() -> None:
    f = L70.kv_format(KvDtype.FP8_E4M3, block_size_tokens=32, tp_size=8)
    f.validate()
    assert (f.num_layers, f.num_kv_heads, f.head_dim, f.tp_size) == (80, 8, 128, 8)
    assert f.block_size_tokens == 32
    assert f.model_revision == "llama-3-70b"
    assert f.bytes_per_token_per_rank() == 20 * KIB  # 2 x 80 x 1 x 128 x 1


def test_same_kv_geometry_different_models_never_exchange_kv() -> None:
    # Llama-3-8B and Mistral-7B share 32 layers x 8 KV heads x 128; the revision tells them apart
    result = negotiate(L8.kv_format(), MODELS["mistral-7b"].kv_format())
    assert result.verdict is Verdict.INCOMPATIBLE
    assert result.reasons == ("model_revision_mismatch",)


def test_unknown_model() -> None:
    assert model_spec(" Llama-3-8B ") is L8
    with pytest.raises(KeyError) as info:
        model_spec("gpt-5")
    assert isinstance(info.value, UnknownModelError)
    assert "llama-3-8b" in str(info.value)


# --- prefill, hand-computed -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "gpu", "tp", "tokens", "expected_ms"),
    [
        # (2 x 8.03e9 x 1024 + 2 x 32 x 4096 x 1024^2) FLOPs = 1.64454e13 + 2.74878e11
        #   = 1.672032e13; / (989.5e12 x 0.5 = 4.9475e14 FLOP/s) = 33.7955 ms
        #   (weight floor 16.06e9 / (3350e9 x 0.7) = 6.85 ms is lower)
        pytest.param(L8, H100, 1, 1024, 33.795488, id="llama8b-h100-tp1-1k"),
        # same FLOPs / (312e12 x 0.5 = 1.56e14) = 107.1815 ms
        pytest.param(L8, A100, 1, 1024, 107.181525, id="llama8b-a100-tp1-1k"),
        # (2 x 70.6e9 x 2048 + 2 x 80 x 8192 x 2048^2) = 2.891776e14 + 5.497558e12
        #   = 2.946752e14; / (4.9475e14 x 4 x 0.81 = 1.602990e15) = 183.8284 ms
        pytest.param(L70, H100, 4, 2048, 183.828444, id="llama70b-h100-tp4-2k"),
        # 2.946752e14 / (1.56e14 x 8 x 0.729 = 9.09792e14) = 323.8929 ms
        pytest.param(L70, A100, 8, 2048, 323.892888, id="llama70b-a100-tp8-2k"),
        # 16 tokens: compute (2 x 70.6e9 x 16 + 2 x 80 x 8192 x 256) / 9.09792e14 = 2.48 ms,
        #   below the weight read: 141.2e9 / 8 B / (2039e9 x 0.7 x 0.729 B/s) = 16.9630 ms
        pytest.param(L70, A100, 8, 16, 16.962971, id="llama70b-a100-tp8-16-weight-floor"),
    ],
)
def test_prefill_ms_hand_computed(
    model: ModelSpec, gpu: GpuProfile, tp: int, tokens: int, expected_ms: float
) -> None:
    assert prefill_ms(model, gpu, tp, tokens) == pytest.approx(expected_ms, rel=1e-6)


def test_prefill_with_cached_prefix_hand_computed() -> None:
    # 512 new tokens after 1536 cached on H100, Llama-3-8B:
    # 2 x 8.03e9 x 512 + 2 x 32 x 4096 x 512^2 + 4 x 32 x 4096 x 512 x 1536
    #   = 8.22272e12 + 6.87195e10 + 4.12317e11 = 8.70376e12 FLOPs; / 4.9475e14 = 17.5922 ms
    assert prefill_ms(L8, H100, 1, 512, cached_tokens=1536) == pytest.approx(17.592231, rel=1e-6)
    assert prefill_flops(L8, 512, 1536) == pytest.approx(8.70376e12, rel=1e-5)


def test_fp8_weights_use_fp8_tensor_cores_where_present() -> None:
    fp8 = dataclasses.replace(L8, name="llama-3-8b-fp8", weight_dtype_bytes=1)
    # 1.672032e13 / (1979e12 x 0.5 = 9.895e14) = 16.8977 ms
    assert prefill_ms(fp8, H100, 1, 1024) == pytest.approx(16.897744, rel=1e-6)
    # the A100 has no FP8 tensor cores: same as bf16, 107.1815 ms
    assert prefill_ms(fp8, A100, 1, 1024) == pytest.approx(107.181525, rel=1e-6)


def test_prefill_tokens_per_s_hand_computed() -> None:
    # 1024 tokens / 33.795488 ms = 30,299.9 tokens/s
    assert prefill_tokens_per_s(L8, H100, 1) == pytest.approx(30299.902, rel=1e-6)
    # a longer reference prompt pays more attention per token: slower
    assert prefill_tokens_per_s(L8, H100, 1, ref_tokens=8192) < prefill_tokens_per_s(L8, H100, 1)


def test_prefill_of_nothing_takes_no_time() -> None:
    assert prefill_ms(L8, H100, 1, 0) == 0.0


# --- decode, hand-computed ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "gpu", "tp", "batch", "context", "expected_ms"),
    [
        # (16.06e9 + 1024 x 131072) B / (3350e9 x 0.7 = 2.345e12 B/s) = 6.9058 ms
        #   (compute (2 x 8.03e9 + 4 x 32 x 4096 x 1024) / 4.9475e14 = 0.034 ms)
        pytest.param(L8, H100, 1, 1, 1024, 6.905850, id="llama8b-h100-b1-1k"),
        # 64 x 2048 = 131072 context: (16.06e9 + 131072 x 131072 = 1.717987e10) B
        #   / (2039e9 x 0.7 = 1.4273e12) = 23.2886 ms (compute: 7.03 ms)
        pytest.param(L8, A100, 1, 64, 131072, 23.288635, id="llama8b-a100-b64-2k-each"),
        # per rank: 141.2e9 / 4 + 131072 x 81920 (2 KV heads of 8) = 4.603742e10 B
        #   / (2.345e12 x 0.81 = 1.899450e12) = 24.2372 ms (compute: 3.03 ms)
        pytest.param(L70, H100, 4, 32, 131072, 24.237236, id="llama70b-h100-tp4-b32-4k-each"),
        # compute floor: (2 x 8.03e9 x 512 + 4 x 32 x 4096 x 512) / 1.56e14 = 52.7115 ms,
        #   above memory (16.06e9 + 512 x 131072) / 1.4273e12 = 11.30 ms
        pytest.param(L8, A100, 1, 512, 512, 52.711464, id="llama8b-a100-b512-compute-floor"),
        # TP 16 over 8 KV heads: each rank holds a replicated head, 40,960 B/token:
        #   (141.2e9 / 16 + 65536 x 40960) / (2.345e12 x 0.6561 = 1.538555e12) = 7.4806 ms
        pytest.param(L70, H100, 16, 8, 65536, 7.480628, id="llama70b-h100-tp16-replicated"),
    ],
)
def test_decode_step_ms_hand_computed(
    model: ModelSpec, gpu: GpuProfile, tp: int, batch: int, context: int, expected_ms: float
) -> None:
    assert decode_step_ms(model, gpu, tp, batch, context) == pytest.approx(expected_ms, rel=1e-6)


def test_fp8_kv_reads_half_the_kv_bytes() -> None:
    # (16.06e9 + 131072 x 65536) / 1.4273e12 = (16.06e9 + 8.589935e9) / 1.4273e12 = 17.2703 ms
    got = decode_step_ms(L8, A100, 1, 64, 131072, kv_dtype=KvDtype.FP8_E4M3)
    assert got == pytest.approx(17.270325, rel=1e-6)


# --- capacity -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "gpu", "tp", "expected"),
    [
        # (80 x 2^30 x 0.9 = 77,309,411,328 - 16.06e9) / 131072 = 467,295.9 -> 467,295
        pytest.param(L8, H100, 1, 467_295, id="llama8b-h100"),
        # (24 x 2^30 x 0.9 - 16.06e9) / 131072 = 54,419.1 -> 54,419
        pytest.param(L8, GPU_PROFILES["L4"], 1, 54_419, id="llama8b-l4"),
        # 141.2e9 B of weights do not fit in 72 GiB
        pytest.param(L70, A100, 1, 0, id="llama70b-a100-does-not-fit"),
        # per rank: (77,309,411,328 - 141.2e9 / 4) / 81920 = 512,810.2 -> 512,810
        pytest.param(L70, A100, 4, 512_810, id="llama70b-a100-tp4"),
        # replicated heads: (77,309,411,328 - 141.2e9 / 16) / 40960 = 1,671,982.7
        pytest.param(L70, H100, 16, 1_671_982, id="llama70b-h100-tp16-replicated"),
    ],
)
def test_max_kv_tokens_hand_computed(
    model: ModelSpec, gpu: GpuProfile, tp: int, expected: int
) -> None:
    assert max_kv_tokens(model, gpu, tp) == expected


def test_fp8_kv_doubles_capacity() -> None:
    # (77,309,411,328 - 16.06e9) / 65536 = 934,591.8
    assert max_kv_tokens(L8, H100, 1, dtype=KvDtype.FP8_E4M3) == 934_591


# --- efficiency and input checks ------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "factor"),
    [
        pytest.param(1, 1.0, id="tp1"),
        pytest.param(2, 0.9, id="tp2"),
        pytest.param(4, 0.81, id="tp4"),
        pytest.param(8, 0.729, id="tp8"),
    ],
)
def test_tp_efficiency_factor(tp: int, factor: float) -> None:
    assert tp_efficiency_factor(tp) == pytest.approx(factor)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"prefill_mfu": 0.0}, id="mfu-zero"),
        pytest.param({"decode_mbu": 1.5}, id="mbu-above-one"),
        pytest.param({"tp_efficiency": -0.1}, id="tp-eff-negative"),
    ],
)
def test_efficiency_rejects_out_of_range(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Efficiency(**kwargs)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: prefill_ms(L8, H100, 0, 10), id="prefill-tp0"),
        pytest.param(lambda: prefill_ms(L8, H100, 1, -1), id="prefill-negative-tokens"),
        pytest.param(lambda: prefill_ms(L8, H100, 1, 5, cached_tokens=-1), id="prefill-neg-cache"),
        pytest.param(lambda: prefill_tokens_per_s(L8, H100, 1, ref_tokens=0), id="tps-ref-zero"),
        pytest.param(lambda: decode_step_ms(L8, H100, 1, 0, 10), id="decode-batch-zero"),
        pytest.param(lambda: decode_step_ms(L8, H100, 1, 1, -1), id="decode-negative-context"),
        pytest.param(lambda: kv_bytes(L8, -1), id="kv-bytes-negative"),
        pytest.param(lambda: max_kv_tokens(L8, H100, 1, memory_fraction=0), id="fraction-zero"),
        pytest.param(lambda: ModelSpec("x", 1.0, 0, 8, 128, 4096), id="model-zero-layers"),
    ],
)
def test_bad_input_raises_value_error(call: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        call()


# --- properties -----------------------------------------------------------------------------

models = st.sampled_from(list(MODELS.values()))
gpus = st.sampled_from(list(GPU_PROFILES.values()))
tps = st.sampled_from([1, 2, 4, 8, 16])
lengths = st.integers(1, 1 << 17)


@given(models, gpus, tps, lengths, lengths, st.integers(0, 1 << 16))
def test_prefill_positive_and_monotone_in_tokens(
    model: ModelSpec, gpu: GpuProfile, tp: int, a: int, b: int, cached: int
) -> None:
    lo, hi = min(a, b), max(a, b)
    t_lo = prefill_ms(model, gpu, tp, lo, cached_tokens=cached)
    assert 0 < t_lo <= prefill_ms(model, gpu, tp, hi, cached_tokens=cached)
    assert t_lo <= prefill_ms(model, gpu, tp, lo, cached_tokens=cached + 1)


@given(models, gpus, tps, st.integers(1, 1024), st.integers(1, 1024), st.integers(0, 1 << 20))
def test_decode_positive_and_monotone_in_batch(
    model: ModelSpec, gpu: GpuProfile, tp: int, a: int, b: int, context: int
) -> None:
    lo, hi = min(a, b), max(a, b)
    t_lo = decode_step_ms(model, gpu, tp, lo, context)
    assert 0 < t_lo <= decode_step_ms(model, gpu, tp, hi, context)


@given(models, gpus, tps, st.integers(1, 256), st.integers(0, 1 << 20), st.integers(1, 1 << 16))
def test_decode_strictly_increasing_in_context(
    model: ModelSpec, gpu: GpuProfile, tp: int, batch: int, context: int, more: int
) -> None:
    t = decode_step_ms(model, gpu, tp, batch, context)
    assert 0 < t < decode_step_ms(model, gpu, tp, batch, context + more)


@given(models, gpus, tps)
def test_capacity_never_negative_and_fp8_at_least_bf16(
    model: ModelSpec, gpu: GpuProfile, tp: int
) -> None:
    bf16 = max_kv_tokens(model, gpu, tp)
    assert 0 <= bf16 <= max_kv_tokens(model, gpu, tp, dtype=KvDtype.FP8_E4M3)
