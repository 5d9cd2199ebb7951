"""The prompt's block chain: hetero-pd's own key for every full KV block of a prompt.

A prompt's token ids are cut into full blocks of ``block_tokens`` (the engines' KV block
size; a partial last block is never cached by an engine, so it is not hashed). Block
``i``'s key is ``H(key[i-1] || its token ids)``, 64 bits of BLAKE2b, with ``key[-1] = 0``:
equal prompts give equal chains, and a changed token changes its block's key and every
key after it, so a key names a whole prefix, not a block's contents. Engines' own block
hashes depend on their hash seeds; these do not. The gateway keys a prompt, the agent
keys the blocks an engine reports storing, and the scheduler's prefix index
(``hpd_scheduler.policy.prefix``) matches one against the other.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = ["chain_hashes"]

_MASK = (1 << 64) - 1


def chain_hashes(token_ids: Sequence[int], block_tokens: int, parent: int = 0) -> tuple[int, ...]:
    """The chain keys of the full blocks of ``token_ids`` (module docstring). ``parent``:
    the key of the block before the first (0 at the start of a prompt)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    out: list[int] = []
    key = parent
    full = len(token_ids) - len(token_ids) % block_tokens
    for start in range(0, full, block_tokens):
        h = hashlib.blake2b(digest_size=8)
        h.update(key.to_bytes(8, "little"))
        block = token_ids[start : start + block_tokens]
        try:  # each token id as 4 bytes, little-endian, in one call
            h.update(struct.pack(f"<{len(block)}I", *block))
        except struct.error:  # an id outside 0 .. 2^32 - 1: its low 32 bits, as always
            h.update(struct.pack(f"<{len(block)}I", *(t & 0xFFFFFFFF for t in block)))
        key = int.from_bytes(h.digest(), "little") & _MASK
        out.append(key)
    return tuple(out)
