"""A local user without the state store's password: the embedded Redis ``hpd up`` runs
refuses them (it had no password: anyone on the machine could rewrite credentials, tokens'
effects and reservations), and the password is nowhere another user can read it."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import redis

from hpd_tools.embedded_redis import EmbeddedRedis
from hpd_tools.up import PASSWORD_FILE, redis_password


def test_the_embedded_redis_refuses_a_client_without_its_password(tmp_path: Path) -> None:
    state = tmp_path / "redis"
    password = redis_password(state)
    assert redis_password(state) == password  # kept across restarts
    assert stat.S_IMODE((state / PASSWORD_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    with EmbeddedRedis(state, persist=False, password=password) as server:
        stranger = redis.Redis(port=server.port)
        with pytest.raises(redis.AuthenticationError):
            stranger.set("hpd:{reg}:w:victim", "mine")
        stranger.close()
        owner = redis.Redis.from_url(server.url)
        assert owner.ping()
        owner.close()
        assert server.pid is not None
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline  # ps shows every user the command line
