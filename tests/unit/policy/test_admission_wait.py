"""The decode admission wait: how soon a worker whose batch is full frees a slot for a new
sequence (``WorkerState.admission_wait_ms``), with its running sequences living the traffic's
mean output (``Fleet.ref_output_tokens``), and how admission past capacity weighs a request
that would hold its slot longer than that."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from hpd_scheduler.policy import Fleet, Planner, PromptMix, Stage, builtin_profile

from .builders import GIB, NOW, request, state, worker

DEFAULT = builtin_profile("default")
assert DEFAULT.slo_objective is not None
NO_ADMISSION = replace(DEFAULT, slo_objective=replace(DEFAULT.slo_objective, admit_ttft_factor=0.0))


@pytest.mark.parametrize(
    ("batch", "queue", "kv_free_gib", "need_gib", "expect"),
    [
        pytest.param(10, 0, 30.0, 1.0, "zero", id="room-in-batch-and-memory"),
        pytest.param(255, 0, 30.0, 1.0, "zero", id="last-slot-free"),
        pytest.param(256, 0, 30.0, 1.0, "positive", id="batch-full"),
        pytest.param(200, 60, 30.0, 1.0, "positive", id="queue-ahead-fills-batch"),
        pytest.param(10, 0, 0.5, 1.0, "positive", id="memory-short"),
    ],
)
def test_admission_wait(
    batch: int, queue: int, kv_free_gib: float, need_gib: float, expect: str
) -> None:
    ws = state(batch=batch, queue=queue, kv_free_gib=kv_free_gib)
    wait = ws.admission_wait_ms(int(need_gib * GIB), 200.0)
    if expect == "zero":
        assert wait == 0.0
    else:
        assert wait > 0.0


def test_admission_wait_formula_for_a_full_batch() -> None:
    # deficit 256 + 0 + 1 - 256 = 1 slot; 256 running, each living 200 steps: 200/256 steps
    ws = state(batch=256, queue=0)
    wait = ws.admission_wait_ms(GIB, 200.0)
    assert wait == pytest.approx(200.0 / 256.0 * ws.step_ms())


def test_admission_wait_counts_steps_as_the_engines_prefills_stretch_them() -> None:
    # a full batch frees a slot only as fast as its steps run: on a worker prefilling half
    # its time a step takes twice as long from the waiting sequence's side (the stretch
    # WorkerState.tpot_ms applies to the running sequences), so the wait doubles
    idle = state(batch=256, queue=0)
    busy = state(batch=256, queue=0, prefill_busy=0.5)
    calm = idle.admission_wait_ms(GIB, 200.0)
    stretched = busy.admission_wait_ms(GIB, 200.0)
    assert calm == pytest.approx(200.0 / 256.0 * idle.step_ms())
    assert stretched == pytest.approx(2.0 * calm)
    # and a worker with room admits at once however busy it is
    assert state(batch=10, prefill_busy=0.9).admission_wait_ms(GIB, 200.0) == 0.0


def test_admission_wait_grows_with_the_queue_ahead() -> None:
    short = state(batch=256, queue=2).admission_wait_ms(GIB, 200.0)
    long = state(batch=256, queue=40).admission_wait_ms(GIB, 200.0)
    assert long > short > 0.0


def _full_batch_ttft(output: int, ref_output: int) -> float:
    """The TTFT estimate of a 1,000-token prompt with ``output`` tokens to come, decoding on
    an A100 whose batch is full with 20 more queued, on a fleet whose traffic's mean output
    is ``ref_output`` (0: unknown)."""
    views = [
        worker("p", Stage.PREFILL, gpu="H100-SXM", rack="r1"),
        worker("a100", Stage.DECODE, gpu="A100-80G", batch=256, queue=20, rack="r1"),
    ]
    fleet = Fleet.build(views, NOW, ref_output_tokens=ref_output)
    req = request(1000, output, "interactive")  # the estimate, admitted or not
    d = Planner(NO_ADMISSION).plan(req, fleet, NOW, random.Random(0))
    assert d.record is not None and d.record.options
    return min(o.ttft_ms for o in d.record.options)


def test_a_full_batch_frees_slots_as_fast_as_the_traffics_sequences_end() -> None:
    # Little's law: B running sequences living L decode steps on average free B / L slots a
    # step, and L is how long *they* live (the traffic's mean output), not this request; with
    # its own output standing for theirs, the short-output requests were the ones predicted
    # to be admitted soon, and near the admission limit those were the ones that missed
    short, long = _full_batch_ttft(40, 400), _full_batch_ttft(1200, 400)
    assert short == pytest.approx(long)
    assert _full_batch_ttft(40, 0) < short  # mix unknown: its own 40 steps stand for theirs
    assert _full_batch_ttft(400, 0) == pytest.approx(short)
    assert _full_batch_ttft(40, 800) > short  # longer-lived sequences free slots more slowly


def _admitted(output: int, queue: int) -> bool:
    """Whether the default profile admits a 1,000-token prompt with ``output`` tokens to come
    while the only decode worker's batch is full with ``queue`` more waiting (the traffic's
    mean output 400 tokens)."""
    views = [
        worker("p", Stage.PREFILL, gpu="H100-SXM", rack="r1"),
        worker("a100", Stage.DECODE, gpu="A100-80G", batch=256, queue=queue, rack="r1"),
    ]
    fleet = Fleet.build(views, NOW, ref_output_tokens=400)
    d = Planner(DEFAULT).plan(request(1000, output, "interactive"), fleet, NOW, random.Random(0))
    if d.plan is None:
        assert d.reject_reasons == ("ttft_over_admission_limit",)
    return d.plan is not None


def test_past_capacity_the_requests_holding_a_slot_longest_are_refused_first() -> None:
    # queue 20: the wait for a slot (about 620 ms) is within the 850 ms admission limit for a
    # request of the traffic's mean output or less, not for one that would hold its slot 4x
    # as long (judged at 4x the wait): refusing it frees what four mean requests would use
    assert _admitted(100, queue=20) and _admitted(400, queue=20)
    assert not _admitted(1600, queue=20)
    # a batch with room: no wait, nothing to weigh, the long request is admitted
    assert _admitted(1600, queue=0)
    # queue 40 (a wait of about 1.2 s): a short request is refused too; with its own 100
    # tokens standing for the running sequences' lives its wait looked a quarter as long
    assert not _admitted(100, queue=40)


def test_the_output_mix_knows_nothing_until_its_first_request() -> None:
    mix = PromptMix(initial_tokens=None)
    assert mix.ref_tokens() == 0
    mix.observe(0)  # no output expected: not a sample
    assert mix.ref_tokens() == 0
    mix.observe(300)
    assert 300 / 1.25 < mix.ref_tokens() < 300 * 1.25  # the first sample sets the mean
    for _ in range(500):
        mix.observe(3000)
    assert 3000 / 1.25 < mix.ref_tokens() < 3000 * 1.25
    assert 1024 / 1.25 < PromptMix().ref_tokens() < 1024 * 1.25  # the prompts keep a prior
