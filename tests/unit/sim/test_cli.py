"""`hpd sim` end to end on a small slice (in-process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpd_sim import cli
from hpd_sim.cli import main
from hpd_sim.roles import DEPLOYMENTS, Advice, deployment
from hpd_sim.suite import cluster_path


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


def test_advise_names_each_deployment_and_the_one_with_the_most_goodput(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--advise", "--trace", "synthetic:long_prompts", "--max-requests", "400"]
    argv += ["--cluster", str(cluster_path("slow_link")), "--tolerance", "0.25"]
    argv += ["--slo", "ttft=3000,tpot=100", "--tier", "standard", "--start-scale", "4"]
    assert main([*argv, "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    goodput = doc["sample_goodput_rps"]
    assert set(goodput) == {"as_declared", "both_stages", "colocated", "colocated_weights"}
    assert goodput[doc["deployment"]] == max(g for g in goodput.values() if g is not None)
    # long prompts' KV would cross a 10 Gb/s pipe to most of the decode GPUs
    assert doc["deployment"] != "as_declared"
    assert main([*argv, "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert f"-> {doc['deployment']}" in text and "--role both" in text


def test_advice_to_route_by_weights_names_the_profile_to_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen = deployment("colocated_weights")
    goodput: dict[str, float | None] = {d.name: 1.0 for d in DEPLOYMENTS}
    goodput[chosen.name] = 2.0
    monkeypatch.setattr(cli, "advise", lambda *a, **k: Advice(chosen, goodput, {}, 400))
    argv = ["--advise", "--trace", "synthetic:long_prompts", "--max-requests", "50"]
    assert main([*argv, "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "-> colocated_weights" in text and "HPD_PROFILE=colocated" in text


def test_advise_refuses_an_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--advise", "--policy", "nope", "--max-requests", "50"]) == 2
    assert "unknown policy" in capsys.readouterr().err
