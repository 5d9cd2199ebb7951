"""The learner's samples in Redis, shared by every scheduler replica (``learning.py``).

Why share samples rather than fits: each replica sees only the outcomes reported to it,
so fitting locally would give each replica its own speeds for the same worker; with the
samples in one place every replica fits the same figures from the same points (the fit is
deterministic), and a replica that starts late learns what the others measured.

A sample costs one pipelined round trip when its outcome is reported (RPUSH, LTRIM to
``2 x WINDOW``, HINCRBY of its key's version); a replica's sync loop reads the versions
(one HGETALL) and then only the lists whose version moved since it last read them (one
LRANGE each, pipelined): a busy fleet's every outcome does not make every replica read
every worker's samples again.
Key layout: ``hpd_scheduler.keys``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import redis.asyncio as aioredis

from hpd_common.errors import Unavailable
from hpd_common.redis_conn import STORE_DOWN
from hpd_scheduler.keys import SchedulerKeys
from hpd_scheduler.policy.learning import WINDOW, Sample

__all__ = ["LearnStore"]


def _s(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class LearnStore:
    """Samples per learner key (module docstring)."""

    def __init__(self, client: aioredis.Redis, keys: SchedulerKeys) -> None:
        self.client = client
        self.keys = keys
        self._seen: dict[str, int] = {}

    async def push(self, samples: Sequence[tuple[str, Sample]]) -> None:
        if not samples:
            return
        k = self.keys
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for key, s in samples:
                    pipe.rpush(k.learned(key), json.dumps(s.to_json(), separators=(",", ":")))
                    pipe.ltrim(k.learned(key), -2 * WINDOW, -1)
                    pipe.hincrby(k.learned_versions, key, 1)
                await pipe.execute()
        except STORE_DOWN as exc:
            raise Unavailable(f"state store unavailable: {exc}") from exc

    async def read_if_changed(self) -> dict[str, list[Sample]] | None:
        """The samples (oldest first) of every key with samples added since the last read,
        or None when there are none."""
        k = self.keys
        try:
            raw = await self.client.hgetall(k.learned_versions)
            versions = {_s(name): int(v) for name, v in raw.items()}
            names = sorted(n for n, v in versions.items() if self._seen.get(n) != v)
            if not names:
                return None
            async with self.client.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.lrange(k.learned(name), 0, -1)
                lists = await pipe.execute()
        except STORE_DOWN as exc:
            raise Unavailable(f"state store unavailable: {exc}") from exc
        out: dict[str, list[Sample]] = {}
        for name, items in zip(names, lists, strict=True):
            got: list[Sample] = []
            for item in items:
                try:
                    s = Sample.from_json(json.loads(_s(item)))
                except ValueError:
                    s = None
                if s is not None:
                    got.append(s)
            out[name] = got
            self._seen[name] = versions[name]
        return out
