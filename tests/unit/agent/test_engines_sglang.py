"""SGLang's adapter: the facts and load samples read from recorded SGLang answers."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from hpd_agent.engines import (
    EngineError,
    EngineFacts,
)
from hpd_common.kvformat import KvDtype, KvLayout
from tests.unit.agent.recorded import (
    DECODE,
    SGLANG,
    TINY,
    TINY_ELEMENTS_PER_TOKEN,
    read,
    sglang_answers,
    sglang_gauges,
    without_lines,
)

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
