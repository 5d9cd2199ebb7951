"""KvBrokerService through its gRPC API: negotiation rules and the compatibility matrix."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import kvbroker_pb2 as k
from hetero_pd.v1 import registry_pb2 as r
from hpd_common.errors import InvalidArgument
from hpd_kvbroker.settings import KvBrokerSettings, policy_from
from tests.support.fleet import kv_format
from tests.support.kvbroker import (
    GIB,
    SCHED,
    Env,
    V,
    code_of,
    eventually,
    open_request,
    register,
)
from tests.support.kvbroker import (
    env as env,
)
from tests.support.servers import external

# These start their own broker over the suite's Redis; against a compose stack (whose
# registry keeps its credentials in the stack's Redis) the stack's own suite covers it.
pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="starts its own broker"),
]


# -- negotiation -------------------------------------------------------------------------------

FP8, BF16, FP16 = c.KV_DTYPE_FP8_E4M3, c.KV_DTYPE_BF16, c.KV_DTYPE_FP16
NHD, HND, CONT = c.KV_LAYOUT_PAGED_NHD, c.KV_LAYOUT_PAGED_HND, c.KV_LAYOUT_CONTIGUOUS


def fmt(**kw: Any) -> c.KvFormat:
    layers = kw.pop("num_layers", None)
    heads = kw.pop("num_kv_heads", None)
    dim = kw.pop("head_dim", None)
    f = kv_format(**kw)
    if layers is not None:
        f.num_layers = layers
    if heads is not None:
        f.num_kv_heads = heads
    if dim is not None:
        f.head_dim = dim
    return f


RULES = [
    pytest.param({}, V.COMPATIBILITY_VERDICT_COMPATIBLE, [], id="identical"),
    pytest.param({"revision": "rev-b"}, V.COMPATIBILITY_VERDICT_INCOMPATIBLE,
                 ["model_revision_mismatch"], id="model-revision"),
    pytest.param({"num_layers": 40}, V.COMPATIBILITY_VERDICT_INCOMPATIBLE,
                 ["num_layers_mismatch"], id="layers"),
    pytest.param({"num_kv_heads": 4}, V.COMPATIBILITY_VERDICT_INCOMPATIBLE,
                 ["kv_heads_mismatch"], id="kv-heads"),
    pytest.param({"head_dim": 64}, V.COMPATIBILITY_VERDICT_INCOMPATIBLE,
                 ["head_dim_mismatch"], id="head-dim"),
    pytest.param({"dtype": FP8}, V.COMPATIBILITY_VERDICT_INCOMPATIBLE,
                 ["kv_dtype_narrowing_not_allowed"], id="dtype-narrowing-refused"),
    pytest.param({"dtype": FP16}, V.COMPATIBILITY_VERDICT_INCOMPATIBLE,
                 ["kv_dtype_narrowing_not_allowed"], id="dtype-same-width-lossy"),
    pytest.param({"layout": HND}, V.COMPATIBILITY_VERDICT_CONVERTIBLE,
                 ["kv_layout_mismatch"], id="layout-permute"),
    pytest.param({"layout": CONT}, V.COMPATIBILITY_VERDICT_CONVERTIBLE,
                 ["kv_layout_mismatch"], id="layout-repack"),
    pytest.param({"block": 32}, V.COMPATIBILITY_VERDICT_CONVERTIBLE,
                 ["block_size_mismatch"], id="block-regroup"),
    pytest.param({"tp": 2}, V.COMPATIBILITY_VERDICT_CONVERTIBLE,
                 ["tp_size_mismatch"], id="tp-reshard"),
    pytest.param({"backend": "flashinfer"}, V.COMPATIBILITY_VERDICT_INCOMPATIBLE,
                 ["attention_backend_mismatch"], id="attention-backend"),
    pytest.param({"layout": HND, "block": 64, "tp": 4}, V.COMPATIBILITY_VERDICT_CONVERTIBLE,
                 ["kv_layout_mismatch", "block_size_mismatch", "tp_size_mismatch"],
                 id="three-conversions"),
    pytest.param({"revision": "x", "backend": "sdpa", "block": 32},
                 V.COMPATIBILITY_VERDICT_INCOMPATIBLE,
                 ["model_revision_mismatch", "attention_backend_mismatch"], id="every-reason"),
]  # fmt: skip


@pytest.mark.parametrize(("dst", "verdict", "reasons"), RULES)
async def test_negotiate_rules(
    env: Env, dst: dict[str, Any], verdict: int, reasons: list[str]
) -> None:
    resp = await env.stub.Negotiate(
        k.NegotiateRequest(source_format=fmt(), destination_format=fmt(**dst), kv_bytes=GIB),
        timeout=5,
    )
    n = resp.negotiation
    assert (n.verdict, list(n.reasons)) == (verdict, reasons)
    assert len(n.details) == len(reasons)
    if verdict == V.COMPATIBILITY_VERDICT_CONVERTIBLE:
        assert len(n.steps) == len(reasons)
        assert resp.conversion_ms == pytest.approx(sum(s.cost_ms_per_gib for s in n.steps))
    else:
        assert list(n.steps) == []


def test_fp8_widening_is_allowed_by_the_rules_the_broker_uses() -> None:
    """The widening direction of the dtype rule (fp8 -> bf16) is a conversion."""
    from hpd_common.kvformat import KvDtype, KvFormat, KvLayout, negotiate

    src = KvFormat(KvDtype.FP8_E4M3, KvLayout.PAGED_NHD, 16, 32, 8, 128)
    dst = KvFormat(KvDtype.BF16, KvLayout.PAGED_NHD, 16, 32, 8, 128)
    policy = policy_from(KvBrokerSettings())
    assert negotiate(src, dst, policy).reasons == ("kv_dtype_mismatch",)


@pytest.mark.parametrize(
    ("text", "groups"),
    [
        pytest.param("", frozenset(), id="none"),
        pytest.param(
            "flash_attn+flashinfer, xformers+sdpa",
            frozenset({frozenset({"flash_attn", "flashinfer"}), frozenset({"xformers", "sdpa"})}),
            id="two-groups",
        ),
    ],
)
def test_policy_from_settings(text: str, groups: frozenset[frozenset[str]]) -> None:
    assert policy_from(KvBrokerSettings(compatible_backends=text)).compatible_backends == groups


def test_policy_refuses_a_group_of_one() -> None:
    with pytest.raises(InvalidArgument, match="compatible_backends"):
        policy_from(KvBrokerSettings(compatible_backends="flash_attn"))


async def test_negotiate_between_registered_workers(env: Env) -> None:
    resp = await env.stub.Negotiate(
        k.NegotiateRequest(source_worker_id="p1", destination_worker_id="d1", kv_bytes=4 * GIB),
        timeout=5,
    )
    assert resp.negotiation.verdict == V.COMPATIBILITY_VERDICT_CONVERTIBLE
    assert resp.destination_format.block_size_tokens == 32
    assert resp.conversion_ms == pytest.approx(4.0)  # block regroup: 1 ms/GiB x 4 GiB
    mixed = await env.stub.Negotiate(
        k.NegotiateRequest(source_worker_id="p1", destination_format=fmt()), timeout=5
    )
    assert mixed.negotiation.verdict == V.COMPATIBILITY_VERDICT_COMPATIBLE
    missing = env.stub.Negotiate(
        k.NegotiateRequest(source_worker_id="p1", destination_worker_id="nobody"), timeout=5
    )
    assert await code_of(missing) == grpc.StatusCode.NOT_FOUND


async def test_workers_of_different_models_are_incompatible_whatever_their_formats(
    env: Env,
) -> None:
    """A descriptor does not name its model: another model with the same shapes and the same
    revision name has an identical format. Its KV is still meaningless here."""
    await register(
        env.registry.stub, "m1", lease_ttl_ms=30_000, model="mistral-7b", stages=(c.STAGE_DECODE,)
    )
    resp = await env.stub.Negotiate(
        k.NegotiateRequest(source_worker_id="p1", destination_worker_id="m1"), timeout=5
    )
    assert resp.source_format == resp.destination_format
    assert resp.negotiation.verdict == V.COMPATIBILITY_VERDICT_INCOMPATIBLE
    assert list(resp.negotiation.reasons) == ["model_mismatch"]
    assert "mistral-7b" in resp.negotiation.details[0]
    opened = env.stub.OpenSession(open_request("cross-model", dst="m1", who=SCHED), timeout=5)
    assert await code_of(opened) == grpc.StatusCode.FAILED_PRECONDITION
    by_format = await env.stub.Negotiate(
        k.NegotiateRequest(source_worker_id="p1", destination_format=resp.destination_format),
        timeout=5,
    )
    assert by_format.negotiation.verdict == V.COMPATIBILITY_VERDICT_COMPATIBLE


async def _matrix(env: Env) -> list[tuple[str, str, int]]:
    resp = await env.stub.GetCompatibilityMatrix(
        k.GetCompatibilityMatrixRequest(model_id="llama-3-8b"), timeout=5
    )
    return [(p.prefill_worker_id, p.decode_worker_id, p.negotiation.verdict) for p in resp.pairs]


async def test_matrix_follows_the_registry(env: Env) -> None:
    assert await _matrix(env) == [
        ("p1", "d1", V.COMPATIBILITY_VERDICT_CONVERTIBLE),
        ("p1", "d2", V.COMPATIBILITY_VERDICT_INCOMPATIBLE),
        ("x1", "d1", V.COMPATIBILITY_VERDICT_CONVERTIBLE),
        ("x1", "d2", V.COMPATIBILITY_VERDICT_INCOMPATIBLE),
    ]
    await register(env.registry.stub, "d3", stages=(c.STAGE_DECODE,), lease_ttl_ms=30_000)

    async def has_d3() -> bool:
        return ("p1", "d3", V.COMPATIBILITY_VERDICT_COMPATIBLE) in await _matrix(env)

    await eventually(has_d3)
    await env.registry.stub.DeregisterWorker(
        r.DeregisterWorkerRequest(worker_id="x1", credential=env.creds["x1"]), timeout=5
    )

    async def no_x1() -> bool:
        return all(p != "x1" for p, _, _ in await _matrix(env))

    await eventually(no_x1)
