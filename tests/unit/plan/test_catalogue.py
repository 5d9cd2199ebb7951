"""The GPU catalogue: known GPUs by name, unknown ones by their figures, and each mistake
named by its key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpd_common import perfmodel
from hpd_plan.catalogue import CatalogueError, load_catalogue, parse_catalogue

LLAMA8 = perfmodel.model_spec("llama-3-8b")
LLAMA70 = perfmodel.model_spec("llama-3-70b")


def test_a_known_gpu_takes_the_tables_figures_and_price() -> None:
    cat = parse_catalogue({"gpus": [{"name": "h100", "available": 4}]}, LLAMA8)
    (k,) = cat.kinds
    assert k.known and k.gpu.name == "H100-SXM" and k.price_per_hour == 6.90
    assert k.available == 4 and k.tps == (1,)


def test_another_price_for_the_same_gpu_is_another_kind() -> None:
    doc = [
        {"name": "H100-SXM"},
        {"name": "h100-spot", "gpu": "H100-SXM", "price_per_hour": 2.5, "available": 2},
    ]
    cat = parse_catalogue(doc, LLAMA8)
    spot = cat.kind("h100-spot")
    assert spot.known and spot.gpu.name == "H100-SXM" and spot.price_per_hour == 2.5


def test_an_unknown_gpu_with_its_figures() -> None:
    raw = {"name": "acme-x1", "peak_tflops": 400, "hbm_gbps": 1600, "hbm_gib": 64}
    raw |= {"price_per_hour": 2.2, "learned": {"prefill_scale": 1.2, "decode_seq_ms": 0.05}}
    (k,) = parse_catalogue([raw], LLAMA8).kinds
    assert not k.known and k.gpu.peak_tflops_bf16 == 400 and k.gpu.hbm_gib == 64
    assert k.learned.prefill_scale == 1.2 and k.learned.decode_scale == 1.0
    assert not k.learned.is_declared


@pytest.mark.parametrize(
    ("doc", "key", "words"),
    [
        ({"gpus": []}, "gpus", "empty"),
        ([], "gpus", "empty"),
        ({"gpus": [{"name": "acme-x1", "price_per_hour": 2}]}, "gpus[0]", "hbm_gbps, hbm_gib"),
        (
            [{"name": "acme-x1", "peak_tflops": 1, "hbm_gbps": 1, "hbm_gib": 64}],
            "gpus[0].price_per_hour",
            "required",
        ),
        ([{"name": "L4", "gpu": "nope"}], "gpus[0].gpu", "unknown GPU"),
        ([{"name": "L4"}, {"name": "L4"}], "gpus[1].name", "duplicate"),
        ([{"name": "L4", "colour": "red"}], "gpus[0].colour", "unknown key"),
        ([{"name": "L4", "available": -1}], "gpus[0].available", ">= 0"),
        ([{"name": "L4", "available": 0}], "gpus", "nothing may be had"),
        ([{"name": "L4", "learned": {"speed": 2}}], "gpus[0].learned.speed", "unknown key"),
        ({"kinds": []}, "kinds", "unknown key"),
    ],
)
def test_mistakes_are_named_by_key(doc: Any, key: str, words: str) -> None:
    with pytest.raises(CatalogueError) as err:
        parse_catalogue(doc, LLAMA8)
    assert err.value.key == key and words in err.value.message


def test_worker_size_defaults_to_the_smallest_that_holds_the_model() -> None:
    cat = parse_catalogue([{"name": "H100-SXM"}, {"name": "L40S"}], LLAMA70)
    assert cat.kind("H100-SXM").tps == (2,)  # 141 GB of weights: two 80 GB GPUs
    assert cat.kind("L40S").tps == (4,)
    with pytest.raises(CatalogueError, match="does not fit"):
        parse_catalogue([{"name": "H100-SXM", "tp": [1, 2]}], LLAMA70)


def test_json_and_yaml_files_read_alike(tmp_path: Path) -> None:
    doc = {"gpus": [{"name": "A100-80G", "available": 3, "tp": [1, 2]}]}
    (tmp_path / "g.json").write_text(json.dumps(doc))
    (tmp_path / "g.yaml").write_text("gpus:\n  - {name: A100-80G, available: 3, tp: [1, 2]}\n")
    a = load_catalogue(tmp_path / "g.json", LLAMA8)
    b = load_catalogue(tmp_path / "g.yaml", LLAMA8)
    assert a == b and a.kinds[0].tps == (1, 2)
