"""`hpd gateway`'s start: a setting it cannot use is refused by name before anything starts."""

from __future__ import annotations

import pytest

from hpd_common.aio import EVENT_LOOP_ENV
from hpd_gateway.__main__ import main


def test_an_unknown_event_loop_is_refused_before_serving(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(EVENT_LOOP_ENV, "trio")
    assert main(["--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpd gateway: ") and "HPD_EVENT_LOOP must be uvloop or asyncio" in err
