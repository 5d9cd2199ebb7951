"""`hpd sim` end to end on a small slice (in-process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpd_sim.cli import main


def test_json_run_of_two_policies(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = main(
        [
            "--max-requests",
            "120",
            "--policy",
            "ours,colocated",
            "--rate-scale",
            "2",
            "--json",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in doc["policies"]] == ["ours", "colocated"]
    point = doc["policies"][0]["points"][0]
    assert point["requests"] == 120 and point["rate_scale"] == 2.0
    assert 0.0 <= point["slo_attainment"] <= 1.0
    assert doc["fluid_bound"]["rps"] > 0
    assert (tmp_path / "sim.json").is_file()


def test_goodput_search_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "--max-requests",
            "80",
            "--policy",
            "least_loaded",
            "--search-goodput",
            "--tolerance",
            "0.5",
            "--start-scale",
            "4",
            "--no-progress",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "goodput req/s" in out and "fluid bound" in out


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--policy", "nonesuch"], id="unknown-policy"),
        pytest.param(["--slo", "ttft=5"], id="bad-slo"),
        pytest.param(["--cluster", "/nonexistent.yaml"], id="missing-cluster"),
        pytest.param(["--trace", "synthetic:nonesuch"], id="unknown-synthetic-workload"),
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--max-requests", "10", "--no-progress"]) == 2
    assert "hpd sim:" in capsys.readouterr().err


def test_a_synthetic_workload_runs_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        ["--trace", "synthetic:long_prompts", "--max-requests", "60", "--json", "--no-progress"]
    )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["trace"]["name"] == "synthetic:long_prompts" and doc["trace"]["requests"] == 60
    assert doc["trace"]["mean_rate_rps"] > 0
