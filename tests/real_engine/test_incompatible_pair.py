"""A pair whose KV really cannot move: an fp32 prefill engine beside a bf16 decode engine.

Runs last (its fixture swaps the bf16 prefill engine out, which costs an engine start),
and the direct NIXL attempt runs last of all (the decode engine counts its failure a moment
after answering, which would leak into a test that follows):
NIXL itself fails the pair, the broker refuses it before any transfer, the scheduler plans
recompute, and the gateway serves the request that way without a NIXL attempt."""

from __future__ import annotations

import json
import time
import urllib.error

import pytest

from hetero_pd.v1 import kvbroker_pb2 as kb
from hetero_pd.v1 import scheduler_pb2 as s
from hpd_fleet.real_processes import http_json
from tests.real_engine.conftest import RealFleet
from tests.real_engine.test_agent import PROMPT, check_kv_format, gauge, hpd
from tests.real_engine.test_gateway import by_source, client, fresh_prompt, record


def test_the_fp32_engine_registers_fp32_kv(fp32_prefill: RealFleet) -> None:
    real = fp32_prefill
    workers = {
        w["capability"]["worker_id"]: w
        for w in json.loads(hpd("workers", "--registry", real.registry_addr, "-o", "json"))
    }
    check_kv_format(real, workers["x0"], "prefill32", "KV_DTYPE_FP32")


def test_the_really_incompatible_pair_is_refused_before_any_transfer(
    fp32_prefill: RealFleet,
) -> None:
    """fp32 prefill -> bf16 decode: NIXL itself fails it (next test); the broker refuses
    it, the matrix leaves it out, and a Schedule that can only pair them plans recompute."""
    real = fp32_prefill
    neg = real.broker.Negotiate(
        kb.NegotiateRequest(source_worker_id="x0", destination_worker_id="d0"), timeout=5
    )
    assert neg.negotiation.verdict == kb.COMPATIBILITY_VERDICT_INCOMPATIBLE
    assert "kv_dtype_narrowing_not_allowed" in neg.negotiation.reasons
    matrix = real.broker.GetCompatibilityMatrix(
        kb.GetCompatibilityMatrixRequest(model_id="tiny"), timeout=5
    )
    verdicts = {(p.prefill_worker_id, p.decode_worker_id): p.negotiation.verdict
                for p in matrix.pairs}  # fmt: skip
    assert verdicts[("x0", "d0")] == kb.COMPATIBILITY_VERDICT_INCOMPATIBLE
    # x0 is the only prefill worker now: the one pair a transfer could use is refused
    plan = real.scheduler.Schedule(
        s.ScheduleRequest(
            request_id=f"incompat-{time.monotonic_ns()}",
            model_id="tiny",
            prompt_tokens=300,
            expected_output_tokens=16,
            tier="standard",
        ),
        timeout=5,
    ).plan
    assert plan.mode == s.EXECUTION_MODE_RECOMPUTE, plan
    assert plan.decode_worker_id == "d0"
    assert not plan.kv_session_id
    for step in plan.fallbacks:
        assert step.mode != s.EXECUTION_MODE_TRANSFER or (
            step.prefill_worker_id,
            step.decode_worker_id,
        ) != ("x0", "d0"), step


def test_the_incompatible_pair_is_served_by_recompute_without_a_nixl_attempt(
    fp32_prefill: RealFleet,
) -> None:
    real = fp32_prefill
    dec, pre = real.engines["decode"], real.engines["prefill32"]
    failed = gauge(dec.metrics(), "vllm:nixl_num_failed_transfers_total")
    before = by_source(dec.metrics())
    pre_prompts = gauge(pre.metrics(), "vllm:prompt_tokens_total")
    rid = f"incompat-gw-{time.monotonic_ns()}"
    out = client(real).completions.create(
        model="tiny", prompt=fresh_prompt(), max_tokens=5, temperature=0,
        extra_headers={"x-request-id": rid},
    )  # fmt: skip
    assert out.choices and out.usage is not None
    rec = record(real, rid)
    assert rec.plan.mode == s.EXECUTION_MODE_RECOMPUTE
    assert rec.outcome.success and rec.outcome.mode_used == s.EXECUTION_MODE_RECOMPUTE
    after = by_source(dec.metrics())
    assert after["external_kv_transfer"] == before["external_kv_transfer"]
    assert after["local_compute"] - before["local_compute"] == out.usage.prompt_tokens
    assert gauge(dec.metrics(), "vllm:nixl_num_failed_transfers_total") == failed
    assert gauge(pre.metrics(), "vllm:prompt_tokens_total") == pre_prompts  # never asked


def test_without_hetero_pd_nixl_fails_that_pair(fp32_prefill: RealFleet) -> None:
    """What the broker prevents: the same P/D flow sent straight to the engines fails in
    NIXL's handshake (the decode engine answers 500 and counts a failed transfer)."""
    real = fp32_prefill
    pre, dec = real.engines["prefill32"], real.engines["decode"]
    failed_before = gauge(dec.metrics(), "vllm:nixl_num_failed_transfers_total")
    first = http_json(
        pre.url + "/v1/completions",
        {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    )
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    with pytest.raises(urllib.error.HTTPError) as err:
        http_json(
            dec.url + "/v1/completions",
            {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params},
        )
    assert err.value.code == 500
    assert gauge(dec.metrics(), "vllm:nixl_num_failed_transfers_total") > failed_before
    assert dec.healthy()
