"""KV format descriptors: sizes, validation, and the compatibility rules (one row per rule)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpd_common.kvformat import (
    GIB,
    MAX_BLOCK_SIZE_TOKENS,
    KvDtype,
    KvFormat,
    KvFormatError,
    KvLayout,
    KvPolicy,
    Negotiation,
    Reason,
    Verdict,
    across_models,
    negotiate,
)

KIB = 1024

# Llama-3-8B geometry: 32 layers, 8 KV heads, head dim 128.
BASE = KvFormat(
    dtype=KvDtype.BF16,
    layout=KvLayout.PAGED_NHD,
    block_size_tokens=16,
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    tp_size=1,
    attention_backend="flash_attn",
    model_revision="rev-a",
)
LOSSY = KvPolicy(allow_lossy_narrowing=True)
FA_FI = KvPolicy(compatible_backends=frozenset({frozenset({"flash_attn", "flashinfer"})}))


def fmt(**changes: Any) -> KvFormat:
    return dataclasses.replace(BASE, **changes)


# --- sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "dtype", "tp", "whole", "per_rank"),
    [
        # 2 x 32 x 8 x 128 x 2 = 131,072 B = 128 KiB
        pytest.param(32, KvDtype.BF16, 1, 128 * KIB, 128 * KIB, id="llama3-8b-bf16"),
        # 2 x 80 x 8 x 128 x 2 = 327,680 B = 320 KiB
        pytest.param(80, KvDtype.BF16, 1, 320 * KIB, 320 * KIB, id="llama3-70b-bf16"),
        # fp8 halves: 2 x 32 x 8 x 128 x 1 = 64 KiB, 2 x 80 x 8 x 128 x 1 = 160 KiB
        pytest.param(32, KvDtype.FP8_E4M3, 1, 64 * KIB, 64 * KIB, id="llama3-8b-fp8-e4m3"),
        pytest.param(80, KvDtype.FP8_E5M2, 1, 160 * KIB, 160 * KIB, id="llama3-70b-fp8-e5m2"),
        pytest.param(32, KvDtype.INT8, 1, 64 * KIB, 64 * KIB, id="llama3-8b-int8"),
        pytest.param(32, KvDtype.FP32, 1, 256 * KIB, 256 * KIB, id="llama3-8b-fp32"),
        # TP 2: 4 heads per rank: 2 x 32 x 4 x 128 x 2 = 64 KiB
        pytest.param(32, KvDtype.BF16, 2, 128 * KIB, 64 * KIB, id="llama3-8b-bf16-tp2"),
        # TP 8: 1 head per rank: 2 x 80 x 1 x 128 x 2 = 40 KiB
        pytest.param(80, KvDtype.BF16, 8, 320 * KIB, 40 * KIB, id="llama3-70b-bf16-tp8"),
        # TP 16 over 8 heads: replicated, still 1 head (40 KiB) per rank
        pytest.param(80, KvDtype.BF16, 16, 320 * KIB, 40 * KIB, id="llama3-70b-bf16-tp16-repl"),
        pytest.param(80, KvDtype.FP8_E4M3, 8, 160 * KIB, 20 * KIB, id="llama3-70b-fp8-tp8"),
    ],
)
def test_bytes_per_token(layers: int, dtype: KvDtype, tp: int, whole: int, per_rank: int) -> None:
    f = fmt(num_layers=layers, dtype=dtype, tp_size=tp)
    assert f.bytes_per_token() == whole
    assert f.bytes_per_token_per_rank() == per_rank


@pytest.mark.parametrize(
    ("dtype", "size"),
    [
        pytest.param(KvDtype.FP32, 4.0, id="fp32"),
        pytest.param(KvDtype.FP16, 2.0, id="fp16"),
        pytest.param(KvDtype.BF16, 2.0, id="bf16"),
        pytest.param(KvDtype.FP8_E4M3, 1.0, id="fp8_e4m3"),
        pytest.param(KvDtype.FP8_E5M2, 1.0, id="fp8_e5m2"),
        pytest.param(KvDtype.INT8, 1.0, id="int8"),
    ],
)
def test_dtype_bytes(dtype: KvDtype, size: float) -> None:
    assert dtype.bytes == size


def test_enum_values_are_the_wire_strings() -> None:
    assert [d.value for d in KvDtype] == ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8"]
    assert [v.value for v in KvLayout] == ["paged_nhd", "paged_hnd", "contiguous"]
    assert KvDtype("fp8_e4m3") is KvDtype.FP8_E4M3


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({}, id="base"),
        pytest.param({"block_size_tokens": 1}, id="block-1"),
        pytest.param({"block_size_tokens": MAX_BLOCK_SIZE_TOKENS}, id="block-max"),
        pytest.param({"tp_size": 8}, id="tp-equals-heads"),
        pytest.param({"tp_size": 16}, id="tp-replicates-heads-2x"),
        pytest.param({"tp_size": 32}, id="tp-replicates-heads-4x"),
        pytest.param({"model_revision": ""}, id="empty-revision-allowed"),
        pytest.param({"layout": KvLayout.CONTIGUOUS}, id="contiguous"),
    ],
)
def test_validate_accepts(changes: dict[str, Any]) -> None:
    fmt(**changes).validate()


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        pytest.param({"dtype": cast(KvDtype, "bfloat16")}, "dtype", id="dtype-unknown"),
        pytest.param({"layout": cast(KvLayout, "paged-v1")}, "layout", id="layout-unknown"),
        pytest.param({"block_size_tokens": 0}, "block_size_tokens", id="block-zero"),
        pytest.param({"block_size_tokens": -16}, "block_size_tokens", id="block-negative"),
        pytest.param({"block_size_tokens": 24}, "block_size_tokens", id="block-not-pow2"),
        pytest.param({"block_size_tokens": 2048}, "block_size_tokens", id="block-over-1024"),
        pytest.param({"num_layers": 0}, "num_layers", id="layers-zero"),
        pytest.param({"num_layers": True}, "num_layers", id="layers-bool"),
        pytest.param({"num_kv_heads": -8}, "num_kv_heads", id="heads-negative"),
        pytest.param({"head_dim": 0}, "head_dim", id="head-dim-zero"),
        pytest.param({"tp_size": 0}, "tp_size", id="tp-zero"),
        pytest.param({"tp_size": 3}, "tp_size", id="heads-not-divisible-by-tp"),
        pytest.param({"tp_size": 12}, "tp_size", id="tp-above-heads-not-multiple"),
        pytest.param({"attention_backend": ""}, "attention_backend", id="backend-empty"),
        pytest.param({"attention_backend": "  "}, "attention_backend", id="backend-blank"),
    ],
)
def test_validate_rejects_with_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(KvFormatError) as info:
        fmt(**changes).validate()
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert isinstance(info.value, ValueError)


def test_per_rank_bytes_with_zero_tp_raises_typed_error() -> None:
    with pytest.raises(KvFormatError) as info:
        fmt(tp_size=0).bytes_per_token_per_rank()
    assert info.value.field == "tp_size"


# --- negotiation: one row per rule and per conversion ---------------------------------------

NO = Verdict.INCOMPATIBLE
CV = Verdict.CONVERTIBLE
OK = Verdict.COMPATIBLE
NHD, HND, CONT = KvLayout.PAGED_NHD, KvLayout.PAGED_HND, KvLayout.CONTIGUOUS


@pytest.mark.parametrize(
    ("src", "dst", "policy", "verdict", "reasons", "kinds"),
    [
        pytest.param({}, {}, KvPolicy(), OK, (), (), id="identical"),
        # rule 1: model identity
        pytest.param(
            {}, {"model_revision": "rev-b"}, KvPolicy(), NO, ("model_revision_mismatch",), (),
            id="model-revision",
        ),
        pytest.param(
            {"model_revision": ""}, {}, KvPolicy(), NO, ("model_revision_mismatch",), (),
            id="model-revision-unset-vs-set",
        ),
        pytest.param({}, {"num_layers": 80}, KvPolicy(), NO, ("num_layers_mismatch",), (),
                     id="num-layers"),
        pytest.param({}, {"num_kv_heads": 4}, KvPolicy(), NO, ("kv_heads_mismatch",), (),
                     id="kv-heads"),
        pytest.param({}, {"head_dim": 64}, KvPolicy(), NO, ("head_dim_mismatch",), (),
                     id="head-dim"),
        # rule 2: dtype casts; widening is exact and always allowed
        pytest.param({"dtype": KvDtype.FP8_E4M3}, {}, KvPolicy(), CV, ("kv_dtype_mismatch",),
                     ("dtype_cast",), id="cast-fp8e4m3-to-bf16-widening"),
        pytest.param({"dtype": KvDtype.FP8_E5M2}, {"dtype": KvDtype.FP16}, KvPolicy(), CV,
                     ("kv_dtype_mismatch",), ("dtype_cast",), id="cast-fp8e5m2-to-fp16-widening"),
        pytest.param({"dtype": KvDtype.INT8}, {}, KvPolicy(), CV, ("kv_dtype_mismatch",),
                     ("dtype_cast",), id="cast-int8-to-bf16-widening"),
        pytest.param({}, {"dtype": KvDtype.FP32}, KvPolicy(), CV, ("kv_dtype_mismatch",),
                     ("dtype_cast",), id="cast-bf16-to-fp32-widening"),
        pytest.param({"dtype": KvDtype.FP16}, {"dtype": KvDtype.FP32}, KvPolicy(), CV,
                     ("kv_dtype_mismatch",), ("dtype_cast",), id="cast-fp16-to-fp32-widening"),
        # rule 2: lossy casts need the policy
        pytest.param({}, {"dtype": KvDtype.FP8_E4M3}, KvPolicy(), NO,
                     ("kv_dtype_narrowing_not_allowed",), (), id="narrow-bf16-to-fp8-refused"),
        pytest.param({}, {"dtype": KvDtype.FP8_E4M3}, LOSSY, CV, ("kv_dtype_mismatch",),
                     ("dtype_cast",), id="narrow-bf16-to-fp8-allowed"),
        pytest.param({"dtype": KvDtype.FP32}, {}, KvPolicy(), NO,
                     ("kv_dtype_narrowing_not_allowed",), (), id="narrow-fp32-to-bf16-refused"),
        pytest.param({}, {"dtype": KvDtype.FP16}, KvPolicy(), NO,
                     ("kv_dtype_narrowing_not_allowed",), (), id="same-width-bf16-to-fp16-refused"),
        pytest.param({"dtype": KvDtype.FP16}, {}, LOSSY, CV, ("kv_dtype_mismatch",),
                     ("dtype_cast",), id="same-width-fp16-to-bf16-allowed"),
        pytest.param({"dtype": KvDtype.FP8_E4M3}, {"dtype": KvDtype.FP8_E5M2}, KvPolicy(), NO,
                     ("kv_dtype_narrowing_not_allowed",), (), id="same-width-fp8-variants-refused"),
        # rule 3: layout
        pytest.param({}, {"layout": HND}, KvPolicy(), CV, ("kv_layout_mismatch",),
                     ("layout_permute",), id="permute-nhd-to-hnd"),
        pytest.param({"layout": HND}, {}, KvPolicy(), CV, ("kv_layout_mismatch",),
                     ("layout_permute",), id="permute-hnd-to-nhd"),
        pytest.param({}, {"layout": CONT}, KvPolicy(), CV, ("kv_layout_mismatch",),
                     ("layout_repack",), id="repack-paged-to-contiguous"),
        pytest.param({"layout": CONT}, {"layout": HND}, KvPolicy(), CV, ("kv_layout_mismatch",),
                     ("layout_repack",), id="repack-contiguous-to-paged"),
        # rule 4: block size (ignored when a side is contiguous)
        pytest.param({}, {"block_size_tokens": 32}, KvPolicy(), CV, ("block_size_mismatch",),
                     ("block_regroup",), id="regroup-16-into-32"),
        pytest.param({"block_size_tokens": 64}, {}, KvPolicy(), CV, ("block_size_mismatch",),
                     ("block_regroup",), id="regroup-64-into-16"),
        pytest.param({"block_size_tokens": 24}, {}, KvPolicy(), NO, ("block_size_mismatch",), (),
                     id="block-24-vs-16-unvalidated-no-divisor"),
        pytest.param({"layout": CONT, "block_size_tokens": 64}, {"layout": CONT}, KvPolicy(), OK,
                     (), (), id="contiguous-both-block-ignored"),
        pytest.param({"layout": CONT, "block_size_tokens": 64}, {}, KvPolicy(), CV,
                     ("kv_layout_mismatch",), ("layout_repack",),
                     id="contiguous-src-block-ignored"),
        # rule 5: tensor parallelism
        pytest.param({}, {"tp_size": 2}, KvPolicy(), CV, ("tp_size_mismatch",), ("tp_reshard",),
                     id="reshard-tp1-to-tp2"),
        pytest.param({"tp_size": 8}, {"tp_size": 16}, KvPolicy(), CV, ("tp_size_mismatch",),
                     ("tp_reshard",), id="reshard-tp8-to-tp16-replicated"),
        pytest.param({"tp_size": 3}, {}, KvPolicy(), NO, ("tp_size_mismatch",), (),
                     id="tp3-over-8-heads-unvalidated-uneven"),
        # rule 6: attention backend
        pytest.param({}, {"attention_backend": "flashinfer"}, KvPolicy(), NO,
                     ("attention_backend_mismatch",), (), id="backend-differs"),
        pytest.param({}, {"attention_backend": "flashinfer"}, FA_FI, OK, (), (),
                     id="backend-declared-compatible"),
        pytest.param({"attention_backend": "triton"}, {"attention_backend": "flashinfer"}, FA_FI,
                     NO, ("attention_backend_mismatch",), (), id="backend-outside-declared-group"),
        # several at once: every conversion listed in rule order, one step per reason
        pytest.param(
            {"dtype": KvDtype.FP8_E4M3, "layout": HND, "block_size_tokens": 32, "tp_size": 2},
            {"tp_size": 4},
            KvPolicy(),
            CV,
            ("kv_dtype_mismatch", "kv_layout_mismatch", "block_size_mismatch", "tp_size_mismatch"),
            ("dtype_cast", "layout_permute", "block_regroup", "tp_reshard"),
            id="four-conversions",
        ),
        # several failures: every failure listed; convertible differences are not reasons then
        pytest.param(
            {"layout": HND},
            {"model_revision": "rev-b", "num_layers": 80, "dtype": KvDtype.FP8_E4M3,
             "attention_backend": "flashinfer"},
            KvPolicy(),
            NO,
            ("model_revision_mismatch", "num_layers_mismatch", "kv_dtype_narrowing_not_allowed",
             "attention_backend_mismatch"),
            (),
            id="four-failures-one-conversion",
        ),
    ],
)  # fmt: skip
def test_negotiation_rules(
    src: dict[str, Any],
    dst: dict[str, Any],
    policy: KvPolicy,
    verdict: Verdict,
    reasons: tuple[str, ...],
    kinds: tuple[str, ...],
) -> None:
    result = negotiate(fmt(**src), fmt(**dst), policy)
    assert result.verdict is verdict
    assert result.reasons == reasons
    assert tuple(step.kind for step in result.steps) == kinds
    assert len(result.details) == len(result.reasons)


@pytest.mark.parametrize(
    ("src", "dst", "lossy"),
    [
        pytest.param(KvDtype.FP8_E4M3, KvDtype.BF16, False, id="widening-exact"),
        pytest.param(KvDtype.BF16, KvDtype.FP8_E4M3, True, id="narrowing-lossy"),
        pytest.param(KvDtype.BF16, KvDtype.FP16, True, id="same-width-lossy"),
    ],
)
def test_cast_step_marks_lossy(src: KvDtype, dst: KvDtype, lossy: bool) -> None:
    result = negotiate(fmt(dtype=src), fmt(dtype=dst), LOSSY)
    (step,) = result.steps
    assert step.lossy is lossy
    assert f"{src} -> {dst}" in step.detail


def test_reshard_detail_names_heads_per_rank() -> None:
    (step,) = negotiate(fmt(tp_size=2), fmt(tp_size=8)).steps
    assert "TP 2 to TP 8" in step.detail
    assert "4 -> 1 heads per rank" in step.detail


def test_reason_codes_are_stable_strings() -> None:
    assert {r.value for r in Reason} == {
        "model_mismatch",
        "model_revision_mismatch",
        "num_layers_mismatch",
        "kv_heads_mismatch",
        "head_dim_mismatch",
        "kv_dtype_mismatch",
        "kv_dtype_narrowing_not_allowed",
        "kv_layout_mismatch",
        "block_size_mismatch",
        "tp_size_mismatch",
        "attention_backend_mismatch",
    }
    result = negotiate(BASE, fmt(head_dim=64))
    assert type(result.reasons[0]) is str


def test_across_models_leads_with_model_mismatch_and_keeps_only_blocking_reasons() -> None:
    same = across_models(negotiate(BASE, BASE), "llama-3-8b", "mistral-7b")
    assert (same.verdict, same.reasons, same.steps) == (
        Verdict.INCOMPATIBLE,
        ("model_mismatch",),
        (),
    )
    assert same.details == ("model_id differs: 'llama-3-8b' vs 'mistral-7b'",)
    assert type(same.reasons[0]) is str
    convertible = across_models(negotiate(BASE, fmt(layout=HND)), "a", "b")
    assert convertible.reasons == ("model_mismatch",) and convertible.steps == ()
    blocked = across_models(negotiate(BASE, fmt(head_dim=64)), "a", "b")
    assert blocked.reasons == ("model_mismatch", "head_dim_mismatch")
    assert len(blocked.details) == 2


# --- conversion cost ------------------------------------------------------------------------


def test_conversion_ms_sums_step_costs_per_gib() -> None:
    # cast 2.0 ms/GiB + permute 3.0 ms/GiB = 5.0 ms/GiB; 2 GiB -> 10.0 ms
    result = negotiate(fmt(dtype=KvDtype.FP8_E4M3), fmt(layout=HND))
    assert result.verdict is Verdict.CONVERTIBLE
    assert result.cost_ms_per_gib == pytest.approx(5.0)
    assert result.conversion_ms(2 * GIB) == pytest.approx(10.0)


def test_conversion_ms_uses_policy_constants() -> None:
    # regroup 0.5 + reshard 7.5 = 8 ms/GiB; 512 MiB -> 4.0 ms
    policy = KvPolicy(block_regroup_ms_per_gib=0.5, tp_reshard_ms_per_gib=7.5)
    result = negotiate(fmt(block_size_tokens=32), fmt(tp_size=4), policy)
    assert result.conversion_ms(GIB // 2) == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        pytest.param({}, {}, 0.0, id="compatible-free"),
        pytest.param({}, {"head_dim": 64}, math.inf, id="incompatible-infinite"),
    ],
)
def test_conversion_ms_edges(src: dict[str, Any], dst: dict[str, Any], expected: float) -> None:
    assert negotiate(fmt(**src), fmt(**dst)).conversion_ms(GIB) == expected


def test_conversion_ms_rejects_negative_bytes() -> None:
    with pytest.raises(ValueError, match="kv_bytes"):
        Negotiation(Verdict.COMPATIBLE).conversion_ms(-1)


@pytest.mark.parametrize(
    "field", ["dtype_cast_ms_per_gib", "tp_reshard_ms_per_gib", "layout_permute_ms_per_gib"]
)
@pytest.mark.parametrize(
    "value", [pytest.param(-1.0, id="negative"), pytest.param(math.nan, id="nan")]
)
def test_policy_rejects_bad_costs(field: str, value: float) -> None:
    kwargs: dict[str, Any] = {field: value}
    with pytest.raises(ValueError, match=field):
        KvPolicy(**kwargs)


# --- properties -----------------------------------------------------------------------------

# Small value sets so that random pairs often share a geometry and reach every rule.
_heads = st.sampled_from([4, 8])
_geometry = st.tuples(_heads, st.sampled_from([1, 2, 4, 8, 16]))  # every TP is valid for 4 and 8

valid_formats = st.builds(
    lambda dtype, layout, block_log2, layers, head_dim, heads_tp, backend, revision: KvFormat(
        dtype=dtype,
        layout=layout,
        block_size_tokens=1 << block_log2,
        num_layers=layers,
        num_kv_heads=heads_tp[0],
        head_dim=head_dim,
        tp_size=heads_tp[1],
        attention_backend=backend,
        model_revision=revision,
    ),
    st.sampled_from(list(KvDtype)),
    st.sampled_from(list(KvLayout)),
    st.integers(0, 10),
    st.sampled_from([32, 80]),
    st.sampled_from([64, 128]),
    _geometry,
    st.sampled_from(["flash_attn", "flashinfer"]),
    st.sampled_from(["", "rev-a"]),
)
policies = st.builds(
    KvPolicy,
    allow_lossy_narrowing=st.booleans(),
    compatible_backends=st.sampled_from(
        [frozenset(), frozenset({frozenset({"flash_attn", "flashinfer"})})]
    ),
)
REASON_CODES = {r.value for r in Reason}


@given(valid_formats)
def test_strategy_yields_valid_formats(a: KvFormat) -> None:
    a.validate()


@given(valid_formats, policies)
def test_self_negotiation_is_compatible(a: KvFormat, policy: KvPolicy) -> None:
    result = negotiate(a, a, policy)
    assert result.verdict is Verdict.COMPATIBLE
    assert result.reasons == ()
    assert result.steps == ()
    assert result.conversion_ms(GIB) == 0.0


@given(valid_formats, valid_formats, policies, st.integers(0, 1 << 40))
def test_negotiation_invariants(a: KvFormat, b: KvFormat, policy: KvPolicy, nbytes: int) -> None:
    result = negotiate(a, b, policy)  # never raises for valid inputs
    assert set(result.reasons) <= REASON_CODES
    assert len(result.details) == len(result.reasons)
    cost = result.conversion_ms(nbytes)
    assert cost >= 0
    if result.verdict is Verdict.INCOMPATIBLE:
        assert result.reasons
        assert result.steps == ()
    elif result.verdict is Verdict.CONVERTIBLE:
        assert result.reasons
        assert len(result.steps) == len(result.reasons)
        assert all(step.cost_ms_per_gib >= 0 for step in result.steps)
    else:
        assert result.reasons == ()
        assert cost == 0.0


@given(valid_formats, valid_formats)
def test_allowing_lossy_casts_never_makes_a_pair_worse(a: KvFormat, b: KvFormat) -> None:
    strict = negotiate(a, b, KvPolicy())
    lenient = negotiate(a, b, LOSSY)
    refused = "kv_dtype_narrowing_not_allowed"
    if refused not in strict.reasons:
        assert lenient == strict
    else:
        assert refused not in lenient.reasons
        if strict.reasons == (refused,):
            assert lenient.verdict is Verdict.CONVERTIBLE


@given(valid_formats, valid_formats)
def test_structural_rules_are_symmetric(a: KvFormat, b: KvFormat) -> None:
    # With equal dtypes nothing direction-dependent remains: a -> b works iff b -> a works.
    b = dataclasses.replace(b, dtype=a.dtype)
    forward, backward = negotiate(a, b), negotiate(b, a)
    assert forward.verdict is backward.verdict
    assert forward.reasons == backward.reasons


@given(valid_formats)
def test_per_rank_share_covers_the_model(a: KvFormat) -> None:
    per_rank = a.bytes_per_token_per_rank()
    assert per_rank * a.tp_size >= a.bytes_per_token()
    if a.num_kv_heads % a.tp_size == 0:
        assert per_rank * a.tp_size == a.bytes_per_token()
