"""The engine's KV cache events, relayed to the control plane as hetero-pd chain keys.

vLLM (``--kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq",
"endpoint":"tcp://*:<port>","topic":"kv"}'``; the ``*`` makes it bind, a host name would
make it connect to a subscriber) publishes ZMQ multipart messages ``[topic, sequence
(8 bytes, big-endian), payload]``; the payload is msgpack, ``[timestamp, [event, ...],
dp_rank]``, each event a map with its kind under ``type`` (vLLM 0.32; an array tagged with
its kind first is read the same way):

* ``BlockStored``: ``block_hashes``, ``parent_block_hash``, ``token_ids`` (the tokens of
  all the stored blocks, in order), ``block_size``, ``lora_id``, ``medium``, ...;
* ``BlockRemoved``: ``block_hashes``, ``medium``;
* ``AllBlocksCleared``.

The engine's block hashes depend on its hash seed, so :class:`VllmKvDecoder` re-keys each
stored block with :func:`~hpd_scheduler.policy.prefix.chain_hashes` (the parent's key and
the block's token ids): the gateway hashes prompts the same way. It keeps the engine hash
-> key map that a removal needs (bounded: the engine removes what it evicts, and the map
forgets its oldest entries past ``max_blocks``). A stored block whose parent it never saw
cannot be keyed and is skipped (a missed hit, never a wrong one). A gap in the sequence
numbers (messages lost) clears everything: the index may then miss blocks the engine still
holds, but never claims one it dropped.

:class:`KvEventRelay` subscribes (pyzmq's asyncio socket), decodes, and hands the events
to ``report`` in batches (every ``flush_s`` or ``max_batch`` events); the agent's report
is ``ReportKvEvents`` with the worker's credential. msgpack and pyzmq are the libraries the
engines themselves use for this feed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from hpd_common.kvchain import chain_hashes
from hpd_common.logging import get_logger

log = get_logger("kv_events")

# (kind, keys): kind "s" stored (chain order), "h" the same from a prompt's first block,
# "r" removed, "c" all cleared (no keys)
KvEvent = tuple[str, list[int]]


class VllmKvDecoder:
    """Turns vLLM's KV event payloads into hetero-pd events (module docstring)."""

    def __init__(self, max_blocks: int = 1 << 22) -> None:
        self.max_blocks = max_blocks
        self._key_of: OrderedDict[Hashable, int] = OrderedDict()
        self.block_tokens = 0
        self.last_seq: int | None = None
        self.skipped = 0
        self.gaps = 0
        self.bad = 0

    def message(self, frames: Sequence[bytes]) -> list[KvEvent]:
        """One ZMQ message ``[topic, seq, payload]`` (or ``[seq, payload]``)."""
        if len(frames) < 2:
            self.bad += 1
            return []
        seq_raw, payload = frames[-2], frames[-1]
        out: list[KvEvent] = []
        if len(seq_raw) == 8:
            seq = int.from_bytes(seq_raw, "big")
            if self.last_seq is not None and seq != self.last_seq + 1:
                # messages were lost: nothing we hold can be trusted any more
                self.gaps += 1
                self._key_of.clear()
                out.append(("c", []))
            self.last_seq = seq
        return out + self.payload(payload)

    def payload(self, payload: bytes) -> list[KvEvent]:
        try:
            doc = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            events = doc[1]
        except (ValueError, TypeError, IndexError, KeyError, msgpack.UnpackException):
            self.bad += 1
            return []
        out: list[KvEvent] = []
        for ev in events if isinstance(events, list) else ():
            got = self.event(ev)
            if got is not None:
                out.append(got)
        return out

    def event(self, ev: Any) -> KvEvent | None:
        fields: Any
        if isinstance(ev, dict):  # an encoder without array_like: the same fields by name
            kind = ev.get("type") or ev.get("tag")
            fields = ev
        elif isinstance(ev, list) and ev and isinstance(ev[0], str):
            kind, fields = ev[0], ev
        else:
            self.bad += 1
            return None
        if kind == "AllBlocksCleared":
            self._key_of.clear()
            return ("c", [])
        if kind == "BlockRemoved":
            hashes = _field(fields, "block_hashes", 1)
            keys = [k for k in (self._key_of.pop(_h(h), None) for h in hashes or ()) if k]
            return ("r", keys) if keys else None
        if kind == "BlockStored":
            return self._stored(fields)
        return None  # a kind this version does not know: ignored

    def _stored(self, fields: Any) -> KvEvent | None:
        hashes = _field(fields, "block_hashes", 1) or []
        parent = _field(fields, "parent_block_hash", 2)
        tokens = _field(fields, "token_ids", 3) or []
        size = _field(fields, "block_size", 4) or 0
        if not hashes or not isinstance(size, int) or size <= 0:
            self.bad += 1
            return None
        self.block_tokens = size
        if parent is None:
            parent_key = 0
        else:
            got = self._key_of.get(_h(parent))
            if got is None:
                self.skipped += len(hashes)
                return None
            parent_key = got
        keys = chain_hashes(tokens, size, parent_key)
        if len(keys) != len(hashes):
            self.bad += 1
            return None
        key_of = self._key_of
        for h, k in zip(hashes, keys, strict=True):
            key_of[_h(h)] = k
            key_of.move_to_end(_h(h))
        while len(key_of) > self.max_blocks:
            key_of.popitem(last=False)
        return ("h" if parent is None else "s", list(keys))


def _h(value: Any) -> Hashable:
    out: Hashable = tuple(value) if isinstance(value, list) else value
    return out


def _field(fields: Any, name: str, index: int) -> Any:
    if isinstance(fields, dict):
        return fields.get(name)
    return fields[index] if len(fields) > index else None


Report = Callable[[int, list[KvEvent]], Awaitable[None]]


class KvEventRelay:
    """Subscribes to ``endpoint`` and reports decoded events in batches (module
    docstring). ``report(block_tokens, events)`` may raise; the batch is then dropped and a
    ``cleared`` goes first in the next one, so the index never keeps what it missed."""

    def __init__(
        self,
        endpoint: str,
        report: Report,
        topic: str = "",
        flush_s: float = 0.05,
        max_batch: int = 256,
    ) -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.report = report
        self.flush_s = flush_s
        self.max_batch = max_batch
        self.decoder = VllmKvDecoder()
        self.reported = 0
        self.failed = 0
        self._dirty = True  # start clean: the index knows nothing of this engine yet

    async def run(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sock.connect(self.endpoint)
        log.info("kv_events_subscribed", endpoint=self.endpoint, topic=self.topic)
        pending: list[KvEvent] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.flush_s
        try:
            while True:
                wait = max(0.0, deadline - loop.time())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        frames = await sock.recv_multipart()
                    pending.extend(self.decoder.message(frames))
                if pending and (len(pending) >= self.max_batch or loop.time() >= deadline):
                    await self._flush(pending)
                    pending = []
                if loop.time() >= deadline:
                    deadline = loop.time() + self.flush_s
        finally:
            with contextlib.suppress(Exception):
                sock.close(linger=0)

    async def _flush(self, events: list[KvEvent]) -> None:
        if self._dirty:
            events = [("c", []), *events]
        try:
            await self.report(self.decoder.block_tokens or 1, events)
        except Exception as exc:  # registry away, lease lost: start clean next time
            self.failed += 1
            self._dirty = True
            log.info("kv_events_not_reported", error=str(exc)[:200], events=len(events))
            return
        self._dirty = False
        self.reported += len(events)
