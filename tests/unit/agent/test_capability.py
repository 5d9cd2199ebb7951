"""The capability record: flags plus the engine's own facts, or an error naming the flag."""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace
from typing import Any

import pytest

from hpd_agent.capability import (
    DEFAULT_MAX_BATCH,
    AgentFlags,
    CapabilityError,
    build_spec,
    config_revision,
    host_port,
)
from hpd_agent.engines import EngineFacts, SglangAdapter, VllmAdapter
from hpd_agent.model_config import ModelGeometry
from hpd_common.errors import InvalidArgument
from hpd_common.kvformat import KvDtype, KvFormat, KvLayout
from hpd_common.worker_model import NetworkLocation, Stage, WorkerSpec
from hpd_registry.validation import validate_spec
from tests.unit.agent.recorded import TINY, TINY_KV_BYTES, read_bytes, sglang_answers, vllm_answers

CONFIG = read_bytes("vllm", "model_config.json")
REVISION = "cfg-" + hashlib.sha256(CONFIG).hexdigest()[:12]
VLLM_FACTS = VllmAdapter().facts(vllm_answers(), TINY)
# the recorded model's size from its config.json (hpd_agent.model_config.model_size_from_config)
MODEL_SIZE = (("model-attention-width", "128"), ("model-params", "557056"))
SGLANG_FACTS = SglangAdapter().facts(sglang_answers(), TINY)


def flags(**changes: Any) -> AgentFlags:
    base = AgentFlags(
        engine_url="http://10.0.0.5:8000",
        role="prefill",
        gpu_type="L4-TEST",
        peak_tflops=121.0,
        hbm_gbps=300.0,
        kv_connector="NixlConnector",
        kv_side_channel="10.0.0.5:5600",
    )
    return replace(base, **changes)


# -- host_port and config_revision -----------------------------------------------------------

HOST_PORTS = [
    pytest.param("http://10.0.0.5:8000", ("10.0.0.5", 8000), id="http-with-port"),
    pytest.param("https://engine.local:8443/", ("engine.local", 8443), id="https-with-port"),
    pytest.param("http://engine.local", ("engine.local", 80), id="http-default-port"),
    pytest.param("https://engine.local", ("engine.local", 443), id="https-default-port"),
    pytest.param("localhost:30000", ("localhost", 30000), id="no-scheme"),
    pytest.param("http://Engine.Local:8000/v1", ("engine.local", 8000), id="path-and-case"),
    pytest.param("http://[::1]:8000", ("::1", 8000), id="ipv6"),
]


@pytest.mark.parametrize(("url", "expected"), HOST_PORTS)
def test_host_port(url: str, expected: tuple[str, int]) -> None:
    assert host_port(url) == expected


