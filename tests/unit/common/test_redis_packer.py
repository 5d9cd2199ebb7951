"""The C command packer writes exactly the bytes redis-py's own asyncio packer writes."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st
from redis.exceptions import DataError, OutOfMemoryError, ReadOnlyError, ResponseError

from hpd_common.redis_conn import STORE_DOWN, connect, with_c_packer

PLAIN = aioredis.Connection()
packed = connect("redis://127.0.0.1:1/0").connection_pool.make_connection()


def wire(conn: aioredis.Connection, *args: object) -> bytes:
    return b"".join(conn.pack_command(*args))


CASES = [
    ("EVALSHA", "0" * 40, 5, "k1", "k2", "k3", "k4", "k5", 1_795_976_913_222, "sid", ""),
    ("HSET", b"key", b"f", b"\x00\xff binary"),
    ("CONFIG GET", "maxmemory"),  # a command name with a space is split, as redis-py does
    (b"CLIENT SETNAME", b"x"),
    ("SET", "k", "é ü 漢字"),
    ("ZADD", "z", 0.1, "a", 1e20, "b", -3.5, "c", float("inf"), "d", 1 / 3, "e"),
    ("SET", "k", -(2**62)),
    ("SET", "big", b"v" * 20_000),  # above redis-py's buffer cutoff: it chunks, bytes equal
]


@pytest.mark.parametrize("args", CASES)
def test_same_bytes_as_redis_py(args: tuple[object, ...]) -> None:
    assert wire(packed, *args) == wire(PLAIN, *args)


@given(
    st.lists(
        st.one_of(
            st.text(max_size=30),
            st.binary(max_size=30),
            st.integers(min_value=-(2**63), max_value=2**63 - 1),
            st.floats(allow_nan=False),
        ),
        max_size=12,
    )
)
def test_same_bytes_for_any_arguments(rest: list[object]) -> None:
    assert wire(packed, "EVALSHA", *rest) == wire(PLAIN, "EVALSHA", *rest)


@pytest.mark.parametrize("bad", [True, None, object()])
def test_what_redis_py_refuses_is_refused_the_same_way(bad: object) -> None:
    with pytest.raises(DataError):
        wire(PLAIN, "SET", "k", bad)
    with pytest.raises(DataError):
        wire(packed, "SET", "k", bad)


def test_every_connection_kind_gets_the_packer_once() -> None:
    kinds = {
        "redis://127.0.0.1:1/0": aioredis.Connection,
        "unix:///nonexistent/redis.sock": aioredis.UnixDomainSocketConnection,
        "rediss://127.0.0.1:1/0": aioredis.SSLConnection,
    }
    for url, kind in kinds.items():
        client = connect(url)
        cls = client.connection_pool.connection_class
        assert issubclass(cls, kind) and cls.pack_command is not kind.pack_command
        assert with_c_packer(client).connection_pool.connection_class is cls  # idempotent


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        (
            "Error running script (call to f_0): @user_script:72: @user_script: 72: "
            "-OOM command not allowed when used memory > 'maxmemory'.",
            OutOfMemoryError,
        ),
        (
            "Error running script (call to f_0): @user_script:3: @user_script: 3: "
            "-READONLY You can't write against a read only replica.",
            ReadOnlyError,
        ),
        ("Error running script (call to f_0): @user_script:9: attempt to index nil", None),
    ],
)
async def test_a_write_refused_inside_a_script_is_that_refusal(
    message: str, kind: type[Exception] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis wraps a write refused inside a script in a script error; it must read as the
    refusal (a store then answers UNAVAILABLE), while a real script error stays one."""

    async def refused(self: object, *args: object, **kwargs: object) -> object:
        raise ResponseError(message)

    monkeypatch.setattr(aioredis.Connection, "read_response", refused)
    conn = connect("redis://127.0.0.1:1/0").connection_pool.make_connection()
    with pytest.raises(ResponseError) as err:
        await conn.read_response()
    assert type(err.value) is (kind or ResponseError)
    assert isinstance(err.value, STORE_DOWN) == (kind is not None)
