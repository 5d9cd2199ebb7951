"""The gateway's wire protocol: which client bodies are refused (and with which field
named), what is read from the good ones, and vLLM's NIXL hand-off bodies."""

from __future__ import annotations

import copy
import gc
import json
from typing import Any

import grpc
import pytest

from hpd_gateway.protocol import (
    CHAT,
    COMPLETIONS,
    MAX_TOKENS_LIMIT,
    BadRequest,
    ClientRequest,
    GatewayError,
    decode_body,
    error_body,
    parse_request,
    prefill_body,
    sse_event,
    strip_usage_chunk,
)

MISSING = object()  # an override that removes the key from the base body

BASE: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"model": "tiny", "prompt": "Hello"},
    CHAT: {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]},
}


def body_of(kind: str, overrides: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(BASE[kind])
    for key, value in overrides.items():
        if value is MISSING:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def raw_of(kind: str, overrides: dict[str, Any]) -> bytes:
    return json.dumps(body_of(kind, overrides)).encode()


def parse(kind: str, **overrides: Any) -> ClientRequest:
    return parse_request(kind, raw_of(kind, overrides))


# -- refused bodies ----------------------------------------------------------------------------

# Raw bodies that are not a JSON object: (id, raw, param), for both kinds.
NOT_AN_OBJECT: list[tuple[str, bytes, str]] = [
    ("malformed-json", b'{"model": "tiny",', "body"),
    ("empty-body", b"", "body"),
    ("not-utf8", b'{"model": "\x80"}', "body"),
    ("array-body", b'[{"model": "tiny"}]', "body"),
    ("string-body", b'"tiny"', "body"),
    ("null-body", b"null", "body"),
]

# Overrides of a good body refused for both kinds: (id, overrides, param).
BOTH_BAD: list[tuple[str, dict[str, Any], str]] = [
    ("model-missing", {"model": MISSING}, "model"),
    ("model-empty", {"model": ""}, "model"),
    ("model-blank", {"model": "   "}, "model"),
    ("model-not-string", {"model": 7}, "model"),
    ("max-tokens-negative", {"max_tokens": -1}, "max_tokens"),
    ("max-tokens-zero", {"max_tokens": 0}, "max_tokens"),
    ("max-tokens-bool", {"max_tokens": True}, "max_tokens"),
    ("max-tokens-float", {"max_tokens": 16.0}, "max_tokens"),
    ("max-tokens-string", {"max_tokens": "16"}, "max_tokens"),
    ("max-tokens-huge", {"max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens"),
    ("n-two", {"n": 2}, "n"),
    ("n-zero", {"n": 0}, "n"),
    ("stream-string", {"stream": "true"}, "stream"),
    ("stream-int", {"stream": 1}, "stream"),
    ("temperature-nan", {"temperature": float("nan")}, "temperature"),
    ("temperature-infinity", {"temperature": float("inf")}, "temperature"),
    ("temperature-string", {"temperature": "0.7"}, "temperature"),
    ("temperature-bool", {"temperature": True}, "temperature"),
    ("top-p-nan", {"top_p": float("nan")}, "top_p"),
    ("kv-transfer-params-set", {"kv_transfer_params": {"do_remote_decode": True}},
     "kv_transfer_params"),
    ("kv-transfer-params-null", {"kv_transfer_params": None}, "kv_transfer_params"),
    ("stream-options-string", {"stream": True, "stream_options": "usage"}, "stream_options"),
    ("stream-options-list", {"stream": True, "stream_options": []}, "stream_options"),
    ("stream-options-bool", {"stream": True, "stream_options": True}, "stream_options"),
]  # fmt: skip

COMPLETIONS_BAD: list[tuple[str, dict[str, Any], str]] = [
    ("prompt-missing", {"prompt": MISSING}, "prompt"),
    ("prompt-null", {"prompt": None}, "prompt"),
    ("prompt-empty-string", {"prompt": ""}, "prompt"),
    ("prompt-empty-list", {"prompt": []}, "prompt"),
    ("prompt-int", {"prompt": 7}, "prompt"),
    ("prompt-object", {"prompt": {"text": "hi"}}, "prompt"),
    ("prompt-mixed-list", {"prompt": [1, "a"]}, "prompt"),
    ("prompt-negative-token", {"prompt": [1, -1]}, "prompt"),
    ("prompt-bool-token", {"prompt": [True]}, "prompt"),
    ("prompt-float-token", {"prompt": [1.0]}, "prompt"),
    ("prompt-two-strings", {"prompt": ["a", "b"]}, "prompt"),
    ("prompt-one-empty-string", {"prompt": [""]}, "prompt"),
    ("prompt-batch-of-token-lists", {"prompt": [[1, 2], [3]]}, "prompt"),
]

CHAT_BAD: list[tuple[str, dict[str, Any], str]] = [
    ("messages-missing", {"messages": MISSING}, "messages"),
    ("messages-null", {"messages": None}, "messages"),
    ("messages-string", {"messages": "Hello"}, "messages"),
    ("messages-object", {"messages": {"role": "user"}}, "messages"),
    ("messages-empty", {"messages": []}, "messages"),
    ("message-not-object", {"messages": ["Hello"]}, "messages[0]"),
    ("message-role-missing", {"messages": [{"content": "Hello"}]}, "messages[0].role"),
    ("message-role-empty", {"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
    ("message-role-int", {"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
    ("message-content-int", {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content"),
    ("message-content-object", {"messages": [{"role": "user", "content": {"t": "x"}}]},
     "messages[0].content"),
    ("second-message-role-missing",
     {"messages": [{"role": "user", "content": "x"}, {"content": "y"}]}, "messages[1].role"),
    ("max-completion-tokens-zero", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("max-completion-tokens-negative", {"max_completion_tokens": -5},
     "max_completion_tokens"),
    ("max-completion-tokens-bool", {"max_completion_tokens": False}, "max_completion_tokens"),
    ("max-completion-tokens-string", {"max_completion_tokens": "8"},
     "max_completion_tokens"),
    ("max-completion-tokens-huge", {"max_completion_tokens": MAX_TOKENS_LIMIT + 1},
     "max_completion_tokens"),
    ("max-completion-tokens-fine-max-tokens-bad",
     {"max_completion_tokens": 8, "max_tokens": 0}, "max_tokens"),
]  # fmt: skip

REFUSED = (
    [
        pytest.param(kind, raw, param, id=f"{kind}-{name}")
        for kind in (COMPLETIONS, CHAT)
        for name, raw, param in NOT_AN_OBJECT
    ]
    + [
        pytest.param(kind, raw_of(kind, overrides), param, id=f"{kind}-{name}")
        for kind in (COMPLETIONS, CHAT)
        for name, overrides, param in BOTH_BAD
    ]
    + [
        pytest.param(COMPLETIONS, raw_of(COMPLETIONS, o), p, id=f"completions-{name}")
        for name, o, p in COMPLETIONS_BAD
    ]
    + [pytest.param(CHAT, raw_of(CHAT, o), p, id=f"chat-{name}") for name, o, p in CHAT_BAD]
)


@pytest.mark.parametrize(("kind", "raw", "param"), REFUSED)
def test_bad_input_is_400_naming_the_field(kind: str, raw: bytes, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_request(kind, raw)
    exc = info.value
    assert (exc.status, exc.param, exc.code, exc.type) == (
        400,
        param,
        "invalid_value",
        "invalid_request_error",
    )
    assert exc.message.startswith(f"{param}: ")
    assert exc.body()["error"]["param"] == param


# -- accepted bodies ---------------------------------------------------------------------------

# (kind, overrides, expected (model, stream, max_tokens, include_usage))
ACCEPTED = [
    pytest.param(COMPLETIONS, {}, ("tiny", False, 0, False), id="completions-minimal"),
    pytest.param(CHAT, {}, ("tiny", False, 0, False), id="chat-minimal"),
    pytest.param(COMPLETIONS, {"model": "  tiny\t"}, ("tiny", False, 0, False),
                 id="model-stripped"),
    pytest.param(COMPLETIONS, {"stream": True}, ("tiny", True, 0, False), id="stream"),
    pytest.param(COMPLETIONS, {"stream": None}, ("tiny", False, 0, False), id="stream-null"),
    pytest.param(COMPLETIONS, {"stream": True, "stream_options": {"include_usage": True}},
                 ("tiny", True, 0, True), id="include-usage"),
    pytest.param(COMPLETIONS, {"stream": True, "stream_options": {"include_usage": False}},
                 ("tiny", True, 0, False), id="include-usage-false"),
    pytest.param(COMPLETIONS, {"stream": True, "stream_options": None},
                 ("tiny", True, 0, False), id="stream-options-null"),
    pytest.param(COMPLETIONS, {"max_tokens": 16}, ("tiny", False, 16, False), id="max-tokens"),
    pytest.param(COMPLETIONS, {"max_tokens": None}, ("tiny", False, 0, False),
                 id="max-tokens-null"),
    pytest.param(COMPLETIONS, {"max_tokens": MAX_TOKENS_LIMIT},
                 ("tiny", False, MAX_TOKENS_LIMIT, False), id="max-tokens-at-limit"),
    pytest.param(COMPLETIONS, {"max_tokens": 1}, ("tiny", False, 1, False), id="max-tokens-one"),
    pytest.param(COMPLETIONS, {"prompt": [1, 2, 3]}, ("tiny", False, 0, False),
                 id="prompt-token-ids"),
    pytest.param(COMPLETIONS, {"prompt": [0]}, ("tiny", False, 0, False), id="prompt-token-zero"),
    pytest.param(COMPLETIONS, {"prompt": ["Hello"]}, ("tiny", False, 0, False),
                 id="prompt-list-of-one-string"),
    pytest.param(COMPLETIONS, {"n": 1, "temperature": 0, "top_p": 0.9},
                 ("tiny", False, 0, False), id="n-one-and-sampling"),
    pytest.param(COMPLETIONS, {"n": None, "temperature": None}, ("tiny", False, 0, False),
                 id="nulls-for-optional-numbers"),
    pytest.param(CHAT, {"max_tokens": 16}, ("tiny", False, 16, False), id="chat-max-tokens"),
    pytest.param(CHAT, {"max_completion_tokens": 8}, ("tiny", False, 8, False),
                 id="chat-max-completion-tokens"),
    pytest.param(CHAT, {"max_completion_tokens": 8, "max_tokens": 16},
                 ("tiny", False, 8, False), id="chat-max-completion-tokens-wins"),
    pytest.param(CHAT, {"max_completion_tokens": None, "max_tokens": 16},
                 ("tiny", False, 16, False), id="chat-max-completion-tokens-null"),
    pytest.param(CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]},
                 ("tiny", False, 0, False), id="chat-content-null"),
    pytest.param(CHAT, {"messages": [{"role": "user"}]}, ("tiny", False, 0, False),
                 id="chat-content-absent"),
    pytest.param(CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
                 ("tiny", False, 0, False), id="chat-content-parts"),
    pytest.param(CHAT, {"stream": True, "stream_options": {"include_usage": True}},
                 ("tiny", True, 0, True), id="chat-stream-include-usage"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "overrides", "expected"), ACCEPTED)
def test_accepted_fields_read(
    kind: str, overrides: dict[str, Any], expected: tuple[str, bool, int, bool]
) -> None:
    req = parse_request(kind, raw_of(kind, overrides))
    assert (req.model, req.stream, req.max_tokens, req.include_usage) == expected
    assert req.kind == kind


@pytest.mark.parametrize("kind", [COMPLETIONS, CHAT])
def test_unknown_fields_pass_through(kind: str) -> None:
    extra = {"ignore_eos": True, "return_token_ids": True, "vendor": {"x": [1, 2]}}
    sent = body_of(kind, extra)
    req = parse_request(kind, json.dumps(sent).encode())
    assert dict(req.body) == sent


@pytest.mark.parametrize(
    ("kind", "path", "tokenize"),
    [
        pytest.param(COMPLETIONS, "/v1/completions", {"model": "tiny", "prompt": "Hello"},
                     id="completions"),
        pytest.param(CHAT, "/v1/chat/completions",
                     {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]},
                     id="chat"),
    ],
)  # fmt: skip
def test_path_and_tokenize_body(kind: str, path: str, tokenize: dict[str, Any]) -> None:
    req = parse(kind, model=" tiny ")
    assert req.path == path
    assert req.prompt_for_tokenize() == tokenize


# -- the hand-off bodies -----------------------------------------------------------------------

CLIENT_EXTRAS: dict[str, Any] = {
    "stream": True,
    "stream_options": {"include_usage": False, "continuous_usage_stats": True},
    "max_tokens": 64,
    "temperature": 0.5,
    "ignore_eos": True,
}


@pytest.mark.parametrize(
    ("kind", "expected_extra"),
    [
        pytest.param(COMPLETIONS, {}, id="completions"),
        pytest.param(CHAT, {"max_completion_tokens": 1}, id="chat"),
    ],
)
def test_prefill_body(kind: str, expected_extra: dict[str, Any]) -> None:
    sent = body_of(kind, CLIENT_EXTRAS)
    req = parse_request(kind, json.dumps(sent).encode())
    before = copy.deepcopy(dict(req.body))
    body = prefill_body(req)
    expected = {k: v for k, v in sent.items() if k != "stream_options"}
    expected.update(
        stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True}, **expected_extra
    )
    assert body == expected
    assert dict(req.body) == before


def test_prefill_body_of_chat_overrides_max_completion_tokens() -> None:
    req = parse(CHAT, max_completion_tokens=50, max_tokens=60)
    body = prefill_body(req)
    assert (body["max_tokens"], body["max_completion_tokens"]) == (1, 1)
    assert (req.body["max_tokens"], req.body["max_completion_tokens"]) == (60, 50)


PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "engine-p1",
    "remote_block_ids": [3, 4, 5],
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
}


@pytest.mark.parametrize(
    ("overrides", "params", "expected_added"),
    [
        pytest.param({}, PARAMS, {"kv_transfer_params": PARAMS}, id="non-stream-with-params"),
        pytest.param({}, None, {}, id="non-stream-recompute"),
        pytest.param({"stream": True}, None, {"stream_options": {"include_usage": True}},
                     id="stream-usage-forced"),
        pytest.param({"stream": True, "stream_options": {"include_usage": False,
                                                         "continuous_usage_stats": True}},
                     PARAMS,
                     {"kv_transfer_params": PARAMS,
                      "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                     id="stream-usage-overridden-options-kept"),
        pytest.param({"stream": True, "stream_options": None}, None,
                     {"stream_options": {"include_usage": True}}, id="stream-options-null"),
        pytest.param({"stream": False, "stream_options": {"include_usage": False}}, None, {},
                     id="non-stream-options-untouched"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("kind", [COMPLETIONS, CHAT])
def test_decode_body(
    kind: str,
    overrides: dict[str, Any],
    params: dict[str, Any] | None,
    expected_added: dict[str, Any],
) -> None:
    sent = body_of(kind, {**overrides, "max_tokens": 32})
    req = parse_request(kind, json.dumps(sent).encode())
    before = copy.deepcopy(dict(req.body))
    given = copy.deepcopy(params)
    body = decode_body(req, given)
    assert body == {**sent, **expected_added}
    assert dict(req.body) == before
    if given is not None:
        assert body["kv_transfer_params"] is not given  # a copy: the prefill's reply is not shared
        assert given == params


# -- error and event framing -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        pytest.param(("boom", "server_error", "upstream_error"),
                     {"message": "boom", "type": "server_error", "param": None,
                      "code": "upstream_error"}, id="no-param"),
        pytest.param(("bad", "invalid_request_error", "invalid_value", "model"),
                     {"message": "bad", "type": "invalid_request_error", "param": "model",
                      "code": "invalid_value"}, id="with-param"),
    ],
)  # fmt: skip
def test_error_body_shape(args: tuple[str, ...], expected: dict[str, Any]) -> None:
    assert error_body(*args) == {"error": expected}


@pytest.mark.parametrize(
    ("exc", "status", "body", "retry_after_s"),
    [
        pytest.param(GatewayError(503, "down"), 503,
                     {"message": "down", "type": "invalid_request_error", "param": None,
                      "code": "503"}, 0, id="defaults"),
        pytest.param(GatewayError(429, "slow down", type_="rate_limit_error",
                                  code="rate_limited", retry_after_s=2), 429,
                     {"message": "slow down", "type": "rate_limit_error", "param": None,
                      "code": "rate_limited"}, 2, id="rate-limited"),
        pytest.param(BadRequest("max_tokens", "too big"), 400,
                     {"message": "max_tokens: too big", "type": "invalid_request_error",
                      "param": "max_tokens", "code": "invalid_value"}, 0, id="bad-request"),
    ],
)  # fmt: skip
def test_gateway_error(
    exc: GatewayError, status: int, body: dict[str, Any], retry_after_s: int
) -> None:
    assert (exc.status, exc.body(), exc.retry_after_s) == (status, {"error": body}, retry_after_s)


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        pytest.param("[DONE]", b"data: [DONE]\n\n", id="done"),
        pytest.param({"a": 1, "b": [1, 2], "c": {"d": None}},
                     b'data: {"a":1,"b":[1,2],"c":{"d":null}}\n\n', id="json-compact"),
        pytest.param({"text": "line\nbreak"}, b'data: {"text":"line\\nbreak"}\n\n',
                     id="newline-escaped"),
    ],
)  # fmt: skip
def test_sse_event(payload: dict[str, Any] | str, expected: bytes) -> None:
    assert sse_event(payload) == expected


@pytest.mark.parametrize(
    ("event", "wants_usage", "stripped"),
    [
        pytest.param({"choices": [], "usage": {"completion_tokens": 3}}, False, True,
                     id="usage-only-unwanted"),
        pytest.param({"choices": [], "usage": {"completion_tokens": 3}}, True, False,
                     id="usage-only-wanted"),
        pytest.param({"choices": [{"text": "a"}], "usage": None}, False, False,
                     id="token-with-usage-key"),
        pytest.param({"choices": [{"text": "a"}]}, False, False, id="token"),
    ],
)  # fmt: skip
def test_strip_usage_chunk(event: dict[str, Any], wants_usage: bool, stripped: bool) -> None:
    assert strip_usage_chunk(event, wants_usage) is stripped


def test_deeply_nested_json_is_400_naming_the_body() -> None:
    # collect earlier tests' garbage first: a finalizer the collector ran in the middle of
    # the decoder's deep recursion failed there, and pytest then could not even format
    # that (an "unraisable exception" failing this test once in a full run)
    gc.collect()
    with pytest.raises(BadRequest) as err:
        parse_request("completions", b"[" * 100_000)
    assert err.value.param == "body" and err.value.status == 400


def test_the_forwarded_body_carries_the_stripped_model_id() -> None:
    req = parse_request("completions", b'{"model": " tiny ", "prompt": "x"}')
    assert req.body["model"] == "tiny" == req.model


def test_the_prefill_drops_min_tokens() -> None:
    req = parse_request("completions", b'{"model": "m", "prompt": "x", "min_tokens": 5}')
    assert "min_tokens" not in prefill_body(req)
    assert decode_body(req, None)["min_tokens"] == 5


@pytest.mark.parametrize(
    ("code", "details", "status", "error_code"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "saturated: x", 429, "rate_limited"),
        (
            grpc.StatusCode.FAILED_PRECONDITION,
            "the model has no worker in the fleet (no_worker_for_model, no_executable_pool)",
            404,
            "model_not_found",
        ),
        (grpc.StatusCode.INVALID_ARGUMENT, "prompt_tokens: too many", 400, "invalid_value"),
        (
            grpc.StatusCode.ALREADY_EXISTS,
            "request id 'r' was scheduled",
            409,
            "request_id_conflict",
        ),
        (grpc.StatusCode.UNAVAILABLE, "state store unavailable", 503, "unavailable"),
    ],
)
def test_scheduler_statuses_become_openai_errors(
    code: grpc.StatusCode, details: str, status: int, error_code: str
) -> None:
    from hpd_gateway.control_client import _http_error

    err = _http_error(code, details, 0, "tiny")
    assert (err.status, err.body()["error"]["code"]) == (status, error_code)


@pytest.mark.parametrize(("retry_ms", "seconds"), [(0, 1), (1, 1), (1000, 1), (2500, 3)])
def test_a_saturated_answer_carries_the_schedulers_retry_delay(retry_ms: int, seconds: int) -> None:
    from hpd_gateway.control_client import _http_error

    err = _http_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "saturated", retry_ms, "m")
    assert err.status == 429 and err.retry_after_s == seconds
