"""One home per concept (docs/architecture.md, "Where each concept lives"): the worker
model's types are defined once, in ``hpd_common.worker_model``, and every layer (agent,
registry, informer, planner, simulator, emulated fleet) uses that one definition; a second
class of the same name anywhere in the hand-written code fails here."""

from __future__ import annotations

import ast
import random

import pytest

from tests.unit.project.test_layers import hand_written, module_name

HOME = "hpd_common.worker_model"
SHARED = ("WorkerSpec", "LoadReport", "NetworkLocation", "Health")


def _classes() -> dict[str, list[str]]:
    """Class name -> the modules that define a class of that name (top level)."""
    found: dict[str, list[str]] = {}
    for path in hand_written():
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(module_name(path))
    return found


@pytest.mark.parametrize("name", SHARED)
def test_the_worker_model_is_defined_once(name: str) -> None:
    assert _classes().get(name) == [HOME]


def test_the_planner_and_the_registry_use_the_same_types() -> None:
    from hetero_pd.v1 import common_pb2 as c
    from hpd_common import worker_model
    from hpd_registry import convert
    from hpd_scheduler import policy
    from hpd_scheduler.policy.synthetic import synthetic_fleet

    assert type(convert.load_from_pb(c.LoadReport())) is worker_model.LoadReport
    assert policy.LoadReport is worker_model.LoadReport
    assert policy.Health is worker_model.Health
    view = synthetic_fleet(2, random.Random(1))[0]
    assert type(view.spec) is worker_model.WorkerSpec
    assert view.worker_id == view.spec.worker_id and view.network is view.spec.network


def test_the_id_rule_has_one_home() -> None:
    """Every id a caller gives (worker, pool, request, session, replica) is checked by
    ``hpd_common.ids``: no other module spells the rule's pattern again."""
    home = "hpd_common.ids"
    spelled = [
        module_name(path)
        for path in hand_written()
        if "A-Za-z0-9._:" in path.read_text() and "{1,128}" in path.read_text()
    ]
    assert spelled == [home], spelled
