"""`hpd plan` end to end on a short trace: the cluster file it writes loads with the
simulator's loader, and `hpd sim --cluster FILE` reproduces the attainment it predicted."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpd_common import perfmodel
from hpd_plan import cli
from hpd_plan.catalogue import parse_catalogue
from hpd_plan.verify import cluster_doc
from hpd_sim import cli as sim_cli
from hpd_sim import load_cluster
from hpd_sim.cli import default_trace_path

LLAMA8 = perfmodel.model_spec("llama-3-8b")


@pytest.fixture
def gpus(tmp_path: Path) -> Path:
    path = tmp_path / "gpus.yaml"
    path.write_text(
        "gpus:\n"
        "  - {name: H100-SXM, available: 4}\n"
        "  - {name: A100-80G, price_per_hour: 3.0, available: 4}\n"
        "  - {name: L40S}\n"
        "  - {name: acme-x1, peak_tflops: 400, hbm_gbps: 1600, hbm_gib: 64, price_per_hour: 2.2}\n"
    )
    return path


def test_the_cluster_file_loads_with_the_simulators_loader(tmp_path: Path) -> None:
    raw = [
        {"name": "H100-SXM", "price_per_hour": 5.0},
        {"name": "acme-x1", "peak_tflops": 400, "hbm_gbps": 1600, "hbm_gib": 64},
    ]
    raw[1] |= {"price_per_hour": 2.2, "learned": {"decode_scale": 1.3}, "tp": [1, 2]}
    cat = parse_catalogue(raw, LLAMA8)
    pools = {
        ("H100-SXM", 1, "prefill"): 2,
        ("acme-x1", 1, "decode"): 3,
        ("acme-x1", 2, "decode"): 1,
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cluster_doc(pools, cat, LLAMA8, "p")))
    spec = load_cluster(path)
    by_id = {p.pool_id: p for p in spec.pools}
    assert set(by_id) == {"h100-sxm-prefill", "acme-x1-decode-tp1", "acme-x1-decode-tp2"}
    assert (
        by_id["h100-sxm-prefill"].count == 2 and by_id["h100-sxm-prefill"].price_per_gpu_hour == 5.0
    )
    acme = by_id["acme-x1-decode-tp2"]
    assert acme.tp == 2 and acme.gpu.hbm_gbps == 1600 and acme.decode_scale == 1.3
    assert spec.price_per_hour == pytest.approx(2 * 5.0 + 5 * 2.2)


def _attainment_of_recheck(cmd: str, capsys: pytest.CaptureFixture[str]) -> float:
    """Run a printed `hpd sim ... --json   # .policies[0]...per_tier.T` command in-process."""
    line, _, path = cmd.partition("   # ")
    argv = shlex.split(line)[2:]
    assert sim_cli.main([*argv, "--no-progress"]) == 0
    doc: Any = json.loads(capsys.readouterr().out)
    tier = path.rsplit(".", 1)[1]
    return float(doc["policies"][0]["points"][0]["slo_attainment_per_tier"][tier])


def test_a_plan_on_a_short_trace_is_confirmed_by_hpd_sim(
    gpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.yaml"
    argv = ["--trace", str(default_trace_path()), "--max-requests", "300", "--rate-scale", "3"]
    argv += ["--gpus", str(gpus), "--tier", "interactive=1,standard=1", "--out", str(out)]
    assert cli.main([*argv, "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "ok" and doc["cluster_file"] == str(out)
    assert doc["price_per_hour"] == pytest.approx(load_cluster(out).price_per_hour)
    assert {r["role"] for r in doc["fleet"]} <= {"prefill", "decode", "both"}
    assert all(r["why"] for r in doc["fleet"])
    predicted = {t: a["attainment"] for t, a in doc["attainment"].items()}
    assert set(predicted) == {"interactive", "standard"}
    assert min(predicted.values()) >= 0.9
    assert len(doc["recheck"]) == 2
    for cmd in doc["recheck"]:
        tier = cmd.rsplit(".", 1)[1]
        assert _attainment_of_recheck(cmd, capsys) == pytest.approx(predicted[tier], abs=0.05)


def test_the_table_names_each_pool_and_the_check(
    gpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(["--rate", "2", "--mix", "800:100", "--requests", "150", "--gpus", str(gpus)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "verified in the simulator" in captured.out and "total" in captured.out
    assert "--save-trace" in captured.out  # how to re-check a --mix plan
    assert "round 1 fleet 1/" in captured.err  # the progress line


def test_infeasible_says_what_binds_and_the_best_reachable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpus = tmp_path / "few.yaml"
    gpus.write_text("gpus:\n  - {name: L4, available: 1}\n")
    argv = ["--rate", "20", "--mix", "2000:200", "--requests", "200", "--gpus", str(gpus)]
    assert cli.main([*argv, "--tier", "standard", "--json", "--no-progress"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "infeasible"
    assert doc["infeasible"]["binding"] == "availability"
    assert 0 < doc["infeasible"]["traffic_share"] < 1
    assert doc["fleet"] and doc["attainment"]["standard"]["attainment"] < 0.9


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--tier", "gold"], "--slo gold:"),
        (["--slo", "ttft=1"], "both ttft and tpot"),
        (["--headroom", "1.5"], "--headroom"),
        (["--model", "gpt-9"], "unknown model"),
    ],
)
def test_bad_input_exits_2_with_the_reason(
    gpus: Path, extra: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--rate", "1", "--mix", "100:10", "--gpus", str(gpus), *extra]
    assert cli.main(argv) == 2
    assert words in capsys.readouterr().err


def test_without_the_solver_it_says_how_to_install_it(
    gpus: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "highspy", None)
    assert cli.main(["--rate", "1", "--mix", "100:10", "--gpus", str(gpus)]) == 2
    assert "pip install 'hetero-pd[planner]'" in capsys.readouterr().err


def test_help_teaches_with_an_example() -> None:
    text = cli.build_parser().format_help()
    assert "hpd plan --trace" in text and "--gpus" in text and "gpus:" in text
