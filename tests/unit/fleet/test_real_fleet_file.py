"""Fleet files for real engines (hpd_fleet.real_fleet): the shipped ones load, a bad one
names its offending key; and CPU quotas (hpd_fleet.cgroups) put a process in a group of
its own with the quota set, and leave nothing behind."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from hpd_fleet.cgroups import PERIOD_US, CgroupUnavailable, CpuQuota, cgroup_root, remove_stale
from hpd_fleet.real_fleet import FleetError, load_fleet, parse_fleet

BENCH_FLEETS = Path(__file__).resolve().parents[3] / "bench" / "fleets"


@pytest.mark.parametrize("path", sorted(BENCH_FLEETS.glob("*.yaml")), ids=lambda p: p.name)
def test_the_shipped_fleet_files_load(path: Path) -> None:
    fleet = load_fleet(path)
    assert fleet.engines
    # every agent declares the same figures: only measurement tells the engines apart
    assert fleet.declare.gpu_type


def test_the_default_fleet_is_unequal_and_leaves_cpu_for_the_rest() -> None:
    fleet = load_fleet(BENCH_FLEETS / "unequal.yaml")
    quotas = [e.cpu_quota for e in fleet.engines]
    assert len(set(quotas)) == len(quotas)  # every engine at its own speed
    assert sum(quotas) <= 1.5  # of two cores
    assert not fleet.disaggregated


def _doc(**engine: Any) -> dict[str, Any]:
    return {"engines": [{"name": "e1", **engine}]}


@pytest.mark.parametrize(
    ("doc", "key"),
    [
        pytest.param({"engines": []}, "engines", id="no-engines"),
        pytest.param(_doc(role="prefill"), "engines[0].connector", id="prefill-without-nixl"),
        pytest.param(_doc(cpu_quota=-1), "engines[0].cpu_quota", id="negative-quota"),
        pytest.param(_doc(kv_cache_gib=0.5), "engines[0].kv_cache_gib", id="fractional-gib"),
        pytest.param(_doc(cores="0-999"), "engines[0].cores", id="no-such-cpu"),
        pytest.param(_doc(dtype="int4"), "engines[0].dtype", id="bad-dtype"),
        pytest.param(_doc(colour="red"), "engines[0].colour", id="unknown-key"),
        pytest.param({"engines": [{"name": "Bad Name"}]}, "engines[0].name", id="bad-name"),
        pytest.param({"engines": [{"name": "a"}, {"name": "a"}]}, "engines", id="repeated-name"),
        pytest.param(
            {"engines": [{"name": "p", "role": "prefill", "connector": "nixl"}]},
            "engines",
            id="no-decode-side",
        ),
        pytest.param({**_doc(), "declare": {"hbm_gbps": 0}}, "declare.hbm_gbps", id="bad-declare"),
    ],
)
def test_a_bad_fleet_file_names_its_key(doc: dict[str, Any], key: str) -> None:
    with pytest.raises(FleetError) as err:
        parse_fleet(doc)
    assert err.value.key == key


def test_a_fleet_file_that_is_not_yaml_says_so(tmp_path: Path) -> None:
    bad = tmp_path / "f.yaml"
    bad.write_text("engines: [\n")
    with pytest.raises(FleetError, match="invalid YAML"):
        load_fleet(bad)
    with pytest.raises(FleetError, match="cannot read"):
        load_fleet(tmp_path / "missing.yaml")


def _cgroups() -> None:
    try:
        cgroup_root()
    except CgroupUnavailable as exc:
        pytest.skip(str(exc))


def test_a_cpu_quota_holds_its_process_and_leaves_nothing_behind() -> None:
    _cgroups()
    q = CpuQuota("unit-test", 0.1)
    spin = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass\n"
    proc = subprocess.Popen(q.wrap(["python3", "-c", spin]))
    try:
        path = q.path
        assert path is not None and path.is_dir()
        deadline = time.monotonic() + 5
        while str(proc.pid) not in (path / "cgroup.procs").read_text().split():
            assert time.monotonic() < deadline, "the process never joined its group"
            time.sleep(0.01)
        proc.wait(timeout=60)
        # a process that wants a whole core under a tenth of one is held back
        assert q.throttled_s() > 0
    finally:
        proc.kill()
        proc.wait()
        q.remove()
    assert q.path is None and not path.exists()


def test_an_engine_can_start_unlimited_and_be_limited_once_up() -> None:
    _cgroups()
    q = CpuQuota("unit-test-late", 0.5)
    path = q.create(limited=False)
    try:
        files = {f.name for f in path.iterdir()}
        if "cpu.cfs_quota_us" in files:
            assert (path / "cpu.cfs_quota_us").read_text().strip() == "-1"
            q.limit()
            assert (path / "cpu.cfs_quota_us").read_text().strip() == str(PERIOD_US // 2)
        else:
            assert (path / "cpu.max").read_text().split()[0] == "max"
            q.limit()
            assert (path / "cpu.max").read_text().split()[0] == str(PERIOD_US // 2)
    finally:
        q.remove()


def test_groups_of_runs_that_are_gone_are_removed() -> None:
    _cgroups()
    root, _ = cgroup_root()
    q = CpuQuota("unit-test-stale", 0.5)
    path = q.create()
    stale = path.with_name("unit-test-stale-999999999-1")  # no such process
    path.rename(stale)
    assert remove_stale() >= 1
    assert not stale.exists()
    parent = root / "hetero-pd"
    left = [p.name for p in parent.iterdir() if p.is_dir()] if parent.exists() else []
    assert not [n for n in left if n.startswith("unit-test-stale")]
