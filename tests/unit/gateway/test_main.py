"""`hpd gateway`'s start: a setting it cannot use is refused by name before anything starts."""

from __future__ import annotations

import pathlib

import pytest

from hpd_common.aio import EVENT_LOOP_ENV
from hpd_gateway.__main__ import main


def test_an_unknown_event_loop_is_refused_before_serving(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(EVENT_LOOP_ENV, "trio")
    assert main(["--port", "0", "--scheduler", "127.0.0.1:50052"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpd gateway: ") and "HPD_EVENT_LOOP must be uvloop or asyncio" in err


def test_planning_in_process_needs_the_control_planes_redis(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpd gateway: ") and "--redis-url" in err and "--scheduler" in err


def test_a_scheduler_and_an_embedded_replica_together_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--port", "0", "--scheduler", "127.0.0.1:50052", "--redis-url", "redis://x:6379/0"]
    assert main(argv) == 2
    assert "not both" in capsys.readouterr().err


def test_a_bad_replica_setting_is_named(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "replica.yaml"
    config.write_text("key_prefix: hpd\nreservation_ttl_ms: 0\n")
    argv = ["--port", "0", "--redis-url", "redis://x:6379/0", "--scheduler-config", str(config)]
    assert main(argv) == 2
    assert "reservation_ttl_ms" in capsys.readouterr().err
    config.write_text("no_such_setting: 1\n")
    assert main(argv) == 2
    assert "no_such_setting" in capsys.readouterr().err
