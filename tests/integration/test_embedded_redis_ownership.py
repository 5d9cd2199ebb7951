"""One state directory, one Redis: the embedded server dies with its owner (even on
SIGKILL), a second owner is refused, and an orphan is stopped cleanly and replaced with
nothing acknowledged lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from hpd_common.errors import Unavailable
from hpd_tools.embedded_redis import EmbeddedRedis, _is_redis

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux death signal"),
]


def owner_in_child(
    state: Path, die_with_owner: bool
) -> tuple[subprocess.Popen[str], dict[str, int]]:
    """A Python process that starts the embedded Redis, writes a key, and waits."""
    code = textwrap.dedent(
        f"""
        import sys, time, redis
        from pathlib import Path
        from hpd_tools.embedded_redis import EmbeddedRedis
        r = EmbeddedRedis(Path({str(state)!r}), die_with_owner={die_with_owner}).start()
        redis.Redis.from_url(r.url).set("acknowledged", "yes")
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    doc = json.loads((state / "owner.json").read_text())
    return proc, doc


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _is_redis(pid):
            return True
        time.sleep(0.05)
    return False


def test_the_server_dies_when_its_owner_is_sigkilled(tmp_path: Path) -> None:
    owner, doc = owner_in_child(tmp_path, die_with_owner=True)
    assert _is_redis(doc["redis_pid"])
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert wait_gone(doc["redis_pid"]), "the embedded Redis outlived its owner"


def test_an_orphan_is_stopped_and_replaced_with_its_data(tmp_path: Path) -> None:
    owner, doc = owner_in_child(tmp_path, die_with_owner=False)  # as without the signal
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    orphan = doc["redis_pid"]
    assert _is_redis(orphan)
    try:
        with EmbeddedRedis(tmp_path) as again:
            assert not _is_redis(orphan)  # one Redis on the directory, not two
            assert redis.Redis.from_url(again.url).get("acknowledged") == b"yes"
    finally:
        if _is_redis(orphan):
            os.kill(orphan, signal.SIGKILL)


def test_a_second_owner_of_a_live_server_is_refused(tmp_path: Path) -> None:
    owner, doc = owner_in_child(tmp_path, die_with_owner=True)
    try:
        with pytest.raises(Unavailable) as err:
            EmbeddedRedis(tmp_path).start()
        assert f"pid {owner.pid}" in str(err.value) and str(tmp_path) in str(err.value)
        assert _is_redis(doc["redis_pid"])  # untouched
    finally:
        owner.kill()
        owner.wait()
        wait_gone(doc["redis_pid"])
