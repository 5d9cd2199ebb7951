"""Engine adapters: facts and samples read from recorded vLLM and SGLang answers."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from hpd_agent.engines import (
    ADAPTERS,
    EngineError,
    EngineFacts,
    SglangAdapter,
    VllmAdapter,
    adapter_for,
    kv_dtype_from_bytes,
    parse_metrics,
)
from hpd_agent.model_config import ModelGeometry, geometry_from_config, model_size_from_config
from hpd_common.kvformat import KvDtype, KvLayout
from tests.unit.agent.recorded import (
    TINY,
    TINY_ELEMENTS_PER_TOKEN,
    TINY_KV_BYTES,
    TINY_KV_TOKENS,
    read,
    sglang_answers,
    up_to,
    vllm_answers,
    with_cache_labels,
    without_lines,
)

VLLM = VllmAdapter()
SGLANG = SglangAdapter()
IDLE = read("vllm", "metrics_prefill_idle.txt")
DECODE = read("vllm", "metrics_decode.txt")
GAUGES = (
    "vllm:num_requests_running{",
    "vllm:num_requests_waiting{",
    "vllm:kv_cache_usage_perc{",
)


def vllm_gauges(running: str = "0", waiting: str = "0", usage: str = "0") -> str:
    return (
        f"vllm:num_requests_running {running}\n"
        f"vllm:num_requests_waiting {waiting}\n"
        f"vllm:kv_cache_usage_perc {usage}\n"
    )


def sglang_gauges(running: str = "0", waiting: str = "0", usage: str = "0") -> str:
    return (
        f"sglang:num_running_reqs {running}\n"
        f"sglang:num_queue_reqs {waiting}\n"
        f"sglang:token_usage {usage}\n"
    )


# -- geometry_from_config --------------------------------------------------------------------


def test_geometry_of_the_recorded_model_config() -> None:
    assert geometry_from_config(read("vllm", "model_config.json")) == TINY


GEOMETRIES = [
    pytest.param(
        {
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 4096,
            "torch_dtype": "bfloat16",
        },
        ModelGeometry(32, 8, 128, "bfloat16"),
        id="gqa-llama3-8b",
    ),
    pytest.param(
        {"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768},
        ModelGeometry(12, 12, 64, ""),
        id="no-kv-heads-falls-back-to-heads",
    ),
    pytest.param(
        {
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "num_key_value_heads": None,
            "hidden_size": 768,
        },
        ModelGeometry(12, 12, 64, ""),
        id="null-kv-heads-falls-back-to-heads",
    ),
    pytest.param(
        {
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "hidden_size": 1024,
            "torch_dtype": "float16",
        },
        ModelGeometry(4, 2, 128, "float16"),
        id="no-head-dim-is-hidden-over-heads",
    ),
    pytest.param(
        {
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "hidden_size": 1024,
            "head_dim": 256,
        },
        ModelGeometry(4, 2, 256, ""),
        id="explicit-head-dim-wins-over-hidden",
    ),
    pytest.param(
        {
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "hidden_size": 1024,
            "head_dim": None,
        },
        ModelGeometry(4, 8, 128, ""),
        id="null-head-dim-is-hidden-over-heads",
    ),
    pytest.param(
        {
            "architectures": ["LlavaForConditionalGeneration"],
            "torch_dtype": "bfloat16",
            "text_config": {
                "num_hidden_layers": 40,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "hidden_size": 5120,
                "head_dim": 128,
            },
        },
        ModelGeometry(40, 8, 128, "bfloat16"),
        id="multimodal-text-config",
    ),
    pytest.param(
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "head_dim": 32,
            "text_config": {"num_hidden_layers": 99, "num_attention_heads": 99},
        },
        ModelGeometry(2, 4, 32, ""),
        id="top-level-layers-win-over-text-config",
    ),
    pytest.param(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32, "dtype": "float32"},
        ModelGeometry(2, 4, 32, "float32"),
        id="newer-dtype-key",
    ),
]


@pytest.mark.parametrize(("config", "expected"), GEOMETRIES)
def test_geometry_from_config(config: dict[str, Any], expected: ModelGeometry) -> None:
    assert geometry_from_config(json.dumps(config)) == expected


BASE_CONFIG: dict[str, Any] = {
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 128,
}

BAD_CONFIGS = [
    pytest.param({"num_hidden_layers": 0}, "num_hidden_layers", id="layers-zero"),
    pytest.param({"num_hidden_layers": -2}, "num_hidden_layers", id="layers-negative"),
    pytest.param({"num_hidden_layers": True}, "num_hidden_layers", id="layers-bool"),
    pytest.param({"num_hidden_layers": "2"}, "num_hidden_layers", id="layers-string"),
    pytest.param({"num_hidden_layers": 2.0}, "num_hidden_layers", id="layers-float"),
    pytest.param({"num_hidden_layers": None}, "num_hidden_layers", id="layers-null"),
    pytest.param({"num_attention_heads": 0}, "num_attention_heads", id="heads-zero"),
    pytest.param({"num_attention_heads": True}, "num_attention_heads", id="heads-bool"),
    pytest.param({"num_key_value_heads": "2"}, "num_key_value_heads", id="kv-heads-string"),
    pytest.param({"num_key_value_heads": -1}, "num_key_value_heads", id="kv-heads-negative"),
    pytest.param({"head_dim": 0}, "head_dim", id="head-dim-zero"),
    pytest.param({"head_dim": True}, "head_dim", id="head-dim-bool"),
    pytest.param({"head_dim": "32"}, "head_dim", id="head-dim-string"),
    pytest.param({"hidden_size": 0}, "hidden_size", id="hidden-zero"),
    pytest.param({"hidden_size": "128"}, "hidden_size", id="hidden-string"),
    pytest.param({"hidden_size": 130}, "hidden_size 130", id="hidden-not-multiple-of-heads"),
]


@pytest.mark.parametrize(("changes", "named"), BAD_CONFIGS)
def test_bad_config_value_raises_naming_the_key(changes: dict[str, Any], named: str) -> None:
    config = {**BASE_CONFIG, **changes}
    with pytest.raises(EngineError) as err:
        geometry_from_config(json.dumps(config), "/models/x/config.json")
    assert err.value.source == "/models/x/config.json"
    assert named in err.value.message


MISSING_KEYS = [
    pytest.param("num_hidden_layers", id="no-layers"),
    pytest.param("num_attention_heads", id="no-heads"),
    pytest.param("hidden_size", id="no-hidden-and-no-head-dim"),
]


@pytest.mark.parametrize("key", MISSING_KEYS)
def test_missing_config_key_raises_naming_it(key: str) -> None:
    config = {k: v for k, v in BASE_CONFIG.items() if k != key}
    with pytest.raises(EngineError) as err:
        geometry_from_config(json.dumps(config))
    assert key in err.value.message
    assert err.value.source == "config.json"


NOT_CONFIGS = [
    pytest.param("{not json", "not JSON", id="not-json"),
    pytest.param("[1, 2]", "JSON object", id="json-list"),
    pytest.param('"llama"', "JSON object", id="json-string"),
    pytest.param('{"text_config": "x"}', "num_hidden_layers", id="text-config-not-object"),
]


@pytest.mark.parametrize(("text", "named"), NOT_CONFIGS)
def test_unusable_config_text_raises(text: str, named: str) -> None:
    with pytest.raises(EngineError, match=named):
        geometry_from_config(text)


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


MALFORMED = [
    pytest.param("this is not prometheus\n", id="prose"),
    pytest.param("vllm:num_requests_running 1.0.0\n", id="bad-number"),
    pytest.param("vllm:num_requests_running\n", id="no-value"),
    pytest.param('vllm:num_requests_running{engine="0} 1\n', id="unterminated-label"),
    pytest.param('vllm:num_requests_running{engine="0",model_na', id="cut-in-label-set"),
    pytest.param("<html><body>502 Bad Gateway</body></html>\n", id="html-error-page"),
    pytest.param('{"detail": "Not Found"}', id="json-body"),
    pytest.param("\x00\x01\x02", id="binary"),
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_metrics_raise_naming_the_source(text: str) -> None:
    with pytest.raises(EngineError) as err:
        parse_metrics(text, source="/custom-metrics")
    assert err.value.source == "/custom-metrics"
    assert "Prometheus" in err.value.message


# -- vLLM facts ------------------------------------------------------------------------------


def test_vllm_facts_from_the_recorded_answers() -> None:
    facts = VLLM.facts(vllm_answers(), TINY)
    assert facts == EngineFacts(
        engine="vllm",
        engine_version="0.32.0",
        model_id="tiny",
        max_model_len=1024,
        block_size_tokens=128,
        kv_blocks_total=16384,
        kv_memory_bytes=TINY_KV_BYTES,
        kv_dtype=KvDtype.BF16,
        kv_layout=KvLayout.PAGED_NHD,
        max_num_seqs=0,
        pd_role="",
        bootstrap_port=0,
    )
    # the recorded figures agree with each other: bf16 is 2 bytes an element
    assert TINY_KV_BYTES / (TINY_KV_TOKENS * TINY_ELEMENTS_PER_TOKEN) == 2.0


def test_vllm_facts_are_the_same_from_a_busy_scrape() -> None:
    assert VLLM.facts(vllm_answers(DECODE), TINY) == VLLM.facts(vllm_answers(IDLE), TINY)


VLLM_DTYPES = [
    pytest.param({}, TINY, KvDtype.BF16, id="recorded-bf16"),
    pytest.param(
        {"kv_cache_memory_bytes": str(2 * TINY_KV_BYTES)}, TINY, KvDtype.FP32, id="fp32-engine"
    ),
    pytest.param(
        {"kv_cache_memory_bytes": str(TINY_KV_BYTES // 2), "cache_dtype": "fp8"},
        TINY,
        KvDtype.FP8_E4M3,
        id="fp8-cache-1-byte",
    ),
    pytest.param(
        {"kv_cache_memory_bytes": str(TINY_KV_BYTES // 2), "cache_dtype": "fp8_e5m2"},
        TINY,
        KvDtype.FP8_E5M2,
        id="fp8-e5m2-cache-1-byte",
    ),
    pytest.param(
        {},
        ModelGeometry(2, 2, 32, "float16"),
        KvDtype.FP16,
        id="2-bytes-of-an-fp16-model",
    ),
    pytest.param(
        {"kv_cache_size_tokens": "None"},
        TINY,
        KvDtype.BF16,
        id="no-size-in-tokens-uses-blocks-x-block-size",
    ),
    pytest.param({}, None, None, id="no-geometry-auto-cannot-tell"),
    pytest.param({"cache_dtype": "fp8"}, None, KvDtype.FP8_E4M3, id="no-geometry-named-fp8"),
    pytest.param({"kv_cache_memory_bytes": "None"}, TINY, None, id="no-kv-bytes-auto-cannot-tell"),
]


@pytest.mark.parametrize(("labels", "geometry", "expected"), VLLM_DTYPES)
def test_vllm_kv_dtype_is_derived_from_bytes(
    labels: dict[str, str], geometry: ModelGeometry | None, expected: KvDtype | None
) -> None:
    facts = VLLM.facts(vllm_answers(with_cache_labels(IDLE, **labels)), geometry)
    assert facts.kv_dtype is expected


def test_vllm_fp32_engine_keeps_its_memory_figure() -> None:
    doubled = with_cache_labels(IDLE, kv_cache_memory_bytes=str(2 * TINY_KV_BYTES))
    facts = VLLM.facts(vllm_answers(doubled), TINY)
    assert (facts.kv_dtype, facts.kv_memory_bytes) == (KvDtype.FP32, 2 * TINY_KV_BYTES)


@pytest.mark.parametrize(
    ("labels", "geometry"),
    [
        pytest.param(
            {"kv_cache_memory_bytes": str(3 * TINY_KV_BYTES)}, TINY, id="6-bytes-an-element"
        ),
        pytest.param(
            {"kv_cache_memory_bytes": str(3 * TINY_KV_BYTES // 2)}, TINY, id="3-bytes-an-element"
        ),
        pytest.param({}, ModelGeometry(2, 2, 48, "bfloat16"), id="config-of-another-model"),
    ],
)
def test_vllm_width_that_fits_no_dtype_raises(
    labels: dict[str, str], geometry: ModelGeometry
) -> None:
    with pytest.raises(EngineError) as err:
        VLLM.facts(vllm_answers(with_cache_labels(IDLE, **labels)), geometry)
    assert err.value.source == "cache_config_info"


def test_vllm_hnd_layout_is_read_from_the_labels() -> None:
    facts = VLLM.facts(vllm_answers(with_cache_labels(IDLE, kv_cache_layout="HND")), TINY)
    assert facts.kv_layout is KvLayout.PAGED_HND


def test_vllm_without_cache_config_info_raises_naming_metrics() -> None:
    metrics = without_lines(IDLE, "vllm:cache_config_info")
    with pytest.raises(EngineError) as err:
        VLLM.facts(vllm_answers(metrics), TINY)
    assert err.value.source == "/metrics"
    assert "vllm:cache_config_info" in err.value.message


@pytest.mark.parametrize(
    "block_size",
    [pytest.param("None", id="none"), pytest.param("0", id="zero"), pytest.param("", id="empty")],
)
def test_vllm_without_block_size_raises_naming_metrics(block_size: str) -> None:
    metrics = with_cache_labels(IDLE, block_size=block_size)
    with pytest.raises(EngineError) as err:
        VLLM.facts(vllm_answers(metrics), TINY)
    assert err.value.source == "/metrics"
    assert "block_size" in err.value.message


def test_vllm_malformed_metrics_at_registration_raise() -> None:
    with pytest.raises(EngineError) as err:
        VLLM.facts(vllm_answers("<html>503</html>\n"), TINY)
    assert err.value.source == "/metrics"


@pytest.mark.parametrize(
    "models",
    [
        pytest.param("not json", id="not-json"),
        pytest.param('{"data": []}', id="no-models"),
        pytest.param('{"object": "list"}', id="no-data"),
        pytest.param('{"data": [{"object": "model"}]}', id="model-without-id"),
        pytest.param('["tiny"]', id="json-list"),
    ],
)
def test_vllm_models_answer_without_a_model_raises(models: str) -> None:
    answers = {**vllm_answers(), "/v1/models": models}
    with pytest.raises(EngineError) as err:
        VLLM.facts(answers, TINY)
    assert err.value.source == "/v1/models"


@pytest.mark.parametrize(
    "version",
    [
        pytest.param("", id="empty"),
        pytest.param("not json", id="not-json"),
        pytest.param('["0.32.0"]', id="json-list"),
        pytest.param("{}", id="no-version-key"),
    ],
)
def test_vllm_unreadable_version_is_empty(version: str) -> None:
    facts = VLLM.facts({**vllm_answers(), "/version": version}, TINY)
    assert facts.engine_version == ""
    assert facts.kv_dtype is KvDtype.BF16


def test_vllm_models_answer_without_max_model_len_is_zero() -> None:
    answers = {**vllm_answers(), "/v1/models": '{"data": [{"id": "m"}]}'}
    facts = VLLM.facts(answers, TINY)
    assert (facts.model_id, facts.max_model_len) == ("m", 0)


# -- vLLM samples ----------------------------------------------------------------------------


def test_vllm_sample_of_the_recorded_decode_scrape() -> None:
    sample = VLLM.sample(DECODE)
    assert (sample.running, sample.waiting, sample.kv_usage) == (0, 0, 0.0)
    assert sample.prefix_queries == 722.0
    assert sample.prefix_hits == 256.0
    assert sample.prefix_hit_rate is None
    # only the tokens this engine computed, not the cached or transferred ones
    assert sample.prompt_tokens_computed == 105.0
    assert sample.generation_tokens == 16.0
    assert sample.prefill_time_s == pytest.approx(0.1054722449999872)
    assert len(sample.itl_buckets) == 20
    assert sample.itl_buckets[:3] == ((0.01, 0.0), (0.025, 11.0), (0.05, 14.0))
    assert sample.itl_buckets[-1] == (math.inf, 14.0)


def test_vllm_sample_of_the_recorded_idle_scrape_has_its_counters_at_zero() -> None:
    sample = VLLM.sample(IDLE)
    assert (sample.running, sample.waiting, sample.kv_usage) == (0, 0, 0.0)
    counters = (
        sample.prefix_queries,
        sample.prefix_hits,
        sample.prompt_tokens_computed,
        sample.generation_tokens,
        sample.prefill_time_s,
    )
    assert counters == (0.0, 0.0, 0.0, 0.0, 0.0)
    assert len(sample.itl_buckets) == 20
    assert all(count == 0.0 for _, count in sample.itl_buckets)


def test_vllm_sample_gauges_from_an_edited_recorded_scrape() -> None:
    text = (
        DECODE.replace(
            'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
            'vllm:num_requests_running{engine="0",model_name="tiny"} 7.0',
        )
        .replace(
            'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0',
            'vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0',
        )
        .replace(
            'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.375',
        )
    )
    sample = VLLM.sample(text)
    assert (sample.running, sample.waiting, sample.kv_usage) == (7, 3, 0.375)


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        pytest.param("0.5", 0.5, id="in-range"),
        pytest.param("1.2", 1.0, id="above-one-clamped"),
        pytest.param("-0.1", 0.0, id="negative-clamped"),
    ],
)
def test_vllm_kv_usage_is_clamped_to_a_fraction(usage: str, expected: float) -> None:
    assert VLLM.sample(vllm_gauges(usage=usage)).kv_usage == expected


def test_vllm_sample_of_gauges_only_has_no_counters() -> None:
    sample = VLLM.sample(vllm_gauges("2", "1", "0.25"))
    assert (sample.running, sample.waiting, sample.kv_usage) == (2, 1, 0.25)
    assert sample.prefix_queries is None
    assert sample.prefix_hits is None
    assert sample.prompt_tokens_computed is None
    assert sample.generation_tokens is None
    assert sample.prefill_time_s is None
    assert sample.itl_buckets == ()


def test_vllm_prompt_tokens_of_other_sources_are_not_computed_ones() -> None:
    text = vllm_gauges() + (
        'vllm:prompt_tokens_by_source_total{source="local_cache_hit"} 50\n'
        'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} 70\n'
    )
    assert VLLM.sample(text).prompt_tokens_computed is None


def test_vllm_histogram_buckets_are_summed_over_engines_and_sorted() -> None:
    text = vllm_gauges() + (
        'vllm:inter_token_latency_seconds_bucket{engine="1",le="+Inf"} 5\n'
        'vllm:inter_token_latency_seconds_bucket{engine="1",le="0.05"} 4\n'
        'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.05"} 1\n'
        'vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf"} 2\n'
        'vllm:inter_token_latency_seconds_count{engine="0"} 2\n'
    )
    assert VLLM.sample(text).itl_buckets == ((0.05, 5.0), (math.inf, 7.0))


def test_vllm_request_counts_are_summed_over_engines() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} 2\n'
        'vllm:num_requests_running{engine="1"} 3\n'
        'vllm:num_requests_waiting{engine="0"} 1\n'
        'vllm:num_requests_waiting{engine="1"} 4\n'
        "vllm:kv_cache_usage_perc 0.1\n"
    )
    sample = VLLM.sample(text)
    assert (sample.running, sample.waiting) == (5, 5)


@pytest.mark.parametrize(
    "missing",
    [
        pytest.param("vllm:num_requests_running{", id="no-running"),
        pytest.param("vllm:num_requests_waiting{", id="no-waiting"),
        pytest.param("vllm:kv_cache_usage_perc{", id="no-kv-usage"),
    ],
)
def test_vllm_sample_without_a_required_gauge_raises(missing: str) -> None:
    with pytest.raises(EngineError) as err:
        VLLM.sample(without_lines(DECODE, missing))
    assert err.value.source == "/metrics"
    assert "vllm:num_requests_running" in err.value.message


def test_vllm_sample_of_another_engines_metrics_raises() -> None:
    with pytest.raises(EngineError):
        VLLM.sample(read("sglang", "metrics.txt"))


@pytest.mark.parametrize("text", MALFORMED)
def test_vllm_sample_of_malformed_text_raises(text: str) -> None:
    with pytest.raises(EngineError) as err:
        VLLM.sample(text)
    assert err.value.source == "/metrics"


# A scrape cut short: the gauges come before the counters in vLLM's exposition, so a cut at
# a line boundary after them still yields the gauges (the counters read as absent and the
# tracker carries its rates forward); a cut before them, or inside a label set, refuses the
# whole scrape rather than reading half a line.


def test_partial_scrape_of_only_the_gauge_lines() -> None:
    lines = [line for line in DECODE.splitlines(keepends=True) if line.startswith(GAUGES)]
    sample = VLLM.sample("".join(lines))
    assert (sample.running, sample.waiting, sample.kv_usage) == (0, 0, 0.0)
    assert (sample.prefix_queries, sample.prompt_tokens_computed) == (None, None)
    assert sample.itl_buckets == ()


def test_scrape_cut_after_the_gauges_keeps_them_and_drops_the_counters() -> None:
    sample = VLLM.sample(up_to(DECODE, "vllm:kv_cache_usage_perc{", inclusive=True))
    assert (sample.running, sample.waiting, sample.kv_usage) == (0, 0, 0.0)
    assert sample.prefix_queries is None
    assert sample.prefill_time_s is None
    assert sample.itl_buckets == ()


def test_scrape_cut_before_the_gauges_raises() -> None:
    with pytest.raises(EngineError, match="lacks"):
        VLLM.sample(up_to(DECODE, "vllm:kv_cache_usage_perc{", inclusive=False))


def test_scrape_cut_inside_a_histogram_has_only_the_buckets_read() -> None:
    cut = up_to(
        DECODE, 'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.1"', inclusive=True
    )
    sample = VLLM.sample(cut)
    assert sample.prefix_queries == 722.0
    assert sample.itl_buckets == (
        (0.01, 0.0),
        (0.025, 11.0),
        (0.05, 14.0),
        (0.075, 14.0),
        (0.1, 14.0),
    )


def test_scrape_cut_inside_a_label_set_raises() -> None:
    line_start = DECODE.index("vllm:prefix_cache_hits_total{")
    cut = DECODE[: line_start + len('vllm:prefix_cache_hits_total{engine="0",mod')]
    with pytest.raises(EngineError) as err:
        VLLM.sample(cut)
    assert err.value.source == "/metrics"


# -- SGLang ----------------------------------------------------------------------------------


def test_sglang_facts_from_the_recorded_answers() -> None:
    facts = SGLANG.facts(sglang_answers(), TINY)
    assert facts == EngineFacts(
        engine="sglang",
        engine_version="0.5.23",
        model_id="tiny",
        max_model_len=4096,
        block_size_tokens=16,
        kv_blocks_total=16384 // 16,
        # 16384 tokens x (2 x 2 layers x 2 KV heads x 32 head dim) elements x 2 bytes (bf16)
        kv_memory_bytes=16384 * TINY_ELEMENTS_PER_TOKEN * 2,
        kv_dtype=KvDtype.BF16,
        kv_layout=KvLayout.PAGED_NHD,
        max_num_seqs=64,
        pd_role="prefill",
        bootstrap_port=8998,
    )
    assert facts.kv_memory_bytes == 8_388_608


def test_sglang_facts_without_geometry_state_no_kv_bytes() -> None:
    facts = SGLANG.facts(sglang_answers(), None)
    assert (facts.kv_dtype, facts.kv_memory_bytes, facts.kv_blocks_total) == (
        KvDtype.BF16,
        0,
        1024,
    )


def server_info(**changes: Any) -> str:
    info = json.loads(read("sglang", "get_server_info.json"))
    info.update(changes)
    return json.dumps(info)


SGLANG_VARIANTS = [
    pytest.param(
        {"kv_cache_dtype": "fp8_e5m2"},
        {"kv_dtype": KvDtype.FP8_E5M2, "kv_memory_bytes": 16384 * TINY_ELEMENTS_PER_TOKEN},
        id="fp8-kv-cache",
    ),
    pytest.param(
        {"dtype": "float16"},
        {"kv_dtype": KvDtype.FP16},
        id="fp16-model",
    ),
    pytest.param(
        {"dtype": "auto"},
        {"kv_dtype": KvDtype.BF16},
        id="auto-falls-back-to-config-dtype",
    ),
    pytest.param(
        {"dtype": "float32"},
        {"kv_dtype": KvDtype.FP32, "kv_memory_bytes": 16384 * TINY_ELEMENTS_PER_TOKEN * 4},
        id="fp32-model",
    ),
    pytest.param({"disaggregation_mode": "decode"}, {"pd_role": "decode"}, id="decode-role"),
    pytest.param({"disaggregation_mode": "null"}, {"pd_role": ""}, id="no-pd-role-null"),
    pytest.param({"disaggregation_mode": None}, {"pd_role": ""}, id="no-pd-role-none"),
    pytest.param(
        {"disaggregation_bootstrap_port": None}, {"bootstrap_port": 0}, id="no-bootstrap-port"
    ),
    pytest.param(
        {"page_size": None},
        {"block_size_tokens": 1, "kv_blocks_total": 16384},
        id="no-page-size-is-1",
    ),
    pytest.param({"page_size": 64}, {"kv_blocks_total": 256}, id="page-64"),
    pytest.param({"max_running_requests": None}, {"max_num_seqs": 0}, id="no-max-running"),
    pytest.param({"context_length": None}, {"max_model_len": 4096}, id="ctx-from-v1-models"),
    pytest.param(
        {"max_total_num_tokens": None},
        {"kv_blocks_total": 0, "kv_memory_bytes": 0},
        id="no-pool-size-is-unknown",
    ),
]


@pytest.mark.parametrize(("changes", "expected"), SGLANG_VARIANTS)
def test_sglang_facts_variants(changes: dict[str, Any], expected: dict[str, Any]) -> None:
    facts = SGLANG.facts(sglang_answers(server_info(**changes)), TINY)
    assert {key: getattr(facts, key) for key in expected} == expected


def test_sglang_server_args_nested_under_their_own_key() -> None:
    info = json.loads(read("sglang", "get_server_info.json"))
    args = {k: v for k, v in info.items() if k not in ("version", "max_total_num_tokens")}
    nested = {"version": "0.5.23", "max_total_num_tokens": 16384, "server_args": args}
    nested_facts = SGLANG.facts(sglang_answers(json.dumps(nested)), TINY)
    assert nested_facts == SGLANG.facts(sglang_answers(), TINY)


def test_sglang_all_dtypes_auto_without_geometry_cannot_tell() -> None:
    facts = SGLANG.facts(sglang_answers(server_info(dtype="auto")), None)
    assert (facts.kv_dtype, facts.kv_memory_bytes) == (None, 0)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        pytest.param("<html>502</html>", "not JSON", id="not-json"),
        pytest.param("", "not JSON", id="empty"),
        pytest.param("[1, 2]", "JSON object", id="json-list"),
        pytest.param(server_info(page_size=-16), "page_size", id="page-size-negative"),
        pytest.param(server_info(page_size="16"), "page_size", id="page-size-string"),
    ],
)
def test_sglang_unusable_server_info_raises(text: str, named: str) -> None:
    with pytest.raises(EngineError) as err:
        SGLANG.facts(sglang_answers(text), TINY)
    assert err.value.source == "/get_server_info"
    assert named in err.value.message


def test_sglang_sample_of_the_recorded_scrape() -> None:
    sample = SGLANG.sample(read("sglang", "metrics.txt"))
    assert (sample.running, sample.waiting, sample.kv_usage) == (3, 2, 0.25)
    assert sample.prefix_hit_rate == 0.4
    assert (sample.prefix_queries, sample.prefix_hits, sample.prefill_time_s) == (
        None,
        None,
        None,
    )
    assert sample.prompt_tokens_computed == 45079.0
    assert sample.generation_tokens == 26599.0
    assert len(sample.itl_buckets) == 24
    assert sample.itl_buckets[1] == (0.004, 162.0)
    assert sample.itl_buckets[-1] == (math.inf, 26957.0)


def test_sglang_sample_of_the_recorded_prefill_scrape() -> None:
    sample = SGLANG.sample(read("sglang", "metrics_prefill.txt"))
    assert (sample.running, sample.waiting, sample.kv_usage) == (3, 2, 0.25)
    assert sample.prefix_hit_rate == 0.4
    assert sample.prompt_tokens_computed == 43339.0
    assert sample.generation_tokens == 128.0
    assert sample.itl_buckets == ()


@pytest.mark.parametrize(
    ("rate", "expected"),
    [
        pytest.param("1.5", 1.0, id="above-one-clamped"),
        pytest.param("-0.5", 0.0, id="negative-clamped"),
    ],
)
def test_sglang_hit_rate_is_clamped(rate: str, expected: float) -> None:
    sample = SGLANG.sample(sglang_gauges() + f"sglang:cache_hit_rate {rate}\n")
    assert sample.prefix_hit_rate == expected


def test_sglang_sample_without_hit_rate_has_none() -> None:
    assert SGLANG.sample(sglang_gauges("1", "0", "0.5")).prefix_hit_rate is None


@pytest.mark.parametrize(
    "missing",
    [
        pytest.param("sglang:num_running_reqs{", id="no-running"),
        pytest.param("sglang:num_queue_reqs{", id="no-queue"),
        pytest.param("sglang:token_usage{", id="no-token-usage"),
    ],
)
def test_sglang_sample_without_a_required_gauge_raises(missing: str) -> None:
    with pytest.raises(EngineError) as err:
        SGLANG.sample(without_lines(read("sglang", "metrics.txt"), missing))
    assert err.value.source == "/metrics"


def test_sglang_sample_of_vllm_metrics_raises() -> None:
    with pytest.raises(EngineError):
        SGLANG.sample(DECODE)


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
