"""A run's leftover processes are found by the tag every process it started inherits, and
only those: the caller and its ancestors carry the tag too and are spared."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from hpd_fleet.real_processes import reap


def test_reap_kills_the_tagged_processes_and_spares_the_rest() -> None:
    tag = f"HPD_REAP_TEST={uuid.uuid4().hex}"
    name, value = tag.split("=")
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    tagged = subprocess.Popen(sleeper, env={**os.environ, name: value})
    untagged = subprocess.Popen(sleeper)
    try:
        assert reap(tag) == 1
        assert tagged.wait(timeout=10) != 0
        assert untagged.poll() is None
    finally:
        for p in (tagged, untagged):
            p.kill()
            p.wait()
