"""The prefill x decode compatibility matrix, kept current from fleet changes. Pure.

The broker feeds it every change the registry's watch stream reports (`put`, `delete`,
`reset` for a fresh snapshot), so the matrix is computed when a worker registers or
changes, never per request: `GetCompatibilityMatrix` only reads.

Cost: a put recomputes the changed worker's row and column within its model, O(P + D)
negotiations, and only when something negotiation depends on changed (model, stages, KV
format); a health or load change costs nothing. Negotiations are memoised by (source
format, destination format): a fleet has few distinct KV formats, so even a full rebuild
after a resync is O(P x D) dictionary lookups and a handful of `negotiate` calls.

A worker is paired only with other workers (its own prefill and decode are the same
pool: no transfer). The rules are `hpd_common.kvformat.negotiate`, not restated here.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpd_common.kvformat import KvFormat, KvPolicy, Negotiation, negotiate
from hpd_common.worker_model import Stage
from hpd_registry.domain import WorkerRecord


@dataclass(frozen=True, slots=True)
class _Shape:
    """What the matrix depends on for one worker."""

    model_id: str
    prefill: bool
    decode: bool
    kv: KvFormat


@dataclass(frozen=True, slots=True)
class MatrixView:
    model_id: str
    prefill_ids: tuple[str, ...]
    decode_ids: tuple[str, ...]
    pairs: tuple[tuple[str, str, Negotiation], ...]


def _shape(rec: WorkerRecord) -> _Shape:
    s = rec.spec
    return _Shape(s.model_id, Stage.PREFILL in s.stages, Stage.DECODE in s.stages, s.kv_format)


MEMO_MAX = 4096
"""Format pairs whose verdict is remembered. A fleet has a handful; explicit descriptors sent
to Negotiate can be anything, so past this many the memo starts over."""


class CompatibilityMatrix:
    """Per model: every (prefill id, decode id) pair and its negotiation."""

    def __init__(self, policy: KvPolicy) -> None:
        self.policy = policy
        self._shapes: dict[str, _Shape] = {}
        self._pairs: dict[str, dict[tuple[str, str], Negotiation]] = {}
        self._memo: dict[tuple[KvFormat, KvFormat], Negotiation] = {}
        self.revision = 0

    def negotiate(self, src: KvFormat, dst: KvFormat) -> Negotiation:
        """`negotiate(src, dst, policy)`, memoised."""
        key = (src, dst)
        got = self._memo.get(key)
        if got is None:
            got = negotiate(src, dst, self.policy)
            if len(self._memo) >= MEMO_MAX:  # Negotiate takes any descriptors: stay bounded
                self._memo.clear()
            self._memo[key] = got
        return got

    def put(self, rec: WorkerRecord, revision: int = 0) -> bool:
        """Adds or updates a worker; True when its pairs had to be recomputed."""
        self.revision = max(self.revision, revision)
        wid = rec.spec.worker_id
        shape = _shape(rec)
        if self._shapes.get(wid) == shape:
            return False
        self._drop(wid)
        self._shapes[wid] = shape
        pairs = self._pairs.setdefault(shape.model_id, {})
        for other, o in self._shapes.items():
            if other == wid or o.model_id != shape.model_id:
                continue
            if shape.prefill and o.decode:
                pairs[(wid, other)] = self.negotiate(shape.kv, o.kv)
            if o.prefill and shape.decode:
                pairs[(other, wid)] = self.negotiate(o.kv, shape.kv)
        return True

    def delete(self, worker_id: str, revision: int = 0) -> None:
        self.revision = max(self.revision, revision)
        self._drop(worker_id)

    def reset(self, records: list[WorkerRecord], revision: int = 0) -> None:
        """Replaces the whole fleet (after a snapshot)."""
        self._shapes.clear()
        self._pairs.clear()
        for rec in sorted(records, key=lambda r: r.spec.worker_id):
            self.put(rec)
        self.revision = revision

    def _drop(self, worker_id: str) -> None:
        old = self._shapes.pop(worker_id, None)
        if old is None:
            return
        pairs = self._pairs.get(old.model_id, {})
        for key in [k for k in pairs if worker_id in k]:
            del pairs[key]
        if not any(s.model_id == old.model_id for s in self._shapes.values()):
            self._pairs.pop(old.model_id, None)

    def view(self, model_id: str) -> MatrixView:
        """The model's workers by stage and every pair, in id order."""
        ids = sorted(w for w, s in self._shapes.items() if s.model_id == model_id)
        prefill = tuple(w for w in ids if self._shapes[w].prefill)
        decode = tuple(w for w in ids if self._shapes[w].decode)
        pairs = self._pairs.get(model_id, {})
        return MatrixView(
            model_id,
            prefill,
            decode,
            tuple((p, d, pairs[(p, d)]) for p, d in sorted(pairs)),
        )

    @property
    def pair_count(self) -> int:
        return sum(len(p) for p in self._pairs.values())

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._shapes
