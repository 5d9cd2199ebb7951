"""KV session keys per planning attempt."""

from __future__ import annotations

import pytest

from hpd_common.errors import InvalidArgument
from hpd_kvbroker.domain import check_ids
from hpd_scheduler.service import session_request_id


@pytest.mark.parametrize(
    ("request_id", "attempt", "expected"),
    [
        pytest.param("req-1", 0, "req-1", id="first-attempt-is-the-request-id"),
        pytest.param("req-1", 1, "req-1:a1", id="retry-gets-its-own-key"),
        pytest.param("req-1", 2, "req-1:a2", id="each-retry-differs"),
        pytest.param("x" * 128, 3, "x" * 125 + ":a3", id="stays-within-128"),
    ],
)
def test_session_key(request_id: str, attempt: int, expected: str) -> None:
    assert session_request_id(request_id, attempt) == expected


def test_every_attempt_key_is_a_valid_broker_id() -> None:
    for attempt in range(5):
        key = session_request_id("r" * 128, attempt)
        check_ids(request_id=key)  # raises if the broker would refuse it
    with pytest.raises(InvalidArgument):
        check_ids(request_id="r" * 129)
