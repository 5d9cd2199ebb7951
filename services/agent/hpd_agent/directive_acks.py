"""A worker's side of at-least-once directives: which ids it has taken, which to ack.

The registry keeps a directive queued until the worker acks its id on a later heartbeat, so
a lost answer or a broken stream delivers it again. :meth:`DirectiveAcks.take` says whether
a directive is new (to apply) or a redelivery (its ack was lost: acked again, not applied
again); :meth:`DirectiveAcks.due` hands out the ids the next report acks.
"""

from __future__ import annotations

import collections

__all__ = ["MAX_ACKS_PER_REPORT", "TAKEN_IDS_KEPT", "DirectiveAcks"]

MAX_ACKS_PER_REPORT = 256  # what the registry takes in one report
TAKEN_IDS_KEPT = 4096  # more than a worker's queue holds (the registry's cap is 256)


class DirectiveAcks:
    def __init__(self) -> None:
        self._taken: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._to_ack: list[str] = []

    def take(self, directive_id: str) -> bool:
        """Note a received directive for acking; True when it was not taken before (a
        directive without an id is always new)."""
        if not directive_id:
            return True
        self._to_ack.append(directive_id)
        if directive_id in self._taken:
            return False
        self._taken[directive_id] = None
        if len(self._taken) > TAKEN_IDS_KEPT:  # bounded: the oldest ids are forgotten
            self._taken.popitem(last=False)
        return True

    def due(self) -> list[str]:
        """The ids for the next report (at most ``MAX_ACKS_PER_REPORT``), handed out once: a
        report that is lost makes the registry send them again, and they are acked again."""
        out = self._to_ack[:MAX_ACKS_PER_REPORT]
        del self._to_ack[:MAX_ACKS_PER_REPORT]
        return out
