"""The layers of docs/architecture.md point one way: every import of a hetero-pd package
goes to the same package or to a lower layer, never up and never sideways.

Layers, lowest first (a package may import its own layer's package and anything below):

0. the contracts: ``hetero_pd`` (generated code, imports nothing of ours);
1. the foundation: ``hpd_common`` (server runtime, errors, logging, Redis, the shared worker
   model, KV-format rules, the GPU performance model);
2. ``hpd_registry`` (worker state and health rules, and the informer other services follow
   the fleet with);
3. the services built on the registry: ``hpd_scheduler`` and ``hpd_kvbroker`` (siblings:
   neither imports the other; they talk over gRPC);
4. the edges: ``hpd_gateway`` and ``hpd_agent`` (siblings);
5. the tools, each above the one before: ``hpd_sim`` (the simulator), ``hpd_plan`` (the
   capacity planner, which verifies its fleets in the simulator), ``hpd_tools``
   (launchers, the ``hpd`` command, operator tables), ``hpd_fleet`` (the emulated fleet and
   the demo, which start the control plane with ``hpd_tools``).

Two narrower rules: the policy core (``hpd_scheduler.policy``) imports only itself and the
foundation's pure modules, never the rest of its service; the simulator imports only the
policy core of the scheduler. Every import counts: module level, inside a function, under
``TYPE_CHECKING``, absolute or relative.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SERVICES = ROOT / "services"

LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"hetero_pd"}),
    frozenset({"hpd_common"}),
    frozenset({"hpd_registry"}),
    frozenset({"hpd_scheduler", "hpd_kvbroker"}),
    frozenset({"hpd_gateway", "hpd_agent"}),
    frozenset({"hpd_sim"}),
    frozenset({"hpd_plan"}),
    frozenset({"hpd_tools"}),
    frozenset({"hpd_fleet"}),
)
LAYER = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}

POLICY = "hpd_scheduler.policy"
# the policy core's foundation: pure rules and models, no I/O (no logging, Redis or gRPC)
POLICY_FOUNDATION = ("hpd_common.kvformat", "hpd_common.kvchain", "hpd_common.gpus",
                     "hpd_common.perfmodel", "hpd_common.yamlsafe", "hpd_common.native",
                     "hpd_common.errors", "hpd_common.worker_model")  # fmt: skip


def module_name(path: Path) -> str:
    """``services/scheduler/hpd_scheduler/policy/fleet.py`` -> ``hpd_scheduler.policy.fleet``."""
    parts = list(path.relative_to(SERVICES).with_suffix("").parts[1:])
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path) -> set[str]:
    """Every module name ``path`` imports, relative imports resolved."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.add(module)
            # `from pkg import sub` may name a submodule: count it as an import of it too
            names |= {f"{module}.{a.name}" for a in node.names}
    return names


def arrows_up(module: str, names: set[str]) -> list[str]:
    """The imports of ``module`` that break a rule (module docstring), each with why."""
    own = module.split(".")[0]
    bad = []
    for name in sorted(names):
        top = name.split(".")[0]
        if top not in LAYER:
            continue  # the standard library or a third-party package
        if top != own and LAYER[top] > LAYER[own]:
            bad.append(f"{name} (layer {LAYER[top]} above {own}'s {LAYER[own]})")
        elif top != own and LAYER[top] == LAYER[own]:
            bad.append(f"{name} (a sibling of {own} in layer {LAYER[own]})")
        elif module.startswith(POLICY) and top == own and not name.startswith(POLICY):
            bad.append(f"{name} (the policy core imports none of its service)")
        elif (
            module.startswith(POLICY)
            and top != own
            and name != "hpd_common"
            and not name.startswith(POLICY_FOUNDATION)
        ):
            bad.append(f"{name} (the policy core imports only pure foundation modules)")
        elif own == "hpd_sim" and top == "hpd_scheduler" and not name.startswith(POLICY):
            bad.append(f"{name} (the simulator needs only the policy core)")
    return bad


def hand_written() -> list[Path]:
    return sorted(
        p for p in SERVICES.rglob("*.py") if "hetero_pd" not in p.parts and "_native" not in p.parts
    )


def test_every_package_has_a_layer() -> None:
    packages = {p.relative_to(SERVICES).parts[1] for p in hand_written()}
    assert packages <= set(LAYER), f"no layer for {packages - set(LAYER)}: add it to LAYERS"


@pytest.mark.parametrize("path", hand_written(), ids=lambda p: str(p.relative_to(SERVICES)))
def test_imports_point_down(path: Path) -> None:
    bad = arrows_up(module_name(path), imported(path))
    assert not bad, f"{module_name(path)} imports " + "; ".join(bad)


@pytest.mark.parametrize(
    ("module", "name", "why"),
    [
        ("hpd_common.server", "hpd_registry.service", "above"),
        ("hetero_pd.v1.common_pb2", "hpd_common.errors", "above"),
        ("hpd_registry.service", "hpd_scheduler.store", "above"),
        ("hpd_scheduler.service", "hpd_kvbroker.domain", "sibling"),
        ("hpd_kvbroker.service", "hpd_gateway.protocol", "above"),
        ("hpd_gateway.service", "hpd_agent.engines", "sibling"),
        ("hpd_agent.agent", "hpd_tools.up", "above"),
        ("hpd_scheduler.policy.planner", "hpd_scheduler.service", "its service"),
        ("hpd_scheduler.policy.planner", "hpd_common.redis_conn", "pure foundation"),
        ("hpd_scheduler.policy.planner", "hpd_registry.domain", "pure foundation"),
        ("hpd_sim.engine", "hpd_scheduler.store", "policy core"),
        ("hpd_sim.engine", "hpd_fleet.engine", "above"),
        ("hpd_tools.up", "hpd_fleet.demo", "above"),
    ],
)
def test_the_rule_refuses_an_arrow_up(module: str, name: str, why: str) -> None:
    """The checker itself: each of these arrows is one the layers forbid."""
    bad = arrows_up(module, {name})
    assert len(bad) == 1 and why in bad[0], bad


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("hpd_registry.informer", "hpd_common.channels"),
        ("hpd_scheduler.service", "hpd_registry.informer"),
        ("hpd_scheduler.policy.planner", "hpd_scheduler.policy.fleet"),
        ("hpd_scheduler.policy.capacity", "hpd_common.perfmodel"),
        ("hpd_sim.engine", "hpd_scheduler.policy.prefix"),
        ("hpd_fleet.demo", "hpd_tools.controlplane"),
        ("hpd_gateway.control_client", "hetero_pd.v1.scheduler_pb2"),
    ],
)
def test_the_rule_allows_an_arrow_down(module: str, name: str) -> None:
    assert arrows_up(module, {name}) == []


def test_relative_imports_are_resolved(tmp_path: Path) -> None:
    """A relative import is judged by the module it names (here ``hpd_scheduler.service``
    from inside the policy core)."""
    global SERVICES
    saved = SERVICES
    SERVICES = tmp_path
    try:
        f = tmp_path / "scheduler" / "hpd_scheduler" / "policy" / "planner.py"
        f.parent.mkdir(parents=True)
        f.write_text("from ..service import SchedulerService\nfrom .fleet import Fleet\n")
        names = imported(f)
        assert {"hpd_scheduler.service", "hpd_scheduler.policy.fleet"} <= names
        assert arrows_up(module_name(f), names)
    finally:
        SERVICES = saved
