"""The scheduler's follower of the registry's KV event feed (``hpd_registry.keys``).

Every scheduler replica keeps its own :class:`~hpd_scheduler.policy.prefix.PrefixIndex`
in memory and feeds it from the one Redis stream that agents write through
``ReportKvEvents``: a decision then matches prefixes without a Redis round trip, and a
replica that starts replays the stream (what its cap kept) before it follows new entries.
Where the index lives, and why: a shared structure in Redis would cost each decision one
round trip per candidate and every replica the same memory anyway; an in-memory index
per replica costs one stream read per batch of events, and its memory is measured per
worker by the simulator (``prefix_blocks_max``).

A Redis outage pauses the follower (it retries with backoff and resumes from the last
entry it applied); events that the stream's cap dropped meanwhile are lost, which can
only make the index miss blocks.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import redis.asyncio as aioredis

from hpd_common.logging import get_logger
from hpd_common.redis_conn import STORE_DOWN
from hpd_registry.keys import RegistryKeys
from hpd_scheduler.policy.prefix import PrefixIndex

log = get_logger("kv_events")


class KvEventFollower:
    """Applies the feed's entries to ``index`` in order (``run`` until cancelled).

    ``block_ms``: how long one XREAD waits for new entries. It must stay well under the
    Redis client's socket timeout (1 s, ``redis_conn.connect``): at 1,000 ms every idle read
    raced the timeout, failed, and the follower backed off up to 5 s between reads."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: RegistryKeys,
        index: PrefixIndex,
        block_ms: int = 250,
        batch: int = 512,
    ) -> None:
        self.client = client
        self.key = keys.kv_events
        self.index = index
        self.block_ms = block_ms
        self.batch = batch
        self.last_id = "0-0"  # from the start: a replica replays what the cap kept
        self.applied = 0
        self.bad = 0

    async def run(self) -> None:
        backoff = 0.1
        while True:
            try:
                got = await self.client.xread(
                    {self.key: self.last_id}, count=self.batch, block=self.block_ms
                )
            except STORE_DOWN as exc:
                log.warning("kv_event_feed_unreadable", error=str(exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            for _stream, entries in got or ():
                for entry_id, fields in entries:
                    self.apply(fields)
                    self.last_id = _text(entry_id)

    def apply(self, fields: dict[Any, Any]) -> None:
        """One feed entry: a worker's batch of events, in order."""
        try:
            worker = _text(fields.get(b"w", fields.get("w", b"")))
            bt = int(_text(fields.get(b"bt", fields.get("bt", b"0"))))
            events = json.loads(_text(fields.get(b"ev", fields.get("ev", b"[]"))))
        except (ValueError, TypeError):
            self.bad += 1
            return
        ix = self.index
        for kind, keys in events:
            if kind == "s" or kind == "h":
                ix.stored(worker, keys, bt, head=kind == "h")
            elif kind == "r":
                ix.removed(worker, keys)
            elif kind == "c":
                ix.cleared(worker)
        self.applied += len(events)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
