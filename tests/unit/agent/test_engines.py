"""Engine adapters: what every engine shares (KV dtype from sizes, metric parsing, picking
the adapter) and the mends these tests found."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hpd_agent.engines import (
    ADAPTERS,
    EngineError,
    SglangAdapter,
    VllmAdapter,
    adapter_for,
    kv_dtype_from_bytes,
    parse_metrics,
)
from hpd_agent.model_config import geometry_from_config, model_size_from_config
from hpd_common.kvformat import KvDtype
from tests.unit.agent.recorded import (
    DECODE,
    MALFORMED,
    TINY,
    TINY_KV_BYTES,
    read,
    sglang_answers,
    vllm_answers,
    without_lines,
)

# -- kv_dtype_from_bytes ---------------------------------------------------------------------

DTYPES_FROM_BYTES = [
    pytest.param(2.0, "auto", "bfloat16", KvDtype.BF16, id="2B-auto-bf16-model"),
    pytest.param(2.0, "auto", "float16", KvDtype.FP16, id="2B-auto-fp16-model"),
    pytest.param(2.0, "auto", "half", KvDtype.FP16, id="2B-auto-half-model"),
    pytest.param(2.0, "auto", "BFloat16", KvDtype.BF16, id="2B-model-dtype-any-case"),
    pytest.param(2.0, "auto", "", KvDtype.BF16, id="2B-no-model-dtype-is-bf16"),
    pytest.param(2.0, "fp16", "bfloat16", KvDtype.FP16, id="2B-named-fp16-wins-over-model"),
    pytest.param(2.0, "", "float16", KvDtype.FP16, id="2B-empty-cache-dtype"),
    pytest.param(4.0, "auto", "bfloat16", KvDtype.FP32, id="4B-is-fp32-whatever-the-model"),
    pytest.param(4.0, "float32", "float32", KvDtype.FP32, id="4B-named-fp32"),
    pytest.param(1.0, "fp8", "bfloat16", KvDtype.FP8_E4M3, id="1B-fp8"),
    pytest.param(1.0, "fp8_e4m3", "bfloat16", KvDtype.FP8_E4M3, id="1B-fp8-e4m3"),
    pytest.param(1.0, "FP8_E5M2", "bfloat16", KvDtype.FP8_E5M2, id="1B-fp8-e5m2-any-case"),
    pytest.param(1.0, "int8", "bfloat16", KvDtype.INT8, id="1B-int8"),
    pytest.param(1.0, "auto", "bfloat16", KvDtype.FP8_E4M3, id="1B-unnamed-is-fp8-e4m3"),
    pytest.param(1.98, "auto", "bfloat16", KvDtype.BF16, id="2B-rounded-to-a-quarter"),
    pytest.param(2.1, "auto", "bfloat16", KvDtype.BF16, id="2B-padding-rounds-down"),
]


@pytest.mark.parametrize(
    ("elem_bytes", "cache_dtype", "model_dtype", "expected"), DTYPES_FROM_BYTES
)
def test_kv_dtype_from_bytes(
    elem_bytes: float, cache_dtype: str, model_dtype: str, expected: KvDtype
) -> None:
    assert kv_dtype_from_bytes(elem_bytes, cache_dtype, model_dtype) is expected


@pytest.mark.parametrize(
    "elem_bytes",
    [
        pytest.param(0.0, id="0B"),
        pytest.param(0.5, id="half-byte"),
        pytest.param(1.5, id="1.5B"),
        pytest.param(1.25, id="1.25B"),
        pytest.param(3.0, id="3B"),
        pytest.param(6.0, id="6B"),
        pytest.param(8.0, id="8B"),
    ],
)
def test_width_that_fits_no_dtype_raises(elem_bytes: float) -> None:
    with pytest.raises(EngineError) as err:
        kv_dtype_from_bytes(elem_bytes, "auto", "bfloat16")
    assert err.value.source == "cache_config_info"


# -- parse_metrics ---------------------------------------------------------------------------


def test_parse_metrics_reads_every_sample_of_a_recorded_scrape() -> None:
    series = parse_metrics(DECODE)
    names = {s.name for s in series}
    assert {"vllm:num_requests_running", "vllm:prefix_cache_queries_total"} <= names
    running = [s for s in series if s.name == "vllm:num_requests_running"]
    assert [(dict(s.labels), s.value) for s in running] == [
        ({"engine": "0", "model_name": "tiny"}, 0.0)
    ]


def test_parse_metrics_handles_escapes_and_comments() -> None:
    text = (
        "# HELP x_total A counter.\n"
        "# TYPE x_total counter\n"
        'x_total{path="/a\\"b",note="line\\nbreak"} 3\n'
        "y 1.5e+03\n"
    )
    series = parse_metrics(text)
    assert [(s.name, dict(s.labels), s.value) for s in series] == [
        ("x_total", {"path": '/a"b', "note": "line\nbreak"}, 3.0),
        ("y", {}, 1500.0),
    ]


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("# HELP x y\n# TYPE x gauge\n", id="only-comments"),
    ],
)
def test_parse_metrics_of_no_samples_is_empty(text: str) -> None:
    assert parse_metrics(text) == []


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_metrics_raise_naming_the_source(text: str) -> None:
    with pytest.raises(EngineError) as err:
        parse_metrics(text, source="/custom-metrics")
    assert err.value.source == "/custom-metrics"
    assert "Prometheus" in err.value.message


# -- adapter_for -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kind", "info_paths"),
    [
        pytest.param("vllm", VllmAdapter, ("/v1/models", "/version", "/metrics"), id="vllm"),
        pytest.param(
            "sglang", SglangAdapter, ("/v1/models", "/get_server_info", "/metrics"), id="sglang"
        ),
    ],
)
def test_adapter_for_a_known_engine(name: str, kind: type, info_paths: tuple[str, ...]) -> None:
    adapter = adapter_for(name)
    assert isinstance(adapter, kind)
    assert adapter is ADAPTERS[name]
    assert adapter.name == name
    assert adapter.info_paths == info_paths
    assert (adapter.metrics_path, adapter.health_path) == ("/metrics", "/health")


@pytest.mark.parametrize(
    "name",
    [pytest.param("trtllm", id="unknown"), pytest.param("VLLM", id="wrong-case")],
)
def test_adapter_for_an_unknown_engine_names_the_known_ones(name: str) -> None:
    with pytest.raises(ValueError, match="known: sglang, vllm"):
        adapter_for(name)


# -- mends found by these tests ---------------------------------------------------------------


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
@pytest.mark.parametrize(
    "gauge", ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
)
def test_vllm_non_finite_gauge_raises_instead_of_crashing(gauge: str, value: str) -> None:
    text = f'{gauge}{{engine="0",model_name="tiny"}} {value}\n'
    base = without_lines(read("vllm", "metrics_decode.txt"), gauge + "{")
    with pytest.raises(EngineError, match="not a finite number"):
        VllmAdapter().sample(base + text)


def test_vllm_kv_usage_of_data_parallel_ranks_is_their_mean() -> None:
    text = (
        'vllm:num_requests_running{engine="0",model_name="tiny"} 1.0\n'
        'vllm:num_requests_running{engine="1",model_name="tiny"} 2.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.6\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.7\n'
    )
    sample = VllmAdapter().sample(text)
    assert sample.running == 3
    assert sample.kv_usage == pytest.approx(0.65)


def test_vllm_blocks_and_bytes_of_data_parallel_ranks_add_up() -> None:
    text = read("vllm", "metrics_decode.txt")
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{"))
    second = line.replace('engine="0"', 'engine="1"')
    facts = VllmAdapter().facts(vllm_answers(text + second + "\n"), TINY)
    assert facts.kv_blocks_total == 2 * 16384
    assert facts.kv_memory_bytes == 2 * TINY_KV_BYTES
    assert facts.kv_dtype is KvDtype.BF16


@pytest.mark.parametrize("value", [0, False])
def test_zero_kv_heads_raises_instead_of_meaning_no_gqa(value: object) -> None:
    cfg = json.loads(read("vllm", "model_config.json"))
    cfg["num_key_value_heads"] = value
    with pytest.raises(EngineError, match="num_key_value_heads"):
        geometry_from_config(json.dumps(cfg))


def test_a_scrape_cut_inside_a_number_is_refused() -> None:
    text = read("vllm", "metrics_decode.txt")
    cut = text[: text.index("vllm:prefix_cache_hits_total{")]
    cut += 'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 25'
    with pytest.raises(EngineError, match="truncated"):
        VllmAdapter().sample(cut)


def test_sglang_page_size_zero_raises() -> None:
    info = json.loads(read("sglang", "get_server_info.json"))
    info["page_size"] = 0
    with pytest.raises(EngineError, match="page_size"):
        SglangAdapter().facts(sglang_answers(json.dumps(info)), TINY)


LLAMA_3_8B = {
    "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "tie_word_embeddings": False,
}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "params", "width"),
    [
        pytest.param(LLAMA_3_8B, 8.03e9, 4096, id="llama-3-8b-is-8b"),
        pytest.param(
            {
                **LLAMA_3_8B,
                "num_hidden_layers": 2,
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 48,
                "vocab_size": 1024,
            },
            2 * (2 * 192 * 128 + 2 * 2 * 48 * 128 + 3 * 128 * 256) + 2 * 1024 * 128,
            192,
            id="the-real-engine-stages-tiny-model",
        ),
        pytest.param(
            {**LLAMA_3_8B, "tie_word_embeddings": True},
            8.03e9 - 128256 * 4096,
            4096,
            id="tied-embeddings-counted-once",
        ),
        pytest.param(
            {**LLAMA_3_8B, "num_local_experts": 8, "num_experts_per_tok": 2},
            8.03e9 + 32 * 3 * 4096 * 14336,
            4096,
            id="moe-counts-the-experts-a-token-goes-through",
        ),
        pytest.param({"text_config": LLAMA_3_8B}, 8.03e9, 4096, id="multimodal-text-config"),
    ],
)
def test_model_size_from_config(config: dict[str, Any], params: float, width: int) -> None:
    got = model_size_from_config(json.dumps(config))
    assert got is not None
    assert got[0] == pytest.approx(params, rel=0.005) and got[1] == width


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[1, 2]",
        json.dumps({"hidden_size": 4096}),
        json.dumps({**LLAMA_3_8B, "hidden_size": -1}),
    ],
)
def test_model_size_of_an_incomplete_config_is_none(text: str) -> None:
    assert model_size_from_config(text) is None
