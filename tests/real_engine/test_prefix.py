"""Prefix-aware routing with real vLLM engines: their KV cache events (ZMQ) through the
agents, the registry's feed and the scheduler's index; the gateway keys each prompt's
blocks with the same chain.

* On the P/D pair: a 600-token prompt, then one sharing its first 512 tokens: the second's
  plan names the four 128-token blocks the prefill engine already holds (``cached_tokens``
  512 in the plan and the route record), and that engine's
  ``vllm:prefix_cache_hits_total`` grows by them; after the prefill engine's agent restarts,
  the index holds what the engine cached before (the engine's replayed events).
* On two engines without a KV connector (``cache_pair``: two NIXL engines and a third do
  not fit the machine's two cores, see the conftest), each holding a different prefix: a
  request sharing one goes to the engine that holds it.
"""

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
    assert plan.cached_tokens == 512, (
        f"the index never held the first prompt's blocks: {why(record(real, rid, timeout_s=2))}"
    )
    _complete(real, f"pfx-b-{tag}", second)
    b = record(real, f"pfx-b-{tag}")
    assert b.plan.prefill_worker_id == "p0", why(b)
    assert b.plan.cached_tokens == 512, why(b)  # 4 x 128-token blocks
    hits = gauge(prefill.metrics(), "vllm:prefix_cache_hits_total") - hits_before
    assert hits >= 512, f"the prefill engine's prefix cache hits grew by {hits}"


def test_an_agent_that_restarts_reports_what_its_engine_cached_before(
    pd_pair: RealFleet,
) -> None:
    """The index is rebuilt after an agent restart from the engine's replayed events: the
    prefill engine keeps running while its agent is stopped (the worker leaves, the index
    forgets it) and started again; with no request to the engine in between, the index
    holds the blocks it cached before (without the replay it would start empty)."""
    real = pd_pair
    rng = random.Random(time.monotonic_ns())
    _until_events_flow(real, rng)
    prompt = [rng.randrange(100, 900) for _ in range(600)]
    tag = time.monotonic_ns()
    _complete(real, f"pfx-r-{tag}", prompt)
    missed = _wait_cached(real, prompt, 512, f"pfx-r-probe-{tag}")
    assert not missed, f"never indexed; the request: {why(record(real, f'pfx-r-{tag}'))}; {missed}"
    real.agents.pop("p0").stop()
    real.wait_worker("p0", present=False, timeout_s=30)
    # the worker is gone: a plan no longer counts on its cache (d0 prefills for itself)
    missed = _wait_cached(real, prompt, 0, f"pfx-r-gone-{tag}")
    assert not missed, f"the index kept a gone worker: {missed}"
    prefill = real.engines["prefill"]
    requests_before = gauge(prefill.metrics(), "vllm:prefix_cache_queries_total")
    real.agents["p0"] = real.start_agent("p0", "prefill", "p0", "prefill")
    real.wait_worker("p0", timeout_s=60)
    missed = _wait_cached(real, prompt, 512, f"pfx-r-back-{tag}")
    assert not missed, (
        f"after the agent's restart the index never held the blocks the engine cached before: "
        f"{missed}"
    )
    # nothing reached the engine meanwhile: the blocks came from the replayed history
    assert gauge(prefill.metrics(), "vllm:prefix_cache_queries_total") == requests_before


def _wait_cached(real: RealFleet, prompt: list[int], want: int, tag: str) -> str:
    """ "" when a plan for ``prompt`` counts ``want`` cached tokens within 20 s; otherwise
    the last probe's plan and explanation (what the planner saw instead)."""
    deadline = time.monotonic() + 20
    n = 0
    while time.monotonic() < deadline:
        n += 1
        if _cached(real, f"{tag}-{n}", prompt) == want:
            return ""
        time.sleep(0.2)
    return f"after {n} probes: {why(record(real, f'{tag}-{n}', timeout_s=2))}"


def _cached(real: RealFleet, rid: str, prompt: list[int]) -> int:
    """The cached tokens a plan for ``prompt`` would count on (the probe is then released)."""
    return _probe(real, rid, prompt)[1]


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


def test_of_two_engines_each_request_goes_to_the_one_holding_its_prefix(
    cache_pair: RealFleet,
) -> None:
    """Prompt A cached on engine c0 and prompt B on c1 (each sent to its engine directly);
    then A' and B', each sharing the first 512 tokens of one of them, through the gateway:
    each plan names the holder with 512 cached tokens, and the holder's own prefix cache
    hits grow by them."""
    real = cache_pair
    rng = random.Random(time.monotonic_ns())
    engines = {"c0": real.engines["cache0"], "c1": real.engines["cache1"]}
    prompts = {wid: [rng.randrange(100, 900) for _ in range(600)] for wid in engines}
    for wid, prompt in prompts.items():
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}).encode()
        req = urllib.request.Request(
            engines[wid].url + "/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert resp.status == 200
    tag = time.monotonic_ns()
    for wid, prompt in prompts.items():
        deadline = time.monotonic() + 20
        n = 0
        while True:
            n += 1
            got = _probe(real, f"pfx-2-probe-{wid}-{tag}-{n}", prompt)
            if got == (wid, 512) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert got == (wid, 512), (
            f"the index never showed {wid}'s prefix on {wid}: {got}; the last probe: "
            f"{why(record(real, f'pfx-2-probe-{wid}-{tag}-{n}', timeout_s=2))}"
        )
    hits_before = {
        wid: gauge(e.metrics(), "vllm:prefix_cache_hits_total") for wid, e in engines.items()
    }
    for wid, prompt in prompts.items():
        rid = f"pfx-2-{wid}-{tag}"
        _complete(real, rid, prompt[:512] + [rng.randrange(100, 900) for _ in range(88)])
        rec = record(real, rid)
        assert rec.plan.prefill_worker_id == wid, why(rec)
        assert rec.plan.cached_tokens == 512, why(rec)  # 4 x 128-token blocks
    for wid, e in engines.items():
        hits = gauge(e.metrics(), "vllm:prefix_cache_hits_total") - hits_before[wid]
        assert hits >= 512, f"{wid}'s prefix cache hits grew by {hits}"


def _probe(real: RealFleet, rid: str, prompt: list[int]) -> tuple[str, int]:
    """The prefill worker and cached tokens of a plan for ``prompt`` (then released)."""
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
    return plan.prefill_worker_id, int(plan.cached_tokens)
