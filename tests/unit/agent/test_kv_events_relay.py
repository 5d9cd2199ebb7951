"""Decoding vLLM's KV cache events into hetero-pd chain keys (hpd_agent.kv_events), from
payloads shaped as vLLM publishes them (msgpack arrays tagged with the event kind)."""

from __future__ import annotations

from typing import Any

import msgpack

from hpd_agent.kv_events import VllmKvDecoder
from hpd_common.kvchain import chain_hashes

TOKENS = list(range(100, 100 + 4 * 16))  # 4 blocks of 16


def stored(hashes: list[int], parent: int | None, tokens: list[int], size: int = 16) -> list[Any]:
    return ["BlockStored", hashes, parent, tokens, size, None, "GPU"]


def frames(seq: int, *events: Any) -> list[bytes]:
    payload = msgpack.packb([1733000000.0, list(events), 0])
    return [b"kv", seq.to_bytes(8, "big"), payload]


def test_stored_blocks_are_keyed_by_our_chain_not_the_engines_hashes() -> None:
    d = VllmKvDecoder()
    got = d.message(frames(0, stored([901, 902], None, TOKENS[:32])))
    assert got == [("h", list(chain_hashes(TOKENS[:32], 16)))]  # "h": from a prompt's start
    # a later event continues the chain from the engine's parent hash
    got = d.message(frames(1, stored([903, 904], 902, TOKENS[32:])))
    assert got == [("s", list(chain_hashes(TOKENS, 16)[2:]))]
    assert d.block_tokens == 16


def test_removed_and_cleared_blocks_map_back_to_our_keys() -> None:
    d = VllmKvDecoder()
    d.message(frames(0, stored([1, 2, 3, 4], None, TOKENS)))
    keys = chain_hashes(TOKENS, 16)
    assert d.message(frames(1, ["BlockRemoved", [4, 3], "GPU"])) == [("r", [keys[3], keys[2]])]
    assert d.message(frames(2, ["BlockRemoved", [77], "GPU"])) == []  # never seen: nothing
    assert d.message(frames(3, ["AllBlocksCleared"])) == [("c", [])]
    # after a clear, a child of a block from before cannot be keyed: skipped, not guessed
    assert d.message(frames(4, stored([5], 2, TOKENS[:16]))) == []
    assert d.skipped == 1


def test_a_gap_in_the_sequence_clears_everything() -> None:
    d = VllmKvDecoder()
    d.message(frames(0, stored([1], None, TOKENS[:16])))
    got = d.message(frames(5, stored([2], 1, TOKENS[16:32])))
    assert got == [("c", [])]  # lost messages: start over; the child's parent is gone too
    assert d.gaps == 1


def test_garbage_is_counted_not_raised() -> None:
    d = VllmKvDecoder()
    assert d.message([b"kv", (0).to_bytes(8, "big"), b"\xc1not msgpack"]) == []
    assert d.message([b"only-one-frame"]) == []
    assert d.message(frames(1, stored([1, 2], None, TOKENS[:16]))) == []  # 2 hashes, 1 block
    assert d.message(frames(2, ["SomethingNew", 1, 2])) == []
    assert d.bad >= 3


def test_the_map_is_bounded() -> None:
    d = VllmKvDecoder(max_blocks=2)
    d.message(frames(0, stored([1, 2, 3, 4], None, TOKENS)))
    assert d.message(frames(1, ["BlockRemoved", [1], "GPU"])) == []  # forgotten (oldest)
    assert d.message(frames(2, ["BlockRemoved", [4], "GPU"])) != []


def test_events_as_vllm_0_32_sends_them_maps_with_their_type() -> None:
    """The shape seen from a real vLLM 0.32 engine (CPU build), field names as it sends them."""
    d = VllmKvDecoder()
    stored_ev = {
        "type": "BlockStored", "block_hashes": [3581396769925457741, 15085932068797016924],
        "parent_block_hash": None, "token_ids": TOKENS[:32], "block_size": 16,
        "lora_id": None, "medium": "GPU",
    }  # fmt: skip
    assert d.message(frames(0, stored_ev)) == [("h", list(chain_hashes(TOKENS[:32], 16)))]
    removed = {"type": "BlockRemoved", "block_hashes": [15085932068797016924], "medium": "GPU"}
    assert d.message(frames(1, removed)) == [("r", [chain_hashes(TOKENS[:32], 16)[1]])]
