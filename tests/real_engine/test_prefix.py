"""Prefix-aware routing with real vLLM engines: their KV cache events (ZMQ) through the
agents, the registry's feed and the scheduler's index; the gateway keys each prompt's
blocks with the same chain.

A 600-token prompt, then one sharing its first 512 tokens: the second's plan names the
four 128-token blocks the prefill engine already holds (``cached_tokens`` 512 in the plan
and the route record), and that engine's ``vllm:prefix_cache_hits_total`` grows by them.
The suite runs two engines (one prefill, one decode: a third does not fit the machine's two
cores, see the conftest), so which of two prefill engines holds the prefix is shown by the
component tests (``tests/component/test_prefix_routing.py``); here the point is that the
keys the agent derives from the engine's events are the keys the gateway derives from the
prompt."""

from __future__ import annotations

import json
import random
import time
import urllib.request

from hetero_pd.v1 import scheduler_pb2 as s
from tests.real_engine.conftest import RealFleet
from tests.real_engine.test_agent import gauge
from tests.real_engine.test_gateway import record, why


def _complete(real: RealFleet, rid: str, prompt: list[int]) -> None:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2}).encode()
    req = urllib.request.Request(
        real.gateway_url + "/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", "x-request-id": rid},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200


def test_a_shared_prefix_is_planned_as_cached_and_hits_the_engines_cache(
    pd_pair: RealFleet,
) -> None:
    real = pd_pair
    rng = random.Random(time.monotonic_ns())
    _until_events_flow(real, rng)
    first = [rng.randrange(100, 900) for _ in range(600)]  # token ids: no tokenizer guesswork
    second = first[:512] + [rng.randrange(100, 900) for _ in range(88)]
    tag = time.monotonic_ns()
    _complete(real, f"pfx-a-{tag}", first)
    a = record(real, f"pfx-a-{tag}")
    assert a.plan.cached_tokens == 0, why(a)
    assert a.plan.prefill_worker_id == "p0", why(a)
    # the engine's events reach the scheduler's index within moments
    prefill = real.engines["prefill"]
    hits_before = gauge(prefill.metrics(), "vllm:prefix_cache_hits_total")
    deadline = time.monotonic() + 20
    probe = 0
    while True:
        probe += 1
        rid = f"pfx-probe-{tag}-{probe}"
        plan = real.scheduler.Schedule(
            s.ScheduleRequest(
                request_id=rid, model_id="tiny", prompt_tokens=600, expected_output_tokens=2,
                prefix_block_hashes=list(a_chain(first)), prefix_block_tokens=128,
            ),
            timeout=5,
        ).plan  # fmt: skip
        real.scheduler.ReportOutcome(
            s.ReportOutcomeRequest(request_id=rid, success=False, error_class="probe"), timeout=5
        )
        if plan.cached_tokens or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert plan.cached_tokens == 512, "the index never held the first prompt's blocks"
    _complete(real, f"pfx-b-{tag}", second)
    b = record(real, f"pfx-b-{tag}")
    assert b.plan.prefill_worker_id == "p0", why(b)
    assert b.plan.cached_tokens == 512, why(b)  # 4 x 128-token blocks
    hits = gauge(prefill.metrics(), "vllm:prefix_cache_hits_total") - hits_before
    assert hits >= 512, f"the prefill engine's prefix cache hits grew by {hits}"


def _cached(real: RealFleet, rid: str, prompt: list[int]) -> int:
    """The cached tokens a plan for ``prompt`` would count on (the probe is then released)."""
    plan = real.scheduler.Schedule(
        s.ScheduleRequest(
            request_id=rid, model_id="tiny", prompt_tokens=len(prompt), expected_output_tokens=2,
            prefix_block_hashes=list(a_chain(prompt)), prefix_block_tokens=128,
        ),
        timeout=5,
    ).plan  # fmt: skip
    real.scheduler.ReportOutcome(
        s.ReportOutcomeRequest(request_id=rid, success=False, error_class="probe"), timeout=5
    )
    return int(plan.cached_tokens)


def _until_events_flow(real: RealFleet, rng: random.Random) -> None:
    """A ZMQ subscriber misses what was published before its subscription reached the
    publisher (the agent subscribes when it registers; an engine restarted by an earlier
    test may serve a request first): warm-up prompts until one is seen in the index."""
    deadline = time.monotonic() + 60
    n = 0
    while time.monotonic() < deadline:
        n += 1
        warm = [rng.randrange(100, 900) for _ in range(256)]
        _complete(real, f"pfx-warm-{time.monotonic_ns()}", warm)
        until = time.monotonic() + 5
        while time.monotonic() < until:
            if _cached(real, f"pfx-warm-probe-{time.monotonic_ns()}", warm):
                return
            time.sleep(0.2)
    raise AssertionError(f"no KV event reached the index after {n} warm-up prompts")


def a_chain(tokens: list[int]) -> tuple[int, ...]:
    from hpd_common.kvchain import chain_hashes

    return chain_hashes(tokens, 128)
