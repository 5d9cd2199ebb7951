"""Ports for real engines: free, never handed out twice, and outside the kernel's ephemeral
range, so that no outgoing connection takes one while its engine is down for a restart."""

from __future__ import annotations

import random
import socket

import pytest

from hpd_fleet import real_processes as real


def test_ports_are_free_distinct_and_outside_the_ephemeral_range() -> None:
    lo, hi = real._ephemeral_range()
    rng = random.Random(3)
    ports = [real.pick_port(rng) for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert not lo <= port <= hi, port
        assert port >= real._LOWEST_PORT
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # still free: nothing kept it


def test_a_port_in_use_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        # the only span outside the "ephemeral range": the held port and the one below it
        monkeypatch.setattr(real, "_ephemeral_range", lambda: (taken + 1, 65_535))
        monkeypatch.setattr(real, "_LOWEST_PORT", taken - 1)
        monkeypatch.setattr(real, "_MIN_SPAN", 1)
        real._HANDED_OUT.discard(taken - 1)
        picks = [real.pick_port(random.Random(seed)) for seed in range(3)]
    # drawn from two ports hundreds of times: the held one is never handed out, the free
    # one once at most (never twice), then the kernel chooses
    assert taken not in picks
    assert picks.count(taken - 1) <= 1


def test_without_room_outside_the_range_the_kernel_chooses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lo, hi = real._ephemeral_range()  # the kernel's own range, where port 0 binds land
    monkeypatch.setattr(real, "_ephemeral_range", lambda: (1024, 65_535))
    port = real.pick_port(random.Random(1))
    assert lo <= port <= hi
