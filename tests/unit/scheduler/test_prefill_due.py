"""Token-true prefill queues: reserved prompt tokens count as queued until their predicted
prefill end, and an outcome or a lapse forgets them."""

from __future__ import annotations

from hpd_scheduler.prefill_due import PrefillDue


def test_tokens_are_queued_until_their_predicted_end() -> None:
    due = PrefillDue()
    due.add("a", "p1", 3000, due_ms=100, drop_ms=10_000)
    due.add("b", "p1", 1000, due_ms=300, drop_ms=10_000)
    due.add("c", "p2", 500, due_ms=200, drop_ms=10_000)
    assert due.expire(99) == {}
    assert due.expire(250) == {"p1": 3000, "p2": 500}
    assert due.done_tokens("p1") == 3000 and due.done_tokens("p2") == 500
    assert due.expire(250) == {}  # each only once
    assert due.expire(300) == {"p1": 1000}
    assert due.done_tokens("p1") == 4000


def test_an_outcome_forgets_a_plan_and_says_whether_it_was_still_queued() -> None:
    due = PrefillDue()
    due.add("a", "p1", 3000, due_ms=100, drop_ms=10_000)
    due.add("b", "p1", 1000, due_ms=500, drop_ms=10_000)
    due.expire(200)
    assert due.release("a") == ("p1", 3000)  # presumed prefilled: the caller re-counts
    assert due.release("b") is None  # still queued: the reservation's release covers it
    assert due.release("b") is None and due.release("never") is None
    assert due.done_tokens("p1") == 0 and len(due) == 0
    assert due.expire(1_000) == {}  # the released plan's due time does nothing


def test_a_lapsed_reservation_is_forgotten() -> None:
    due = PrefillDue()
    due.add("a", "p1", 3000, due_ms=100, drop_ms=2_000)
    due.expire(150)
    assert due.done_tokens("p1") == 3000
    due.expire(2_000)
    assert due.done_tokens("p1") == 0 and len(due) == 0


def test_nothing_to_count_is_not_tracked() -> None:
    due = PrefillDue()
    due.add("a", "p1", 0, due_ms=100, drop_ms=200)
    due.add("b", "p1", 10, due_ms=100, drop_ms=200)
    due.add("b", "p1", 99, due_ms=100, drop_ms=200)  # a replayed id keeps its first entry
    assert len(due) == 1
    assert due.expire(100) == {"p1": 10}


def test_known_plans_are_those_a_report_can_show() -> None:
    """Plans made by a worker's report time and not presumed done are the ones its reported
    queue may already hold; later plans, done plans and unreported workers count nothing."""
    due = PrefillDue()
    due.add("a", "p1", 3000, due_ms=500, drop_ms=10_000, added_ms=100)
    due.add("b", "p1", 1000, due_ms=900, drop_ms=10_000, added_ms=200)
    due.add("c", "p1", 800, due_ms=900, drop_ms=10_000, added_ms=400)  # after p1's report
    due.add("d", "p2", 500, due_ms=900, drop_ms=10_000, added_ms=100)
    due.add("e", "p3", 500, due_ms=900, drop_ms=10_000, added_ms=100)  # p3 never reported
    assert due.counts({"p1": 300, "p2": 100})[0] == {"p1": 2, "p2": 1}
    due.expire(600)  # a is presumed prefilled
    assert due.counts({"p1": 300, "p2": 100})[0] == {"p1": 1, "p2": 1}
    due.release("d")
    assert due.counts({"p1": 1_000, "p2": 1_000})[0] == {"p1": 2}


def test_inbound_counts_transfers_whose_prefill_is_not_done() -> None:
    due = PrefillDue()
    due.add("a", "p1", 3000, due_ms=500, drop_ms=10_000, decode_worker_id="d1")
    due.add("b", "p2", 1000, due_ms=900, drop_ms=10_000, decode_worker_id="d1")
    due.add("c", "p1", 800, due_ms=900, drop_ms=10_000, decode_worker_id="d2")
    due.add("e", "d3", 500, due_ms=900, drop_ms=10_000, decode_worker_id="d3")  # local
    due.add("f", "d3", 500, due_ms=900, drop_ms=10_000)  # local
    assert due.counts({})[1] == {"d1": 2, "d2": 1}
    due.expire(600)  # a's prefill is presumed done: its KV is on the way or there
    assert due.counts({})[1] == {"d1": 1, "d2": 1}
    due.release("c")
    assert due.counts({})[1] == {"d1": 1}
