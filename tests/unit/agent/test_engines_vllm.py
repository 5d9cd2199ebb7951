"""vLLM's adapter: the facts and load samples read from recorded vLLM answers."""

from __future__ import annotations

import math

import pytest

from hpd_agent.engines import (
    EngineError,
    EngineFacts,
)
from hpd_agent.model_config import ModelGeometry
from hpd_common.kvformat import KvDtype, KvLayout
from tests.unit.agent.recorded import (
    DECODE,
    GAUGES,
    IDLE,
    MALFORMED,
    TINY,
    TINY_ELEMENTS_PER_TOKEN,
    TINY_KV_BYTES,
    TINY_KV_TOKENS,
    VLLM,
    read,
    up_to,
    vllm_answers,
    vllm_gauges,
    with_cache_labels,
    without_lines,
)

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


def test_vllm_blocks_set_by_the_operator_are_sized_as_blocks_not_as_the_budget() -> None:
    """``--num-gpu-blocks-override``: the memory label stays the budget while the engine
    holds only the blocks; read as a width it fit no dtype and the agent refused to start
    (64 blocks of 128 tokens against 1 GiB: 341 bytes an element)."""
    block = 128
    text = with_cache_labels(
        IDLE, num_gpu_blocks="64", num_gpu_blocks_override="64", kv_cache_size_tokens="8192"
    )
    facts = VLLM.facts(vllm_answers(text), TINY)
    per_token = 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim * 2  # bf16
    assert facts.kv_dtype is KvDtype.BF16
    assert facts.kv_blocks_total == 64
    assert facts.kv_memory_bytes == 64 * block * per_token


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
