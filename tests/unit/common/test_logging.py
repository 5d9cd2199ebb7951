"""Log lines go to the process's stderr as it is at each write, and a stream that cannot
take them (closed, its reader gone) costs the line, never the caller (hpd_common.logging)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest

from hpd_common import logging as hpd_logging
from hpd_common.logging import configure_logging, get_logger


@pytest.fixture(autouse=True)
def suite_logging() -> Iterator[None]:
    yield
    configure_logging("warning", json_logs=False)  # as tests/conftest.py has it


def test_lines_go_to_stderr_as_it_is_when_written(monkeypatch: pytest.MonkeyPatch) -> None:
    configure_logging("info", json_logs=True)
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    get_logger("t").info("one", n=1)
    monkeypatch.setattr("sys.stderr", second)
    get_logger("t").info("two", n=2)
    assert json.loads(first.getvalue())["event"] == "one"
    assert json.loads(second.getvalue())["n"] == 2


def test_a_closed_stream_drops_the_line_instead_of_raising(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    configure_logging("info", json_logs=True)
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr("sys.stderr", closed)
    before = hpd_logging._Stderr.dropped
    get_logger("t").warning("round_failed", error="the log pipe is gone too")
    assert hpd_logging._Stderr.dropped > before
