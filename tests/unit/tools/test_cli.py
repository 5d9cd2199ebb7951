"""`hpd` itself: the version, the help, an unknown command."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from hpd_common import native
from hpd_tools.cli import main

HPD = Path(sys.executable).parent / "hpd"


@pytest.mark.parametrize("flag", ["--version", "-V", "version"])
def test_version_names_the_release_and_the_policy_core(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"hpd {version('hetero-pd')} ")
    core = "compiled" if native.status().active else "pure Python"
    assert f"policy core: {core}" in out


def test_the_installed_command_answers_version() -> None:
    done = subprocess.run([str(HPD), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("hpd "), done.stderr


def test_an_unknown_command_is_refused_with_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["teleport"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'teleport'" in err and "hpd --version" in err
