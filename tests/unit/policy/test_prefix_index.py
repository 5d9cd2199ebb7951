"""The block-chain hash and the KV block index (hpd_scheduler.policy.prefix)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpd_scheduler.policy.prefix import PrefixIndex, cached_tokens, chain_hashes, matched_blocks

TOKENS = list(range(1000, 1000 + 600))


def test_the_same_tokens_give_the_same_chain_and_only_full_blocks_are_hashed() -> None:
    a = chain_hashes(TOKENS, 128)
    assert a == chain_hashes(list(TOKENS), 128)
    assert len(a) == 4  # 600 tokens: 4 full blocks of 128, the partial fifth is not hashed
    assert len(set(a)) == 4
    assert chain_hashes(TOKENS[:127], 128) == ()
    assert chain_hashes(TOKENS[:512], 128) == a  # the shared first 512 tokens: same keys


@pytest.mark.parametrize("changed", [0, 130, 300, 511])
def test_a_changed_token_changes_its_block_and_every_later_one(changed: int) -> None:
    a = chain_hashes(TOKENS, 128)
    other = list(TOKENS)
    other[changed] += 1
    b = chain_hashes(other, 128)
    first = changed // 128
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:], strict=True))


def test_a_block_is_keyed_by_its_whole_prefix_not_its_contents() -> None:
    block = list(range(128))
    one = chain_hashes([7] * 128 + block, 128)
    two = chain_hashes([8] * 128 + block, 128)
    assert one[1] != two[1]  # the same block after different prefixes


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        chain_hashes(TOKENS, 0)


def test_the_match_stops_at_the_first_missing_block() -> None:
    chain = (1, 2, 3, 4)
    assert matched_blocks(chain, {1, 2, 4}) == 2
    assert matched_blocks(chain, {2, 3, 4}) == 0
    assert cached_tokens(chain, {1, 2, 3, 4}, 128, 512) == 511  # at least one token computed
    assert cached_tokens(chain, {1, 2}, 128, 600) == 256
    assert cached_tokens(chain, None, 128, 600) == 0


def test_the_index_under_stored_removed_and_cleared_events() -> None:
    ix = PrefixIndex()
    chain = chain_hashes(TOKENS, 128)
    ix.stored("p0", chain)
    held = ix.held("p0")
    assert held is not None and matched_blocks(chain, held) == 4
    ix.removed("p0", chain[2:3])
    assert matched_blocks(chain, held) == 2
    ix.cleared("p0")
    assert matched_blocks(chain, held) == 0 and ix.held("p0") is not None
    ix.stored("p0", chain)
    ix.forget("p0")  # the worker's lease ran out
    assert ix.held("p0") is None and ix.workers() == []


def test_memory_is_bounded_per_worker_and_a_chain_loses_its_tail_first() -> None:
    ix = PrefixIndex(default_max_blocks=6)
    old = chain_hashes(TOKENS, 128)  # 4 blocks
    ix.stored("d0", old)
    new = chain_hashes([5] * 512, 128)  # 4 more: 2 must go
    ix.stored("d0", new)
    assert ix.size("d0") == 6 and ix.evicted == 2
    held = ix.held("d0")
    assert held is not None
    assert matched_blocks(new, held) == 4
    assert matched_blocks(old, held) == 2  # the old chain's head survived, its tail went
    ix.set_capacity("d0", 3)
    assert ix.size("d0") == 3


def test_a_match_keeps_a_prefix_recent() -> None:
    ix = PrefixIndex(default_max_blocks=4)
    a, b = chain_hashes(TOKENS[:256], 128), chain_hashes([9] * 256, 128)
    ix.stored("w", a)
    ix.stored("w", b)
    ix.touch("w", a, 2)  # a was matched: b is now the older
    ix.stored("w", chain_hashes([3] * 256, 128))
    held = ix.held("w")
    assert held is not None and matched_blocks(a, held) == 2 and matched_blocks(b, held) == 0


events = st.lists(
    st.tuples(
        st.sampled_from(["stored", "removed", "cleared", "forget"]),
        st.sampled_from(["w1", "w2"]),
        st.lists(st.integers(0, 30), max_size=6),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(events, st.integers(1, 12))
def test_the_index_never_reports_a_removed_block(
    seq: list[tuple[str, str, list[int]]], cap: int
) -> None:
    """Against a model that holds exactly what was stored and not removed since: the index
    may hold less (its memory bound), never more."""
    ix = PrefixIndex(default_max_blocks=cap)
    model: dict[str, set[int]] = {}
    for kind, w, keys in seq:
        if kind == "stored":
            ix.stored(w, keys)
            model.setdefault(w, set()).update(keys)
        elif kind == "removed":
            ix.removed(w, keys)
            model.get(w, set()).difference_update(keys)
        elif kind == "cleared":
            ix.cleared(w)
            model.get(w, set()).clear()
        else:
            ix.forget(w)
            model.pop(w, None)
        for worker in ("w1", "w2"):
            held = ix.held(worker)
            have = set(held) if held is not None else set()  # type: ignore[call-overload]
            assert have <= model.get(worker, set())
            assert len(have) <= cap