BAD_URLS = [
    pytest.param("", id="empty"),
    pytest.param("ftp://engine:21", id="not-http"),
    pytest.param("grpc://engine:50051", id="grpc-scheme"),
    pytest.param("http://:8000", id="no-host"),
    pytest.param("http://engine:99999", id="port-out-of-range"),
    pytest.param("http://engine:http", id="port-not-a-number"),
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_bad_engine_url_names_the_flag(url: str) -> None:
    with pytest.raises(CapabilityError) as err:
        host_port(url)
    assert err.value.flag == "--engine-url"


def test_config_revision_is_a_sha256_prefix() -> None:
    assert config_revision(CONFIG) == REVISION
    assert re.fullmatch(r"cfg-[0-9a-f]{12}", REVISION)
    assert config_revision(CONFIG + b" ") != REVISION


# -- build_spec: a full record ---------------------------------------------------------------


def test_full_spec_from_the_recorded_vllm_facts() -> None:
    spec = build_spec(flags(labels=(("tier", "gold"),)), VLLM_FACTS, TINY, CONFIG)
    assert spec == WorkerSpec(
        worker_id="vllm-10.0.0.5-8000",
        pool_id="tiny-prefill-l4-test",
        endpoint="10.0.0.5:8000",
        stages=(Stage.PREFILL,),
        model_id="tiny",
        model_revision=REVISION,
        engine="vllm",
        engine_version="0.32.0",
        gpu_type="L4-TEST",
        gpu_count=1,
        tp_size=1,
        pp_size=1,
        peak_tflops=121.0,
        hbm_gbps=300.0,
        kv_memory_total_bytes=TINY_KV_BYTES,
        max_batch_size=DEFAULT_MAX_BATCH,
        max_context_tokens=1024,  # the engine's max_model_len
        kv_format=KvFormat(
            dtype=KvDtype.BF16,
            layout=KvLayout.PAGED_NHD,
            block_size_tokens=128,
            num_layers=2,
            num_kv_heads=2,
            head_dim=32,
            tp_size=1,
            attention_backend="vllm",
            model_revision=REVISION,
        ),
        network=NetworkLocation(zone="", rack="", host="10.0.0.5", nic_gbps=0.0),
        labels=(
            ("kv-connector", "NixlConnector"),
            ("kv-role", "producer"),
            ("kv-side-channel", "10.0.0.5:5600"),
            *MODEL_SIZE,
            ("tier", "gold"),
        ),
    )
    assert DEFAULT_MAX_BATCH == 256


@pytest.mark.parametrize(
    ("role", "stages"),
    [
        pytest.param("prefill", (Stage.PREFILL,), id="prefill"),
        pytest.param("decode", (Stage.DECODE,), id="decode"),
        pytest.param("both", (Stage.PREFILL, Stage.DECODE), id="both"),
    ],
)
def test_stages_follow_the_role(role: str, stages: tuple[Stage, ...]) -> None:
    spec = build_spec(flags(role=role), VLLM_FACTS, TINY, CONFIG)
    assert spec.stages == stages
    assert spec.pool_id == f"tiny-{role}-l4-test"


def test_flags_win_where_given() -> None:
    spec = build_spec(
        flags(
            worker_id="p-0",
            pool_id="pool-a",
            endpoint="engine.svc:80",
            model_id="served-name",
            model_revision="r7",
            attention_backend="flash_attn",
            max_batch_size=32,
            gpu_count=2,
            tp_size=2,
            zone="z1",
            rack="r1",
            host="node-3",
            nic_gbps=400.0,
        ),
        VLLM_FACTS,
        TINY,
        CONFIG,
    )
    assert (spec.worker_id, spec.pool_id, spec.endpoint) == ("p-0", "pool-a", "engine.svc:80")
    assert (spec.model_id, spec.model_revision, spec.kv_format.model_revision) == (
        "served-name",
        "r7",
        "r7",
    )
    assert spec.kv_format.attention_backend == "flash_attn"
    assert spec.max_batch_size == 32
    assert (spec.gpu_count, spec.tp_size, spec.kv_format.tp_size) == (2, 2, 2)
    assert spec.network == NetworkLocation("z1", "r1", "node-3", 400.0)
    validate_spec(spec, known_gpu=False)


def test_pool_id_is_sanitised_and_lower_cased() -> None:
    facts = replace(VLLM_FACTS, model_id="meta-llama/Llama-3.1-8B Instruct")
    spec = build_spec(flags(role="both", gpu_type="H100 SXM"), facts, TINY, CONFIG)
    assert spec.pool_id == "meta-llama-llama-3.1-8b-instruct-both-h100-sxm"
    assert spec.model_id == "meta-llama/Llama-3.1-8B Instruct"
    validate_spec(spec, known_gpu=False)


def test_sglang_spec_carries_its_bootstrap_port_and_batch_limit() -> None:
    spec = build_spec(
        flags(engine_url="http://10.0.0.7:30000", kv_connector="mooncake", kv_side_channel=""),
        SGLANG_FACTS,
        TINY,
        CONFIG,
    )
    assert spec.worker_id == "sglang-10.0.0.7-30000"
    assert spec.max_batch_size == 64
    assert spec.labels == (
        ("bootstrap-port", "8998"),
        ("kv-connector", "mooncake"),
        ("kv-role", "producer"),
        *MODEL_SIZE,
    )
    assert (spec.kv_format.block_size_tokens, spec.kv_format.dtype) == (16, KvDtype.BF16)
    assert spec.kv_memory_total_bytes == 8_388_608
    assert spec.kv_format.attention_backend == "sglang"
    validate_spec(spec, known_gpu=False)


def test_no_connector_flags_means_no_connector_labels() -> None:
    spec = build_spec(flags(kv_connector="", kv_side_channel=""), VLLM_FACTS, TINY, CONFIG)
    assert spec.labels == MODEL_SIZE  # only the model's size
    # without its config.json (a revision given by flag) the agent knows no size either
    bare = flags(kv_connector="", kv_side_channel="", model_revision="r1")
    assert build_spec(bare, VLLM_FACTS, TINY, None).labels == ()


@pytest.mark.parametrize(
    ("role", "kv_role", "label"),
    [
        ("prefill", "", "producer"),
        ("decode", "", "consumer"),
        ("both", "", "both"),
        ("both", "producer", "producer"),  # a both-stages worker on a kv_producer engine
        ("prefill", "both", "both"),
        ("both", "none", "none"),  # an engine without a KV connector
    ],
)
def test_kv_role_label_follows_the_flag_else_the_role(role: str, kv_role: str, label: str) -> None:
    spec = build_spec(flags(role=role, kv_role=kv_role), VLLM_FACTS, TINY, CONFIG)
    assert dict(spec.labels)["kv-role"] == label


def test_unknown_kv_role_names_the_flag_and_the_known_ones() -> None:
    with pytest.raises(CapabilityError) as err:
        build_spec(flags(kv_role="sender"), VLLM_FACTS, TINY, CONFIG)
    assert err.value.flag == "--kv-role" and "producer, consumer, both" in str(err.value)


def test_kv_dtype_flag_fills_in_what_the_engine_cannot_tell() -> None:
    facts = replace(VLLM_FACTS, kv_dtype=None)
    spec = build_spec(flags(kv_dtype="fp16"), facts, TINY, CONFIG)
    assert spec.kv_format.dtype is KvDtype.FP16


def test_kv_dtype_flag_agreeing_with_the_engine_is_accepted() -> None:
    spec = build_spec(flags(kv_dtype="bf16"), VLLM_FACTS, TINY, CONFIG)
    assert spec.kv_format.dtype is KvDtype.BF16


def test_explicit_revision_needs_no_config_bytes() -> None:
    spec = build_spec(flags(model_revision="tiny-r1"), VLLM_FACTS, TINY, None)
    assert spec.model_revision == spec.kv_format.model_revision == "tiny-r1"


# -- build_spec: the registry accepts what it builds -----------------------------------------


@pytest.mark.parametrize(
    ("facts", "role"),
    [
        pytest.param(VLLM_FACTS, "prefill", id="vllm-prefill"),
        pytest.param(VLLM_FACTS, "decode", id="vllm-decode"),
        pytest.param(VLLM_FACTS, "both", id="vllm-both"),
        pytest.param(SGLANG_FACTS, "prefill", id="sglang-prefill"),
    ],
)
def test_spec_passes_the_registry_validation(facts: EngineFacts, role: str) -> None:
    spec = build_spec(flags(role=role), facts, TINY, CONFIG)
    validate_spec(spec, known_gpu=False)


def test_unknown_gpu_without_figures_is_refused_by_the_registry() -> None:
    spec = build_spec(flags(peak_tflops=0.0, hbm_gbps=0.0), VLLM_FACTS, TINY, CONFIG)
    with pytest.raises(InvalidArgument) as err:
        validate_spec(spec, known_gpu=False)
    assert err.value.field == "capability.gpu_type"


# -- build_spec: errors name their flag ------------------------------------------------------

NO_GEOMETRY = object()
NO_CONFIG = object()

SPEC_ERRORS = [
    pytest.param({"gpu_type": ""}, {}, "--gpu-type", id="missing-gpu-type"),
    pytest.param({"role": "mixed"}, {}, "--role", id="bad-role"),
    pytest.param({"role": ""}, {}, "--role", id="empty-role"),
    pytest.param({"role": "Prefill"}, {}, "--role", id="role-wrong-case"),
    pytest.param({}, {"config": NO_CONFIG}, "--model-revision", id="no-revision-no-config"),
    pytest.param({}, {"geometry": NO_GEOMETRY}, "--model-dir", id="no-geometry"),
    pytest.param({"kv_dtype": "fp32"}, {}, "--kv-dtype", id="kv-dtype-contradicts-engine"),
    pytest.param({"kv_dtype": "fp8_e4m3"}, {}, "--kv-dtype", id="kv-dtype-fp8-on-bf16-engine"),
    pytest.param({"kv_dtype": "float8"}, {}, "--kv-dtype", id="unknown-kv-dtype"),
    pytest.param({"kv_dtype": "BF16"}, {}, "--kv-dtype", id="kv-dtype-wrong-case"),
    pytest.param({}, {"kv_dtype": None}, "--kv-dtype", id="engine-cannot-tell-dtype"),
    pytest.param({"engine_url": "ftp://10.0.0.5:21"}, {}, "--engine-url", id="engine-url-scheme"),
    pytest.param({"engine_url": "http://:8000"}, {}, "--engine-url", id="engine-url-no-host"),
    pytest.param({"engine_url": "http://h:70000"}, {}, "--engine-url", id="engine-url-bad-port"),
    pytest.param({}, {"kv_memory_bytes": 0}, "--engine-url", id="engine-states-no-kv-size"),
]


@pytest.mark.parametrize(("flag_changes", "other_changes", "flag"), SPEC_ERRORS)
def test_spec_error_names_the_flag(
    flag_changes: dict[str, Any], other_changes: dict[str, Any], flag: str
) -> None:
    geometry: ModelGeometry | None = TINY
    config: bytes | None = CONFIG
    fact_changes = dict(other_changes)
    if fact_changes.pop("geometry", None) is NO_GEOMETRY:
        geometry = None
    if fact_changes.pop("config", None) is NO_CONFIG:
        config = None
    facts = replace(VLLM_FACTS, **fact_changes)
    with pytest.raises(CapabilityError) as err:
        build_spec(flags(**flag_changes), facts, geometry, config)
    assert err.value.flag == flag
    assert str(err.value).startswith(flag + ": ")


def test_contradicting_kv_dtype_names_both_dtypes() -> None:
    with pytest.raises(CapabilityError, match="says fp32 but the engine's own KV size says bf16"):
        build_spec(flags(kv_dtype="fp32"), VLLM_FACTS, TINY, CONFIG)


def test_unknown_kv_dtype_lists_the_known_ones() -> None:
    with pytest.raises(CapabilityError) as err:
        build_spec(flags(kv_dtype="float8"), VLLM_FACTS, TINY, CONFIG)
    assert all(d.value in str(err.value) for d in KvDtype)
