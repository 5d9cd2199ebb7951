"""Cluster documents: the default loads; bad ones name the offending key."""

from __future__ import annotations

import random
from typing import Any

import pytest

from hpd_scheduler.policy import Fleet, Mode, Planner, Request, Stage, builtin_profile
from hpd_sim import ClusterError, load_cluster, parse_cluster


def _doc(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "model": "llama-3-8b",
        "pools": [{"id": "p", "gpu": "H100", "count": 2, "stage": "prefill"}],
    }
    doc.update(over)
    return doc


def test_the_default_cluster() -> None:
    c = load_cluster()
    assert c.gpus == 8
    assert {p.gpu.name for p in c.pools} == {"H100-SXM", "A100-80G", "L40S"}
    assert c.price_per_hour == pytest.approx(2 * 6.90 + 3 * 3.40 + 3 * 1.86)
    assert all(p.stage is Stage.BOTH for p in c.colocated().pools)
    views = c.worker_views()
    assert len(views) == 8 and len({v.worker_id for v in views}) == 8


@pytest.mark.parametrize(
    ("doc", "key"),
    [
        pytest.param(_doc(model="gpt-9"), "model", id="unknown-model"),
        pytest.param(_doc(pools=[]), "pools", id="no-pools"),
        pytest.param(
            _doc(pools=[{"id": "p", "gpu": "Z80", "stage": "decode"}]),
            "pools[0].gpu",
            id="unknown-gpu",
        ),
        pytest.param(
            _doc(pools=[{"id": "p", "gpu": "L4", "stage": "sideways"}]),
            "pools[0].stage",
            id="bad-stage",
        ),
        pytest.param(
            _doc(pools=[{"id": "p", "gpu": "L4", "stage": "decode", "count": 0}]),
            "pools[0].count",
            id="zero-count",
        ),
        pytest.param(
            _doc(pools=[{"id": "p", "gpu": "L4", "stage": "decode", "colour": 1}]),
            "pools[0].colour",
            id="unknown-pool-key",
        ),
        pytest.param(
            _doc(
                pools=[
                    {"id": "p", "gpu": "L4", "stage": "decode"},
                    {"id": "p", "gpu": "L4", "stage": "decode"},
                ]
            ),
            "pools[1].id",
            id="duplicate-pool",
        ),
        pytest.param(
            _doc(pools=[{"id": "p", "gpu": "L4", "stage": "decode", "kv": {"dtype": "fp3"}}]),
            "pools[0].kv.dtype",
            id="bad-dtype",
        ),
        pytest.param(
            _doc(links={"pools": [{"src": "p", "dst": "nowhere", "gbps": 1}]}),
            "links.pools.dst",
            id="link-to-unknown-pool",
        ),
        pytest.param(
            _doc(pools=[{"id": "p", "gpu": "L4", "stage": "both", "kv_connector": "no"}]),
            "pools[0].kv_connector",
            id="kv-connector-not-a-flag",
        ),
        pytest.param(_doc(extra=1), "extra", id="unknown-top-key"),
    ],
)
def test_bad_documents_name_the_key(doc: dict[str, Any], key: str) -> None:
    with pytest.raises(ClusterError) as err:
        parse_cluster(doc)
    assert err.value.key == key


def test_a_pool_without_a_kv_connector_never_takes_or_sends_a_transfer() -> None:
    """Its workers carry the label an agent sets for a connector-less engine; the planner
    then serves a request there whole (same pool), never by a transfer in or out."""
    c = parse_cluster(
        _doc(
            pools=[
                {"id": "p", "gpu": "H100", "count": 1, "stage": "prefill"},
                {"id": "plain", "gpu": "L40S", "count": 1, "stage": "both", "kv_connector": False},
            ]
        )
    )
    assert [p.kv_connector for p in c.pools] == [True, False]
    views = c.worker_views()
    assert views[1].labels == {"pool": "plain", "kv-role": "none"}
    assert views[0].labels == {"pool": "p"}
    fleet = Fleet.build(views, 0.0)
    req = Request(
        request_id="r", model_id=c.model.name, prompt_tokens=2000, expected_output_tokens=50
    )
    decision = Planner(builtin_profile("default")).plan(req, fleet, 0.0, random.Random(1))
    assert decision.plan is not None
    assert decision.plan.decode_worker_id == "plain-0" and decision.plan.mode is Mode.SAME_POOL
    assert all(step.mode is not Mode.TRANSFER for step in decision.fallbacks)
