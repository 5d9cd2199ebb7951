"""How a load report is stored: binary, exact, and older JSON records still read."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from hpd_common.worker_model import LoadReport
from hpd_registry.store import canonical_json, decode_load, encode_load

ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
floats = st.floats(allow_nan=False)


def reports() -> st.SearchStrategy[LoadReport]:
    fields = {
        f.name: (floats if f.type == "float" else ints) for f in dataclasses.fields(LoadReport)
    }
    return st.builds(LoadReport, **fields)


@given(reports())
def test_every_report_comes_back_exactly(load: LoadReport) -> None:
    raw = encode_load(load)
    assert raw.startswith(b"\x00")
    back = decode_load(raw)
    assert back == load
    assert [type(v) for v in dataclasses.astuple(back)] == [
        type(v) for v in dataclasses.astuple(load)
    ]


def test_json_written_by_earlier_versions_still_reads() -> None:
    load = LoadReport(gpu_util=0.3, kv_blocks_free=10, kv_blocks_total=20, reported_at_ms=7)
    stored = canonical_json(load.to_dict())
    assert decode_load(stored) == load
    assert decode_load(stored.encode()) == load


def test_a_number_that_does_not_pack_is_stored_as_json() -> None:
    load = LoadReport(kv_blocks_free=2**70)
    raw = encode_load(load)
    assert json.loads(raw)["kv_blocks_free"] == 2**70
    assert decode_load(raw) == load


def test_every_field_is_a_float_or_an_int() -> None:
    """The binary form packs floats and ints only: a field of another type needs a new tag."""
    assert {f.type for f in dataclasses.fields(LoadReport)} == {"float", "int"}


def test_binary_written_before_the_prefix_cache_field_still_reads() -> None:
    import struct

    old = LoadReport(gpu_util=0.5, queue_depth=3, batch_size=7, reported_at_ms=11)
    values = [getattr(old, f.name) for f in dataclasses.fields(LoadReport)][:13]
    raw = b"\x00\x01" + struct.pack("<" + "d" * 4 + "q" * 4 + "d" * 4 + "q", *values)
    assert decode_load(raw) == old


def test_binary_written_before_the_prefill_busy_field_still_reads() -> None:
    import struct

    old = LoadReport(
        gpu_util=0.5, queue_depth=3, batch_size=7, reported_at_ms=11, prefix_cache_hit_rate=0.25
    )
    values = [getattr(old, f.name) for f in dataclasses.fields(LoadReport)][:14]
    raw = b"\x00\x02" + struct.pack("<" + "d" * 4 + "q" * 4 + "d" * 4 + "q" + "d", *values)
    back = decode_load(raw)
    assert back == old
    assert back.prefix_cache_hit_rate == 0.25 and back.prefill_busy == 0.0


def test_the_current_binary_form_carries_prefill_busy() -> None:
    load = LoadReport(prefill_busy=0.375, reported_at_ms=5)
    raw = encode_load(load)
    assert raw[:2] == b"\x00\x03"
    assert decode_load(raw).prefill_busy == 0.375


def test_every_field_crosses_the_wire() -> None:
    """load_to_pb / load_from_pb carry every field: one left out would reach the planner as
    0 ("not reported") from every agent."""
    from hpd_registry import convert

    values: dict[str, Any] = {}
    for i, f in enumerate(dataclasses.fields(LoadReport), start=1):
        values[f.name] = i / 64 if f.type == "float" else i
    load = LoadReport(**values)
    assert convert.load_from_pb(convert.load_to_pb(load)) == load
