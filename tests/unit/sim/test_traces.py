"""The trace loader: both formats, reshaping, bad input, and the shipped files."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpd_sim.traces import Trace, TraceError, TraceRequest, load_trace, reshape

DATA = Path(__file__).resolve().parents[3] / "data" / "traces"

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,0,0
"""

MOONCAKE = """{"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1]}

{"timestamp": 1500, "input_length": 512, "output_length": 12, "hash_ids": [7]}
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def test_azure_csv_is_read_relative_to_the_first_row(tmp_path: Path) -> None:
    trace = load_trace(_write(tmp_path, "a.csv", AZURE))
    assert [r.prompt_tokens for r in trace.requests] == [374, 396, 1]
    assert [r.output_tokens for r in trace.requests] == [44, 109, 1]
    assert trace.requests[0].arrival_s == 0.0
    assert trace.requests[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert trace.requests[2].arrival_s == pytest.approx(4.541877, abs=1e-6)


def test_mooncake_jsonl_keeps_hashes_and_converts_ms(tmp_path: Path) -> None:
    trace = load_trace(_write(tmp_path, "m.jsonl", MOONCAKE))
    assert trace.requests == (
        TraceRequest(0.0, 40160, 6, (0, 1)),
        TraceRequest(1.5, 512, 12, (7,)),
    )


@pytest.mark.parametrize(
    ("name", "text", "line"),
    [
        pytest.param("b.csv", "TIMESTAMP,Foo\n1,2\n", 1, id="csv-missing-columns"),
        pytest.param("b.csv", AZURE + "2023-11-16 18:15:52,abc,3\n", 5, id="csv-bad-number"),
        pytest.param("b.csv", AZURE + "yesterday,3,3\n", 5, id="csv-bad-time"),
        pytest.param("b.jsonl", '{"timestamp": 0}\n', 1, id="jsonl-missing-field"),
        pytest.param("b.jsonl", MOONCAKE + "{not json\n", 4, id="jsonl-bad-json"),
        pytest.param(
            "b.jsonl",
            '{"timestamp": 0, "input_length": -3, "output_length": 1}\n',
            1,
            id="jsonl-negative",
        ),
        pytest.param("b.txt", "x", 0, id="unknown-extension"),
    ],
)
def test_bad_traces_name_the_line(tmp_path: Path, name: str, text: str, line: int) -> None:
    with pytest.raises(TraceError) as err:
        load_trace(_write(tmp_path, name, text))
    assert err.value.line == line


def _trace(times: list[float]) -> Trace:
    return Trace("t", tuple(TraceRequest(t, 10, 5) for t in times))


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        pytest.param({"rate_scale": 2.0}, [0.0, 1.0, 2.0, 5.0], id="rate-x2"),
        pytest.param({"rate_scale": 0.5}, [0.0, 4.0, 8.0, 20.0], id="rate-half"),
        pytest.param({"duration_s": 4.0}, [0.0, 2.0], id="duration"),
        pytest.param({"rate_scale": 2.0, "duration_s": 4.0}, [0.0, 1.0, 2.0], id="rate-then-cut"),
        pytest.param({"max_requests": 3}, [0.0, 2.0, 4.0], id="max-requests"),
        pytest.param({"time_scale": 10.0}, [0.0, 0.2, 0.4, 1.0], id="time-scale"),
    ],
)
def test_reshape(kwargs: dict[str, float], expected: list[float]) -> None:
    out = reshape(_trace([0.0, 2.0, 4.0, 10.0]), **kwargs)  # type: ignore[arg-type]
    assert [r.arrival_s for r in out.requests] == pytest.approx(expected)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"rate_scale": 0.0}, id="zero-rate"),
        pytest.param({"time_scale": -1.0}, id="negative-time-scale"),
        pytest.param({"duration_s": -1.0}, id="negative-duration"),
        pytest.param({"max_requests": -1}, id="negative-count"),
        pytest.param({"rate_scale_end": 2.0}, id="ramp-without-duration"),
        pytest.param({"rate_scale_end": 0.0, "duration_s": 5.0}, id="ramp-to-zero"),
    ],
)
def test_reshape_refuses_bad_arguments(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        reshape(_trace([0.0, 1.0]), **kwargs)  # type: ignore[arg-type]


@given(
    times=st.lists(st.floats(min_value=0, max_value=1e5), min_size=2, max_size=50),
    scale=st.floats(min_value=0.01, max_value=100),
)
def test_rate_scaling_multiplies_the_mean_rate(times: list[float], scale: float) -> None:
    trace = _trace(sorted(times))
    out = reshape(trace, rate_scale=scale)
    assert len(out) == len(trace)
    if trace.duration_s > 1e-6:
        assert out.mean_rate == pytest.approx(trace.mean_rate * scale, rel=1e-6)


def test_the_shipped_traces_load() -> None:
    azure = load_trace(DATA / "azure_llm_2023_conv.csv")
    assert len(azure) == 19_366
    assert 5.0 < azure.mean_rate < 5.6
    mooncake = load_trace(DATA / "mooncake_synthetic_slice.jsonl")
    assert len(mooncake) == 400
    assert all(r.hash_ids for r in mooncake.requests)


def test_a_rate_ramp_rises_linearly_over_the_replay() -> None:
    """From 1 x to 9 x over 30 s: 150 trace seconds fit (the multiplier's integral), the
    arrival rate in the last tenth is about 8.6 x the first tenth's, and arrivals keep
    their order."""
    trace = _trace([i * 0.1 for i in range(3000)])  # 10 per second for 300 s
    out = [r.arrival_s for r in reshape(trace, rate_scale=1.0, rate_scale_end=9.0,
                                        duration_s=30.0).requests]  # fmt: skip
    assert len(out) == pytest.approx(1500, abs=2)
    assert out == sorted(out) and out[-1] < 30.0
    first = sum(1 for t in out if t < 3.0)
    last = sum(1 for t in out if t >= 27.0)
    # multiplier means over the two tenths: 1.4 and 8.6
    assert last / first == pytest.approx(8.6 / 1.4, rel=0.05)


def test_a_falling_ramp_stops_where_the_rate_would_turn() -> None:
    trace = _trace([float(i) for i in range(1000)])
    out = reshape(trace, rate_scale=4.0, rate_scale_end=1.0, duration_s=10.0)
    assert len(out) == pytest.approx(25, abs=1)  # the mean multiplier 2.5 over 10 s
