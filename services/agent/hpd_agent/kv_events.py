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

**Replay** (vLLM's ``replay_endpoint`` in the same ``--kv-events-config``, a ZMQ ROUTER
that keeps the engine's last ``buffer_steps`` batches, 10,000 by default): a DEALER sends
``[b"", start sequence (8 bytes, big-endian)]`` and gets back every kept batch from there
as ``[b"", (topic,) sequence, payload]``, then a sequence of -1. With it the relay

* on start (an agent that restarts while its engine runs, or a worker that registers
  again) asks for everything from sequence 0 and reports a clear followed by the replayed
  history: the index holds the engine's whole cache again, not only what it stores from
  now on (when the engine's buffer no longer reaches back to 0 the older blocks are
  missing: missed hits, never wrong ones);
* on a gap asks for the missing batches and goes on without a clear when they are all
  there (an engine that restarted, seen as its sequence going back, is replayed from 0
  after a clear);
* after a report that did not reach the registry (which clears the worker's entry at the
  next one), reports the replayed history again rather than only what came after;
* drops the live batches the replay already gave (the subscription runs during it).

Without a replay endpoint (or one that falls silent for ``replay_timeout_s`` while
answering) the relay behaves as without replay: a clear on start and on every gap.

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
        return self.batch(sequence(frames), frames[-1])

    def batch(self, seq: int | None, payload: bytes) -> list[KvEvent]:
        """One batch and its sequence number (None when the message had none)."""
        out: list[KvEvent] = []
        if seq is not None:
            if not self.in_order(seq):
                # messages were lost: nothing we hold can be trusted any more
                self.gaps += 1
                out.append(self.reset())
            self.last_seq = seq
        return out + self.payload(payload)

    def in_order(self, seq: int) -> bool:
        """Whether ``seq`` is the next batch (or the first one seen)."""
        return self.last_seq is None or seq == self.last_seq + 1

    def reset(self) -> KvEvent:
        """Forget every block and the sequence; the clear to report."""
        self._key_of.clear()
        self.last_seq = None
        return ("c", [])

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


END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence that ends a replay."""


def sequence(frames: Sequence[bytes]) -> int | None:
    """The sequence number of a message (its last frame but one), None without one."""
    raw = frames[-2] if len(frames) >= 2 else b""
    return int.from_bytes(raw, "big") if len(raw) == 8 else None


def _h(value: Any) -> Hashable:
    out: Hashable = tuple(value) if isinstance(value, list) else value
    return out


def _field(fields: Any, name: str, index: int) -> Any:
    if isinstance(fields, dict):
        return fields.get(name)
    return fields[index] if len(fields) > index else None


Report = Callable[[int, list[KvEvent]], Awaitable[None]]

REBUILD_SPACING_S = 1.0
"""While reports fail (the registry away), the engine's history is replayed for the next
report at most this often: a replay sends every kept batch."""


REPORT_MAX_EVENTS = 1024
"""Events one ``ReportKvEvents`` call may carry (the registry refuses more: its
``MAX_KV_EVENTS``); a replayed history is reported in parts of at most this many."""


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
        replay_endpoint: str = "",
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.report = report
        self.flush_s = flush_s
        self.max_batch = max_batch
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self.decoder = VllmKvDecoder()
        self.reported = 0
        self.failed = 0
        self.replays = 0  # replays that answered
        self.replayed = 0  # batches they gave
        self._dirty = True  # start clean: the index knows nothing of this engine yet
        self._skip_through: int | None = None  # live batches the last replay gave
        self._last_live: int | None = None  # the last live sequence seen
        self._rebuild_at = 0.0  # no replay for a lost report before then (loop time)

    async def run(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sock.connect(self.endpoint)
        log.info(
            "kv_events_subscribed",
            endpoint=self.endpoint,
            topic=self.topic,
            replay=self.replay_endpoint or None,
        )
        pending: list[KvEvent] = []
        if self.replay_endpoint:  # the engine's history so far (module docstring)
            pending.extend(await self._resync(0))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.flush_s
        # One receive stays pending across flush deadlines and is never cancelled: a
        # receive cancelled by a timeout in the loop iteration its message arrived in
        # loses that message (the task is cancelled after the socket gave it up), and a
        # lost batch is only noticed at the engine's next one, maybe much later.
        recv: asyncio.Future[list[bytes]] | None = None
        try:
            while True:
                wait = max(0.0, deadline - loop.time())
                if recv is None:
                    recv = asyncio.ensure_future(sock.recv_multipart())
                done, _ = await asyncio.wait([recv], timeout=wait)
                if done:
                    frames, recv = recv.result(), None
                    pending.extend(await self._live(frames))
                if pending and (len(pending) >= self.max_batch or loop.time() >= deadline):
                    if (
                        self._dirty
                        and self.failed
                        and self.replay_endpoint
                        and loop.time() >= self._rebuild_at
                    ):  # a report was lost: the engine's kept history in its place
                        self._rebuild_at = loop.time() + REBUILD_SPACING_S
                        got = await self._replay(0)
                        if got:  # else keep the live events: a failed replay loses nothing
                            self.decoder.reset()
                            pending = self._decode_replay(0, got)
                    await self._flush(pending)
                    pending = []
                if loop.time() >= deadline:
                    deadline = loop.time() + self.flush_s
        finally:
            if recv is not None:
                recv.cancel()
            with contextlib.suppress(Exception):
                sock.close(linger=0)

    async def _live(self, frames: list[bytes]) -> list[KvEvent]:
        """One message of the subscription, with the replay's duplicates dropped and a
        gap filled from the replay when it can be."""
        seq = sequence(frames)
        if seq is not None:
            # a live sequence at or below the last live one is an engine that restarted,
            # not a batch the replay gave already (those come after the live ones seen)
            went_back = self._last_live is not None and seq <= self._last_live
            self._last_live = seq
            if self._skip_through is not None:
                if seq <= self._skip_through and not went_back:
                    return []  # the replay gave it already
                self._skip_through = None
        out: list[KvEvent] = []
        decoder = self.decoder
        if seq is not None and self.replay_endpoint and not decoder.in_order(seq):
            last = decoder.last_seq
            assert last is not None  # in_order is true without one
            if seq > last:
                out.extend(await self._resync(last + 1))  # lost batches
            else:  # the sequence went back: the engine restarted
                out.append(decoder.reset())
                out.extend(await self._resync(0))
            if decoder.last_seq is not None and seq <= decoder.last_seq:
                return out
        return out + decoder.message(frames)

    async def _resync(self, start: int) -> list[KvEvent]:
        """The engine's kept batches from ``start`` on, decoded in order (a batch missing
        at the start shows as a gap: the decoder clears)."""
        return self._decode_replay(start, await self._replay(start))

    def _decode_replay(self, start: int, got: list[tuple[int, bytes]]) -> list[KvEvent]:
        """Replayed batches (from ``start`` on) decoded in order."""
        out: list[KvEvent] = []
        decoder = self.decoder
        for seq, payload in got:
            if decoder.last_seq is not None and seq <= decoder.last_seq:
                continue
            out.extend(decoder.batch(seq, payload))
        if got:
            self._skip_through = decoder.last_seq
            log.info(
                "kv_events_replayed",
                start=start,
                first=got[0][0],
                last=got[-1][0],
                batches=len(got),
                complete=got[0][0] == start,
            )
        return out

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        """Ask the replay endpoint for every batch from ``start``; [] when it does not
        answer in time (the relay then goes on as without replay)."""
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # no receive bound: a ROUTER drops what does not fit its peer's queue (1,000
        # messages by default), so a history longer than that, read by a busy agent, would
        # lose its tail and the end marker; ZMQ's I/O thread takes it all in instead
        sock.setsockopt(zmq.RCVHWM, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            # the bound is on silence, not on the whole answer: a long history from an
            # engine on a busy host takes longer than one batch's wait, and is still good
            while True:
                async with asyncio.timeout(self.replay_timeout_s):
                    frames = await sock.recv_multipart()
                if len(frames) >= 2 and frames[-2] == END_SEQ:
                    break
                seq = sequence(frames)
                if seq is None:
                    self.decoder.bad += 1
                    continue
                out.append((seq, frames[-1]))
        except (TimeoutError, zmq.ZMQError) as exc:
            log.info(
                "kv_events_replay_failed",
                endpoint=self.replay_endpoint,
                start=start,
                error=type(exc).__name__,
                got=len(out),
            )
            return []
        finally:
            sock.close(linger=0)
        self.replays += 1
        self.replayed += len(out)
        return out

    async def _flush(self, events: list[KvEvent]) -> None:
        """Report ``events`` (after a clear when the index may be stale), in parts the
        registry takes; a part that fails leaves the index to be rebuilt from a clear."""
        if self._dirty:
            events = [("c", []), *events]
        step = max(1, min(self.max_batch, REPORT_MAX_EVENTS))
        for i in range(0, len(events), step):
            part = events[i : i + step]
            try:
                await self.report(self.decoder.block_tokens or 1, part)
            except Exception as exc:  # registry away, lease lost: start clean next time
                self.failed += 1
                self._dirty = True
                log.info("kv_events_not_reported", error=str(exc)[:200], events=len(part))
                return
            self._dirty = False
            self.reported += len(part)
