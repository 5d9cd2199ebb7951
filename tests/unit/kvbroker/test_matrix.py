"""The compatibility matrix follows fleet changes and recomputes only what changed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpd_common.kvformat import DEFAULT_KV_POLICY, KvDtype, KvFormat, KvLayout, Verdict
from hpd_common.worker_model import Stage, WorkerSpec
from hpd_kvbroker.matrix import CompatibilityMatrix
from hpd_registry.domain import WorkerRecord, WorkerState

KV = KvFormat(KvDtype.BF16, KvLayout.PAGED_NHD, 16, 32, 8, 128, 1, "flash_attn", "rev-a")


def worker(
    worker_id: str,
    stages: tuple[Stage, ...] = (Stage.PREFILL,),
    model: str = "m",
    kv: KvFormat = KV,
    draining: bool = False,
) -> WorkerRecord:
    spec = WorkerSpec(
        worker_id=worker_id,
        pool_id="pool",
        endpoint=f"{worker_id}:1",
        stages=stages,
        model_id=model,
        model_revision="rev-a",
        engine="vllm",
        engine_version="1",
        gpu_type="H100-SXM",
        gpu_count=1,
        tp_size=kv.tp_size,
        pp_size=1,
        peak_tflops=0,
        hbm_gbps=0,
        kv_memory_total_bytes=1 << 30,
        max_batch_size=8,
        kv_format=kv,
    )
    return WorkerRecord(
        spec=spec, state=WorkerState(0, 0, 0, 0, draining=draining), load=None, revision=1
    )


D = (Stage.DECODE,)
BOTH = (Stage.PREFILL, Stage.DECODE)


def test_pairs_every_prefill_with_every_decode_of_the_model() -> None:
    m = CompatibilityMatrix(DEFAULT_KV_POLICY)
    m.reset(
        [
            worker("p1"),
            worker("p2", kv=replace(KV, block_size_tokens=32)),
            worker("d1", D),
            worker("d2", D, kv=replace(KV, dtype=KvDtype.FP8_E4M3)),
            worker("x1", D, model="other"),
        ],
        revision=7,
    )
    v = m.view("m")
    assert (v.prefill_ids, v.decode_ids, m.revision) == (("p1", "p2"), ("d1", "d2"), 7)
    verdicts = {(p, d): n.verdict for p, d, n in v.pairs}
    assert verdicts == {
        ("p1", "d1"): Verdict.COMPATIBLE,
        ("p1", "d2"): Verdict.INCOMPATIBLE,  # bf16 -> fp8 narrows; not allowed by default
        ("p2", "d1"): Verdict.CONVERTIBLE,  # block regroup 32 -> 16
        ("p2", "d2"): Verdict.INCOMPATIBLE,
    }
    assert [p[:2] for p in m.view("other").pairs] == []


def test_a_worker_serving_both_stages_is_not_paired_with_itself() -> None:
    m = CompatibilityMatrix(DEFAULT_KV_POLICY)
    m.reset([worker("b1", BOTH), worker("b2", BOTH)])
    assert [(p, d) for p, d, _ in m.view("m").pairs] == [("b1", "b2"), ("b2", "b1")]


def test_put_recomputes_only_when_the_shape_changes() -> None:
    m = CompatibilityMatrix(DEFAULT_KV_POLICY)
    assert m.put(worker("p1"))
    assert m.put(worker("d1", D))
    assert not m.put(worker("p1", draining=True))  # health is not part of the matrix
    assert m.put(worker("p1", kv=replace(KV, layout=KvLayout.PAGED_HND)))
    [(_, _, n)] = m.view("m").pairs
    assert n.verdict is Verdict.CONVERTIBLE
    assert n.reasons == ("kv_layout_mismatch",)


@pytest.mark.parametrize(
    ("change", "pairs"),
    [
        pytest.param("delete-d1", [("p1", "d2")], id="delete-decode"),
        pytest.param("delete-p1", [], id="delete-prefill"),
        pytest.param("move-d1", [("p1", "d2")], id="model-change"),
        pytest.param("stage-d1", [("d1", "d2"), ("p1", "d2")], id="stage-change"),
    ],
)
def test_changes_update_the_pairs(change: str, pairs: list[tuple[str, str]]) -> None:
    m = CompatibilityMatrix(DEFAULT_KV_POLICY)
    m.reset([worker("p1"), worker("d1", D), worker("d2", D)])
    if change == "delete-d1":
        m.delete("d1", 9)
    elif change == "delete-p1":
        m.delete("p1", 9)
    elif change == "move-d1":
        m.put(worker("d1", D, model="other"), 9)
    else:
        m.put(worker("d1", (Stage.PREFILL,)), 9)
    assert [(p, d) for p, d, _ in m.view("m").pairs] == pairs
    assert m.revision == 9
    assert m.pair_count == len(pairs)


def test_negotiations_are_memoised_by_format_pair() -> None:
    m = CompatibilityMatrix(DEFAULT_KV_POLICY)
    a = m.negotiate(KV, replace(KV, block_size_tokens=32))
    assert m.negotiate(KV, replace(KV, block_size_tokens=32)) is a


def test_the_verdict_memo_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negotiate accepts any descriptors; remembering every pair would grow without end."""
    from hpd_kvbroker import matrix

    monkeypatch.setattr(matrix, "MEMO_MAX", 3)
    m = CompatibilityMatrix(DEFAULT_KV_POLICY)
    for i in range(10):
        n = m.negotiate(KV, replace(KV, model_revision=f"rev-{i}"))
        assert n.verdict is Verdict.INCOMPATIBLE
        assert len(m._memo) <= 3
    assert m.negotiate(KV, KV).verdict is Verdict.COMPATIBLE
