"""Reading route records: one by request id, or pages of the newest first with filters
(`ListRouteRecords`, `hpd routes`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpd_common.errors import InvalidArgument, NotFound
from hpd_scheduler.snapshot import SchedulerState
from hpd_scheduler.store import StoredRecord


@dataclass(frozen=True, slots=True)
class RecordQuery:
    """Filters of ListRouteRecords; empty / zero / None = any."""

    since_ms: int = 0
    until_ms: int = 0
    tier: str = ""
    worker_id: str = ""
    decision: str = ""
    mode: str = ""
    model_id: str = ""

    def matches(self, head: dict[str, Any]) -> bool:
        if self.tier and head.get("tier") != self.tier:
            return False
        if self.decision and head.get("decision") != self.decision:
            return False
        if self.model_id and head.get("model_id") != self.model_id:
            return False
        plan = head.get("plan") or {}
        if self.mode and plan.get("mode") != self.mode:
            return False
        return not (
            self.worker_id
            and self.worker_id not in (plan.get("prefill_worker_id"), plan.get("decode_worker_id"))
        )


class RouteRecords(SchedulerState):
    """The read side of route records."""

    async def get_record(self, request_id: str) -> StoredRecord:
        await self.explanations.write_now(request_id)  # a waiting explanation: now
        rec = await self.store.get(request_id)
        if rec is None:
            raise NotFound("route record", request_id)
        return rec

    async def list_records(
        self, query: RecordQuery, page_size: int, token: str, scan_limit: int = 5_000
    ) -> tuple[list[StoredRecord], str]:
        """Newest first. The token is ``<created ms>:<request id>`` of the last entry
        looked at; members with equal scores come in descending id order, so the next
        page resumes strictly after it. At most ``scan_limit`` index entries are examined
        per call (a sparse filter returns a short page and a token to continue)."""
        after: tuple[int, str] | None = None
        if token:
            t_ms, sep, t_rid = token.partition(":")
            if not sep or not t_ms.isdigit() or not t_rid or len(t_ms) > 15:
                raise InvalidArgument("page_token", "malformed")
            after = (int(t_ms), t_rid)
        top: int | None = query.until_ms or None
        if after is not None:
            top = after[0] if top is None else min(top, after[0])
        out: list[StoredRecord] = []
        scanned = 0
        last: tuple[int, str] | None = None
        skip = 0
        while len(out) < page_size and scanned < scan_limit:
            batch = min(256, scan_limit - scanned)
            rows = await self.store.index_page(top, query.since_ms, batch + skip)
            rows = rows[skip:]
            if not rows:
                return out, ""
            fresh = [
                (rid, ms)
                for rid, ms in rows
                if after is None or ms < after[0] or (ms == after[0] and rid < after[1])
            ]
            if not fresh:
                skip += len(rows)
                continue
            skip = 0
            heads = await self.store.heads([rid for rid, _ in fresh])
            for (rid, ms), rec in zip(fresh, heads, strict=True):
                scanned += 1
                last = (ms, rid)
                if rec is not None and query.matches(rec.head):
                    out.append(rec)
                    if len(out) >= page_size:
                        break
            assert last is not None
            after = last
            top = last[0]
            if len(rows) < batch:
                if len(out) < page_size:
                    return out, ""
                break
        return out, (f"{last[0]}:{last[1]}" if last else "")
