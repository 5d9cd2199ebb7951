"""Token-true queues: a worker's queued prefill work is its planned prompts' true tokens, and
only the prefills its engine reports beyond them are priced at the traffic's mean prompt;
transfers on their way to a decode worker count there at the mean prompt (the decode work
promised to it, as the simulator has always shown them)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpd_scheduler.policy import Fleet, Stage

from .builders import NOW, worker

REF = 2000


def _backlog(
    queue: int, running: int = 0, pending_tokens: int = 0, known: int = 0, inbound: int = 0
) -> float:
    v = worker("w", Stage.PREFILL, queue=queue, pending_prefill_tokens=pending_tokens)
    assert v.load is not None
    v = replace(v, load=replace(v.load, running_prefills=running))
    fleet = Fleet.build(
        [v],
        NOW,
        ref_prompt_tokens=REF,
        known_prefills={"w": known} if known else None,
        inbound_transfers={"w": inbound} if inbound else None,
    )
    ws = fleet.worker("w")
    assert ws is not None
    return ws.backlog_tokens


def test_the_reported_queue_alone_is_priced_at_the_mean_prompt() -> None:
    assert _backlog(queue=3) == 3 * REF
    assert _backlog(queue=3, running=1) == 3.5 * REF


def test_known_plans_count_by_their_tokens_not_again_at_the_mean_prompt() -> None:
    # three 9,000-token prompts waiting, all planned by the scheduler: 27,000 tokens, not
    # 27,000 + 3 x 2,000 (the report's queue counted a second time)
    assert _backlog(queue=3, pending_tokens=27_000, known=3) == 27_000
    # one of the three came from elsewhere: it alone is priced at the mean prompt
    assert _backlog(queue=3, pending_tokens=18_000, known=2) == 18_000 + REF
    # the running prefill is one of the known ones once the queue is used up
    assert _backlog(queue=2, running=1, pending_tokens=5_000, known=3) == 5_000
    assert _backlog(queue=2, running=1, pending_tokens=5_000, known=2) == 5_000 + 0.5 * REF


@pytest.mark.parametrize("known", [4, 10])
def test_more_known_plans_than_the_report_shows_floor_at_zero(known: int) -> None:
    # plans not yet arrived at the engine (or done early) do not make the rest negative
    assert _backlog(queue=1, running=1, pending_tokens=7_000, known=known) == 7_000


def test_transfers_on_their_way_count_at_the_mean_prompt() -> None:
    assert _backlog(queue=0, inbound=4) == 4 * REF
    assert _backlog(queue=2, pending_tokens=3_000, known=1, inbound=1) == 3_000 + 2 * REF


def test_figures_for_other_workers_leave_a_worker_alone() -> None:
    v = worker("w", Stage.PREFILL, queue=2, pending_prefill_tokens=4_000)
    fleet = Fleet.build(
        [v], NOW, ref_prompt_tokens=REF, known_prefills={"x": 5}, inbound_transfers={"x": 3}
    )
    ws = fleet.worker("w")
    assert ws is not None and ws.backlog_tokens == 2 * REF + 4_000
