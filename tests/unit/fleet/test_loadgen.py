"""The load generator's traffic (hpd_fleet.loadgen): trace lengths scaled into the model's
context with their shape kept, chat sessions that share prefixes, Poisson arrivals at the
asked rate, and per-arm prompts that keep the mix's structure but share no cache."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from hpd_fleet.loadgen import Mix, for_arm, jobs_at, shapes

AZURE = Path(__file__).resolve().parents[3] / "data" / "traces" / "azure_llm_2023_conv.csv"


def test_azure_lengths_fit_the_model_and_keep_their_spread() -> None:
    mix = Mix("azure", AZURE, max_model_len=1024, max_output=48)
    got = shapes(mix, 500, random.Random(1))
    prompts = sorted(len(p) for p, _ in got)
    outputs = [o for _, o in got]
    assert max(prompts) <= 1024 - 48 - 8 and min(prompts) >= 1
    assert max(outputs) <= 48
    # the trace's shape is kept: a long tail, not every prompt at the budget
    assert prompts[len(prompts) // 2] < 0.6 * prompts[-1]


def test_chat_turns_repeat_the_conversation_so_far() -> None:
    got = shapes(Mix("chat", AZURE), 60, random.Random(2))
    shared = sum(1 for (a, _), (b, _) in itertools.pairwise(got) if b[: len(a)] == a)
    assert shared >= 20  # most turns extend the one before


def test_arrivals_come_at_the_asked_rate() -> None:
    jobs = jobs_at(10.0, 60.0, Mix("azure", AZURE), seed=3)
    assert 480 < len(jobs) < 720
    assert all(0 <= j.at_s < 60 for j in jobs)


def test_every_arm_gets_the_same_shapes_and_no_shared_cache() -> None:
    jobs = jobs_at(5.0, 10.0, Mix("chat", AZURE), seed=4)
    a, b = for_arm(jobs, 0), for_arm(jobs, 1)
    assert [(j.at_s, len(j.prompt), j.max_tokens) for j in a] == [
        (j.at_s, len(j.prompt), j.max_tokens) for j in b
    ]
    assert all(x.prompt[:8] != y.prompt[:8] for x, y in zip(a, b, strict=True))
    # prefixes shared inside the mix stay shared inside an arm
    for x, y, (p, q) in zip(a, a[1:], itertools.pairwise(jobs), strict=False):
        assert (q.prompt[: len(p.prompt)] == p.prompt) == (y.prompt[: len(x.prompt)] == x.prompt)


def test_a_mix_that_cannot_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="azure or chat"):
        Mix("sharegpt", AZURE)
    with pytest.raises(ValueError, match="no room"):
        Mix("azure", AZURE, max_model_len=50, max_output=48)
