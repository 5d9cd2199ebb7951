"""The model's config.json: its geometry (the KV format's layers, KV heads and head dim)
and its size, as the agent reads them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hpd_agent.engines import (
    EngineError,
)
from hpd_agent.model_config import ModelGeometry, geometry_from_config
from tests.unit.agent.recorded import (
    TINY,
    read,
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
