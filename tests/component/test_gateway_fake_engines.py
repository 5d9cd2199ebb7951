"""`hpd gateway` over HTTP in front of fake engines (`tests/support/gateway_rig.py`): the
hand-off modes (TRANSFER with vLLM's protocol, RECOMPUTE, SAME_POOL) and the fallback chain."""

from __future__ import annotations

import pytest

from hpd_gateway.plan import RECOMPUTE, SAME_POOL, TRANSFER
from tests.support.gateway_rig import (
    CHAT,
    COMPLETIONS,
    MODEL,
    PATHS,
    PROMPT_TOKENS,
    SESSION,
    STREAMED,
    Rig,
    answer_text,
    fallback,
    request_body,
    token_text,
)
from tests.support.gateway_rig import (
    rig as rig,
)

# -- TRANSFER ----------------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", STREAMED)
@pytest.mark.parametrize("path", PATHS)
async def test_transfer_hands_kv_from_prefill_to_decode(
    rig: Rig, path: str, streamed: bool
) -> None:
    rig.use(rig.primary(TRANSFER, "d1", "p1"), fallback(RECOMPUTE, "d2"))
    sent = request_body(path, stream=streamed, ignore_eos=True)
    if streamed:
        _, events = await rig.stream(path, sent)
        assert events[-1] == "[DONE]"
        assert all("usage" not in e for e in events[:-1])  # the client did not ask for usage
        text = token_text(path, events)
    else:
        status, headers, answer = await rig.post(path, sent, {"x-request-id": "req-1"})
        assert status == 200
        assert headers["x-request-id"] == "req-1"
        assert "kv_transfer_params" not in answer
        assert answer["usage"]["completion_tokens"] == 3
        text = answer_text(path, answer["choices"][0])
    assert text == "d1-0 d1-1 d1-2 "

    [prefill] = rig["p1"].generations
    expected_prefill = {k: v for k, v in sent.items() if k != "stream_options"} | {
        "stream": False,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    if path == CHAT:
        expected_prefill["max_completion_tokens"] = 1
    assert prefill == expected_prefill

    [decode] = rig["d1"].generations
    assert decode["kv_transfer_params"] == rig["p1"].params()
    assert decode["max_tokens"] == 3
    assert decode["stream"] is streamed
    assert decode.get("stream_options") == ({"include_usage": True} if streamed else None)
    assert rig["d2"].calls == []

    out = await rig.control.outcome()
    assert (out.success, out.mode, out.error_class, out.fallbacks) == (True, TRANSFER, "", 0)
    assert out.ttft_ms > 0
    assert out.prefill_ms > 0
    assert out.output_tokens == 3
    await rig.control.until(lambda: bool(rig.control.done))
    assert rig.control.done == [SESSION]
    assert rig.control.failed == []
    [(rid, model, prompt_tokens, output_tokens, tier)] = rig.control.scheduled
    assert (model, prompt_tokens, output_tokens, tier) == (MODEL, PROMPT_TOKENS, 3, "standard")
    assert rig.control.reports[0][0] == rid
    if not streamed:
        assert rid == "req-1"


@pytest.mark.parametrize("path", PATHS)
async def test_stream_passes_usage_when_the_client_asks(rig: Rig, path: str) -> None:
    rig.use(rig.primary(TRANSFER, "d1", "p1"))
    sent = request_body(path, stream=True, stream_options={"include_usage": True})
    _, events = await rig.stream(path, sent)
    assert events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 3
    assert events[-1] == "[DONE]"


# -- RECOMPUTE and SAME_POOL -------------------------------------------------------------------


@pytest.mark.parametrize("streamed", STREAMED)
@pytest.mark.parametrize("mode", [RECOMPUTE, SAME_POOL])
async def test_recompute_goes_straight_to_decode(rig: Rig, mode: str, streamed: bool) -> None:
    rig.use(rig.primary(mode, "d1"))
    sent = request_body(COMPLETIONS, stream=streamed)
    if streamed:
        _, events = await rig.stream(COMPLETIONS, sent)
        text = token_text(COMPLETIONS, events)
    else:
        status, _, answer = await rig.post(COMPLETIONS, sent)
        assert status == 200
        text = answer["choices"][0]["text"]
    assert text == "d1-0 d1-1 d1-2 "
    [decode] = rig["d1"].generations
    assert "kv_transfer_params" not in decode
    expected = sent | ({"stream_options": {"include_usage": True}} if streamed else {})
    assert decode == expected
    assert rig["p1"].generations == []
    out = await rig.control.outcome()
    assert (out.success, out.mode, out.fallbacks) == (True, mode, 0)
    assert out.ttft_ms > 0
    assert (rig.control.done, rig.control.failed) == ([], [])


# -- fallbacks ---------------------------------------------------------------------------------

# (failing engine, its behaviour, primary decode worker, cause, prefill ran)
FAILURES = [
    pytest.param("", "", "dead", "decode_connect_error", True, id="decode-refuses-connections"),
    pytest.param("d1", "error500", "d1", "decode_upstream_5xx", True, id="decode-answers-500"),
    pytest.param("p1", "error500", "d1", "prefill_upstream_5xx", False, id="prefill-answers-500"),
]  # fmt: skip


@pytest.mark.parametrize("streamed", STREAMED)
@pytest.mark.parametrize(("failing", "behaviour", "decode", "cause", "prefilled"), FAILURES)
async def test_a_failed_step_falls_back_to_the_next(
    rig: Rig,
    failing: str,
    behaviour: str,
    decode: str,
    cause: str,
    prefilled: bool,
    streamed: bool,
) -> None:
    if failing:
        rig[failing].behaviour = behaviour
    rig.use(rig.primary(TRANSFER, decode, "p1"), fallback(RECOMPUTE, "d2"))
    sent = request_body(COMPLETIONS, stream=streamed)
    if streamed:
        _, events = await rig.stream(COMPLETIONS, sent)
        assert events[-1] == "[DONE]"
        text = token_text(COMPLETIONS, events)
    else:
        status, _, answer = await rig.post(COMPLETIONS, sent)
        assert status == 200
        text = answer["choices"][0]["text"]
    assert text == "d2-0 d2-1 d2-2 "
    [served] = rig["d2"].generations
    assert "kv_transfer_params" not in served
    out = await rig.control.outcome()
    assert (out.success, out.mode, out.error_class, out.fallbacks) == (
        True,
        RECOMPUTE,
        cause,
        1,
    )
    await rig.control.until(lambda: bool(rig.control.failed))
    assert rig.control.failed == [(SESSION, cause, prefilled)]
    assert rig.control.done == []


async def test_a_transfer_fallback_resolves_its_workers_and_skips_one_that_left(rig: Rig) -> None:
    rig.use(
        rig.primary(TRANSFER, "dead", "p1"),
        fallback(TRANSFER, "gone", "p1"),
        fallback(TRANSFER, "d2", "p1"),
    )
    status, _, answer = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
    assert status == 200
    assert answer["choices"][0]["text"] == "d2-0 d2-1 d2-2 "
    [decode] = rig["d2"].generations
    assert decode["kv_transfer_params"] == rig["p1"].params()
    assert len(rig["p1"].generations) == 2  # the primary's prefill and the fallback's
    out = await rig.control.outcome()
    assert (out.success, out.mode, out.error_class, out.fallbacks) == (
        True,
        TRANSFER,
        "decode_connect_error",
        1,
    )
    # the broker session belongs to the primary step only
    await rig.control.until(lambda: bool(rig.control.failed))
    assert rig.control.failed == [(SESSION, "decode_connect_error", True)]
    assert rig.control.done == []


@pytest.mark.parametrize("path", PATHS)
async def test_a_failure_mid_stream_ends_the_stream_without_restarting(rig: Rig, path: str) -> None:
    rig["d1"].behaviour = "drop"
    rig["d1"].tokens = 5
    rig.use(rig.primary(RECOMPUTE, "d1"), fallback(RECOMPUTE, "d2"))
    status, events = await rig.stream(path, request_body(path, stream=True, max_tokens=5))
    assert status == 200
    assert token_text(path, events) == "d1-0 d1-1 "
    *tokens, error, done = events
    assert len(tokens) == 2
    assert set(error) == {"error"}
    assert error["error"]["type"] == "server_error"
    assert error["error"]["code"] == "upstream_error"
    assert error["error"]["param"] is None
    assert "decode_connect_error" in error["error"]["message"]
    assert done == "[DONE]"
    assert rig["d2"].calls == []
    out = await rig.control.outcome()
    assert (out.success, out.mode, out.error_class, out.fallbacks) == (
        False,
        RECOMPUTE,
        "decode_connect_error",
        0,
    )


async def test_a_failure_mid_stream_after_a_transfer_completes_the_session_first(
    rig: Rig,
) -> None:
    rig["d1"].behaviour = "drop"
    rig["d1"].tokens = 5
    rig.use(rig.primary(TRANSFER, "d1", "p1"), fallback(RECOMPUTE, "d2"))
    _, events = await rig.stream(COMPLETIONS, request_body(COMPLETIONS, stream=True))
    assert events[-1] == "[DONE]"
    assert "error" in events[-2]
    assert rig["d2"].calls == []
    await rig.control.outcome()
    await rig.control.until(lambda: bool(rig.control.done))
    assert rig.control.done == [SESSION]


@pytest.mark.parametrize("streamed", STREAMED)
async def test_every_step_failing_is_502(rig: Rig, streamed: bool) -> None:
    rig["d2"].behaviour = "error500"
    rig.use(rig.primary(TRANSFER, "dead", "p1"), fallback(RECOMPUTE, "d2"))
    status, _, answer = await rig.post(COMPLETIONS, request_body(COMPLETIONS, stream=streamed))
    assert status == 502
    assert set(answer) == {"error"}
    err = answer["error"]
    assert (err["type"], err["code"], err["param"]) == ("server_error", "upstream_error", None)
    assert "decode_connect_error" in err["message"]
    # the plan, then one re-plan under a request id of its own: both reported failed
    await rig.control.until(lambda: len(rig.control.reports) == 2)
    (rid1, first), (rid2, second) = sorted(rig.control.reports, key=lambda r: r[0])
    assert rid2 == rid1 + ":replan"
    assert len(rig.control.scheduled) == 2
    # the re-plan avoids the workers whose steps failed (the view may still list them)
    assert rig.control.avoided == [(), ("dead", "d2")]
    for out in (first, second):
        assert (out.success, out.error_class, out.status) == (False, "decode_connect_error", 502)
    assert second.fallbacks == 4  # two steps of each plan


@pytest.mark.parametrize("streamed", STREAMED)
@pytest.mark.parametrize("status_4xx", [400, 404, 422])
async def test_an_engine_4xx_goes_back_to_the_client_without_fallback(
    rig: Rig, status_4xx: int, streamed: bool
) -> None:
    rig["d1"].behaviour = "error4xx"
    rig["d1"].status_4xx = status_4xx
    rig.use(rig.primary(RECOMPUTE, "d1"), fallback(RECOMPUTE, "d2"))
    status, _, answer = await rig.post(COMPLETIONS, request_body(COMPLETIONS, stream=streamed))
    assert status == status_4xx
    assert set(answer) == {"error"}
    assert answer["error"]["type"] == "invalid_request_error"
    assert "d1 says no" in answer["error"]["message"]
    assert rig["d2"].calls == []
    out = await rig.control.outcome()
    assert (out.success, out.status, out.fallbacks) == (False, status_4xx, 0)
