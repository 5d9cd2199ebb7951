"""`redis_url` forms: a single server, a Sentinel service, and the replication wait."""

from __future__ import annotations

import pytest

from hpd_common.errors import InvalidArgument
from hpd_common.redis_conn import HpdRedis, RedisTarget, connect, parse_url

GOOD = [
    ("redis://127.0.0.1:6380/2", RedisTarget(url="redis://127.0.0.1:6380/2")),
    (
        "rediss://:pw@cache:6380/0?wait_replicas=1",
        RedisTarget(url="rediss://:pw@cache:6380/0", wait_replicas=1),
    ),
    (
        "redis://h:1/0?health_check_interval=3&wait_timeout_ms=100&wait_replicas=2",
        RedisTarget(
            url="redis://h:1/0?health_check_interval=3", wait_replicas=2, wait_timeout_ms=100
        ),
    ),
    (
        "redis+sentinel://s1:26379,s2:26380/hpd",
        RedisTarget(url="", sentinels=(("s1", 26379), ("s2", 26380)), service="hpd"),
    ),
    (
        "rediss+sentinel://app:se%40cret@[::1]:26379/main/3?wait_replicas=1&wait_timeout_ms=200",
        RedisTarget(
            url="",
            sentinels=(("::1", 26379),),
            service="main",
            db=3,
            username="app",
            password="se@cret",
            ssl=True,
            wait_replicas=1,
            wait_timeout_ms=200,
        ),
    ),
]


@pytest.mark.parametrize(("url", "want"), GOOD, ids=[g[0] for g in GOOD])
def test_a_url_parses_to_its_target(url: str, want: RedisTarget) -> None:
    assert parse_url(url) == want


BAD = [
    ("http://h:1/0", "scheme"),
    ("redis+sentinel://s1/hpd", "host:port"),
    ("redis+sentinel://s1:x/hpd", "host:port"),
    ("redis+sentinel://s1:26379", "/<service>"),
    ("redis+sentinel://s1:26379/hpd/zero", "/<service>"),
    ("redis+sentinel://s1:26379/hpd?socket_timeout=3", "unknown"),
    ("redis://h:1/0?wait_replicas=one", "integer"),
    ("redis://h:1/0?wait_replicas=-1", ">= 0"),
]


@pytest.mark.parametrize(("url", "names"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_url_is_refused_naming_the_setting(url: str, names: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_url(url)
    assert err.value.field == "redis_url" and names in str(err.value)


def test_a_wait_longer_than_the_socket_timeout_is_refused() -> None:
    """A WAIT that outlasts the client's read timeout would read as Redis being down."""
    with pytest.raises(InvalidArgument, match="wait_timeout_ms"):
        connect("redis://127.0.0.1:1/0?wait_replicas=1&wait_timeout_ms=900")
    client = connect("redis://127.0.0.1:1/0?wait_replicas=1&wait_timeout_ms=300")
    assert isinstance(client, HpdRedis)
    assert (client.wait_replicas, client.wait_timeout_ms) == (1, 300)


def test_a_sentinel_url_gives_a_sentinel_managed_client() -> None:
    client = connect("redis+sentinel://127.0.0.1:1,127.0.0.1:2/hpd/1?wait_replicas=1")
    pool = client.connection_pool
    assert type(pool).__name__ == "SentinelConnectionPool" and pool.service_name == "hpd"
    assert pool.connection_kwargs["db"] == 1 and client.wait_replicas == 1
