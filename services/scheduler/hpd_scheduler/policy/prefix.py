"""Which worker holds which prompt prefix: block-chain hashes and the KV block index.

**The chain.** A prompt's token ids are cut into full blocks of ``block_tokens`` (the
engines' KV block size; a partial last block is never cached by an engine, so it is not
hashed). Block ``i``'s key is ``H(key[i-1] || its token ids)``, 64 bits of BLAKE2b, with
``key[-1] = 0``: equal prompts give equal chains, and a changed token changes its block's
key and every key after it, so a key names a whole prefix, not a block's contents. The
keys are hetero-pd's own (computed from token ids), never an engine's, whose block hashes
depend on its hash seed. The gateway hashes a prompt this way; an agent hashes the token
ids an engine reports with each stored block the same way; the simulator uses a trace's
own prefix ids (Mooncake's ``hash_ids``), which are a chain of the same kind.

**The match.** A worker's cached tokens for a request are ``matched x block_tokens`` where
``matched`` is the length of the longest prefix of the request's chain the worker holds
(it stops at the first miss: a later block without its predecessors is of no use to a
prefill), capped at ``prompt - 1`` (an engine always computes at least the last token).

**The index** (:class:`PrefixIndex`) keeps, per worker, the set of keys it holds, fed by
the engine's events: stored (keys added), removed (keys dropped), cleared (all dropped),
and the worker's departure (lease expiry or deregistration: all dropped). Memory is
bounded per worker by ``max_blocks`` (default: the worker's KV capacity in blocks, which
is all an engine can hold): past it the least recently stored or matched keys go first,
a chain's tail before its head, the order an engine's LRU evicts in, so the index errs
towards forgetting a block the engine still has (a missed hit) rather than claiming one
it dropped. It never reports a key after that key's removal. Cost: one ``int`` key in an
``OrderedDict`` per block (its memory per block is measured by the simulator's report).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from typing import Any

from hpd_common.kvchain import chain_hashes

__all__ = ["PrefixIndex", "cached_tokens", "chain_hashes", "matched_blocks"]


def matched_blocks(chain: Sequence[int], held: Container[int]) -> int:
    """Length of the longest prefix of ``chain`` whose keys are all in ``held``."""
    # the keys as objects: compiled, an ``int`` loop variable is unboxed and boxed again
    # for every lookup (64-bit keys do not fit a tagged int), several times slower
    keys: Any = chain
    box: Any = held
    n = 0
    for key in keys:
        if key not in box:
            break
        n += 1
    return n


def cached_tokens(chain: Sequence[int], held: Container[int] | None, block_tokens: int,
                  prompt_tokens: int) -> int:  # fmt: skip
    """Tokens of the prompt a worker holding ``held`` need not compute (module docstring)."""
    if held is None or not chain or prompt_tokens <= 1:
        return 0
    return min(matched_blocks(chain, held) * block_tokens, prompt_tokens - 1)


class PrefixIndex:
    """Per worker, the chain keys it holds (module docstring). Not thread-safe; one per
    scheduler replica, fed in order per worker."""

    def __init__(self, default_max_blocks: int = 1 << 20) -> None:
        if default_max_blocks <= 0:
            raise ValueError("default_max_blocks must be > 0")
        self.default_max_blocks = default_max_blocks
        self._held: dict[str, OrderedDict[int, None]] = {}
        self._max: dict[str, int] = {}
        # what Fleet.build takes: worker -> (tokens per block, its keys), live
        self.entries: dict[str, tuple[int, OrderedDict[int, None]]] = {}
        # the workers holding each prompt's first block (stored with head=True): a decision
        # finds a prompt's holders here instead of asking every worker
        self.heads: dict[int, set[str]] = {}
        self._heads_of: dict[str, set[int]] = {}
        self.evicted = 0

    def held(self, worker_id: str) -> Container[int] | None:
        """The keys the worker holds (a live view), None for a worker never seen."""
        return self._held.get(worker_id)

    def size(self, worker_id: str) -> int:
        got = self._held.get(worker_id)
        return len(got) if got is not None else 0

    def workers(self) -> list[str]:
        return sorted(self._held)

    def capacity(self, worker_id: str) -> int:
        """The worker's bound in blocks (``default_max_blocks`` until set)."""
        return self._max.get(worker_id, self.default_max_blocks)

    def set_capacity(self, worker_id: str, max_blocks: int) -> None:
        """Bound the worker's entry (its KV capacity in blocks); trims at once."""
        if max_blocks <= 0:
            raise ValueError("max_blocks must be > 0")
        self._max[worker_id] = max_blocks
        got = self._held.get(worker_id)
        if got is not None:
            self._trim(worker_id, got, max_blocks)

    def block_tokens(self, worker_id: str) -> int:
        got = self.entries.get(worker_id)
        return got[0] if got is not None else 0

    def stored(
        self, worker_id: str, keys: Sequence[int], block_tokens: int = 0, head: bool = False
    ) -> None:
        """``keys`` in chain order. They are made most recent tail first, so that the head
        of a chain is evicted last (as engines free a sequence's blocks from its tail):
        a prefix without its head is useless, one without its tail still helps."""
        got = self._held.get(worker_id)
        if got is None:
            got = self._held[worker_id] = OrderedDict()
            self.entries[worker_id] = (block_tokens, got)
        elif block_tokens and self.entries[worker_id][0] != block_tokens:
            self.cleared(worker_id)  # the engine came back with another block size
            self.entries[worker_id] = (block_tokens, got)
        for key in reversed(keys):
            if key in got:
                got.move_to_end(key)
            else:
                got[key] = None
        if head and keys:
            self.heads.setdefault(keys[0], set()).add(worker_id)
            self._heads_of.setdefault(worker_id, set()).add(keys[0])
        self._trim(worker_id, got, self._max.get(worker_id, self.default_max_blocks))

    def removed(self, worker_id: str, keys: Iterable[int]) -> None:
        got = self._held.get(worker_id)
        if got is None:
            return
        mine = self._heads_of.get(worker_id)
        for key in keys:
            got.pop(key, None)
            if mine is not None and key in mine:
                self._drop_head(worker_id, key)

    def cleared(self, worker_id: str) -> None:
        """The engine dropped its whole cache (a reset): nothing held, still known."""
        got = self._held.get(worker_id)
        if got is not None:
            got.clear()
        for key in list(self._heads_of.get(worker_id, ())):
            self._drop_head(worker_id, key)

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet (lease expiry, deregistration)."""
        self.cleared(worker_id)
        self._heads_of.pop(worker_id, None)
        self._held.pop(worker_id, None)
        self._max.pop(worker_id, None)
        self.entries.pop(worker_id, None)

    def touch(self, worker_id: str, chain: Sequence[int], matched: int) -> None:
        """Mark a matched prefix recently used (the engine's LRU does the same on a hit)."""
        got = self._held.get(worker_id)
        if got is None:
            return
        for key in reversed(chain[:matched]):
            if key in got:
                got.move_to_end(key)

    def _drop_head(self, worker_id: str, key: int) -> None:
        holders = self.heads.get(key)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self.heads[key]
        mine = self._heads_of.get(worker_id)
        if mine is not None:
            mine.discard(key)

    def _trim(self, worker_id: str, got: OrderedDict[int, None], limit: int) -> None:
        mine = self._heads_of.get(worker_id)
        while len(got) > limit:
            key, _ = got.popitem(last=False)
            self.evicted += 1
            if mine is not None and key in mine:
                self._drop_head(worker_id, key)
