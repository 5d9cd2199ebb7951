"""Stopping background tasks: ``cancel_and_wait``, and no ``asyncio.wait_for`` in the
services (on Python 3.11 it can swallow a cancellation, which hung shutdowns in CI)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
from pathlib import Path

import pytest

from hpd_common import aio
from hpd_common.aio import cancel_and_wait

SERVICES = Path(__file__).resolve().parents[3] / "services"


async def test_a_task_that_absorbs_one_cancel_is_cancelled_again() -> None:
    async def absorbs_once() -> None:
        # what wait_for does on 3.11 when its inner awaitable finished meanwhile
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(30)
        await asyncio.sleep(30)

    task = asyncio.create_task(absorbs_once())
    await asyncio.sleep(0)
    assert await cancel_and_wait([task], timeout_s=3)
    assert task.cancelled()


async def test_a_task_that_never_stops_is_given_up_on_after_the_bound() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert not await cancel_and_wait([task], timeout_s=0.3)
    assert 0.3 <= loop.time() - start < 2.0
    assert not task.done()
    release.set()
    task.cancel()
    await asyncio.wait([task], timeout=2)
    assert task.done()


async def test_finished_tasks_and_no_tasks_return_at_once() -> None:
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    assert await cancel_and_wait([done])
    assert await cancel_and_wait([])


async def test_a_task_gets_time_for_its_own_cleanup() -> None:
    """The first cancel is not repeated while the task is cleaning up (closing a channel, a
    pub/sub connection): cleanup shorter than the grace period runs to its end."""
    cleaned = asyncio.Event()

    async def tidy() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.3)
            cleaned.set()

    task = asyncio.create_task(tidy())
    await asyncio.sleep(0)
    assert await cancel_and_wait([task], timeout_s=3)
    assert cleaned.is_set()


async def test_an_exception_a_task_ends_with_is_retrieved() -> None:
    async def fails_on_cancel() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    task = asyncio.create_task(fails_on_cancel())
    await asyncio.sleep(0)
    assert await cancel_and_wait([task], timeout_s=2)
    assert isinstance(task.exception(), RuntimeError)
    assert task._log_traceback is False  # retrieved: no "never retrieved" report at GC


def test_services_use_asyncio_timeout_not_wait_for() -> None:
    offenders = [
        f"{path.relative_to(SERVICES)}:{n}"
        for path in sorted(SERVICES.rglob("*.py"))
        if "hetero_pd" not in path.parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bwait_for\(", line)
    ]
    assert offenders == []


# -- the event loop a process runs on -----------------------------------------------------------


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_run_uses_uvloop_unless_asked_for_the_standard_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(aio.EVENT_LOOP_ENV, raising=False)
    assert aio.event_loop() == "uvloop"
    assert aio.run(_loop_module()).startswith("uvloop")
    monkeypatch.setenv(aio.EVENT_LOOP_ENV, "asyncio")
    assert aio.event_loop() == "asyncio"
    assert aio.run(_loop_module()).startswith("asyncio")
    monkeypatch.setenv(aio.EVENT_LOOP_ENV, " UVLOOP ")
    assert aio.run(_loop_module()).startswith("uvloop")


def test_an_unknown_event_loop_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(aio.EVENT_LOOP_ENV, "trio")
    with pytest.raises(ValueError, match="HPD_EVENT_LOOP must be uvloop or asyncio, got 'trio'"):
        aio.event_loop()


def test_without_uvloop_the_standard_loop_runs_unless_uvloop_was_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    monkeypatch.delenv(aio.EVENT_LOOP_ENV, raising=False)
    assert aio.run(_loop_module()).startswith("asyncio")
    monkeypatch.setenv(aio.EVENT_LOOP_ENV, "uvloop")
    with pytest.raises(ImportError):
        aio.run(_loop_module())
