"""The compiled policy core (hpd_common.native): used only while current, and it decides
exactly as the pure-Python modules do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpd_common import native

# Plans a few hundred requests of every tier with every built-in profile on a synthetic
# heterogeneous fleet, taking reservations as it goes (so filters, fallbacks and rejections
# all run), and prints every decision with its explanation bit for bit (floats packed).
_DECISIONS = """
import json, random
from hpd_common import native
from hpd_scheduler.policy import (
    Fleet, Planner, Request, apply_reservations, builtin_profile, builtin_profile_names,
)
from hpd_scheduler.policy.synthetic import synthetic_fleet

def decisions():
    out = []
    for name in builtin_profile_names():
        rng = random.Random(7)
        fleet = Fleet.build(synthetic_fleet(48, rng, 1000.0), 1000.0)
        planner = Planner(builtin_profile(name))
        for i in range(150):
            req = Request(
                request_id=f"r{i}", model_id="llama-3-8b" if i % 10 else "no-such-model",
                prompt_tokens=int(rng.lognormvariate(7.0, 1.2)) + 16,
                expected_output_tokens=int(rng.lognormvariate(5.0, 1.0)) + 1,
                tier=("interactive", "standard", "batch")[i % 3],
            )
            d = planner.plan(req, fleet, 1000.0 + i / 100, rng)
            apply_reservations(fleet, d)
            out.append([name, d.to_dict(), d.record.encode()])
    return {"native": native.status().active, "decisions": out}
"""


def _run(code: str) -> dict[str, object]:
    ns: dict[str, object] = {}
    exec(compile(code, "<decisions>", "exec"), ns)
    result = ns["decisions"]()  # type: ignore[operator]
    assert isinstance(result, dict)
    return result


def test_compiled_and_pure_modules_decide_alike() -> None:
    if not native.status().active:
        pytest.skip(f"compiled modules not in use: {native.status().reason}")
    import hpd_scheduler.policy.planner as planner_module

    assert planner_module.__file__ is not None
    assert planner_module.__file__.endswith(native.ext_suffix())  # really the compiled one
    compiled = _run(_DECISIONS)
    pure_out = subprocess.run(
        [sys.executable, "-c", _DECISIONS + "\nprint(json.dumps(decisions()))"],
        env={**os.environ, native.ENV: "0"},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    pure = json.loads(pure_out.stdout)
    assert compiled["native"] is True and pure["native"] is False
    a, b = compiled["decisions"], pure["decisions"]
    assert isinstance(a, list) and isinstance(b, list)
    assert len(a) == len(b) > 0
    kinds = {x[1]["decision"] for x in b}
    assert {"primary", "reject"} <= kinds, kinds  # accepted and refused paths both ran
    for x, y in zip(a, b, strict=True):
        assert json.dumps(x) == json.dumps(y), (x[0], x[1]["request_id"])


# -- the staleness rules, on a stamp written here -----------------------------------------


MODULES = ("hpd_scheduler.policy.planner", "hpd_scheduler.policy.fleet")


@pytest.fixture(autouse=True)
def _no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native.ENV, raising=False)  # the suite may run under HPD_NATIVE=0


def _stamp(root: Path, **over: object) -> None:
    root.mkdir(parents=True, exist_ok=True)
    stamp: dict[str, object] = {
        "ext_suffix": native.ext_suffix(),
        "sources": {m: native.digest(native.source_of(m)) for m in MODULES},
    }
    stamp.update(over)
    (root / native.STAMP).write_text(json.dumps(stamp))


def test_a_build_matching_every_source_is_current(tmp_path: Path) -> None:
    _stamp(tmp_path)
    st = native.check(tmp_path, MODULES)
    assert st.active, st.reason


def test_no_build_is_not_current(tmp_path: Path) -> None:
    st = native.check(tmp_path / "nothing", MODULES)
    assert not st.active and "not built" in st.reason


def test_an_edited_source_makes_the_whole_build_stale(tmp_path: Path) -> None:
    sources = {m: native.digest(native.source_of(m)) for m in MODULES}
    sources["hpd_scheduler.policy.fleet"] = "0" * 64
    _stamp(tmp_path, sources=sources)
    st = native.check(tmp_path, MODULES)
    assert not st.active and "hpd_scheduler.policy.fleet changed" in st.reason


def test_another_interpreter_or_module_list_is_not_current(tmp_path: Path) -> None:
    _stamp(tmp_path, ext_suffix=".cpython-99-other.so")
    assert "another interpreter" in native.check(tmp_path, MODULES).reason
    _stamp(tmp_path)
    assert "module list" in native.check(tmp_path, MODULES[:1]).reason


def test_a_damaged_stamp_is_not_current(tmp_path: Path) -> None:
    tmp_path.joinpath(native.STAMP).write_text("{not json")
    assert "unreadable" in native.check(tmp_path, MODULES).reason


def test_hpd_native_0_forces_the_pure_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stamp(tmp_path)
    monkeypatch.setenv(native.ENV, "0")
    st = native.check(tmp_path, MODULES)
    assert not st.active and "forced" in st.reason
    # ... which chooses what runs, not whether a build is current
    assert native.check(tmp_path, MODULES, honour_env=False).active


def test_search_path_puts_the_compiled_directory_first_only_when_current() -> None:
    path = ["/src/hpd_scheduler/policy"]
    out = native.search_path("hpd_scheduler.policy", path)
    if native.status().active:
        assert out[0].endswith("hpd_scheduler/policy") and out[1:] == path
    else:
        assert out == path


def test_status_command_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert native.main(["status", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert set(st) == {"active", "reason", "root", "modules"}
    assert st["modules"] == list(native.MODULES)
