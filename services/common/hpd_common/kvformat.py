"""KV cache format descriptors and the rules that decide whether two workers can exchange KV.

A prefill worker hands its KV cache to a decode worker. Whether the decode side can use those
bytes as they are, only after a conversion, or not at all follows from the two workers' KV
format descriptors. The scheduler (capability gates, hand-off cost) and the KV broker
(``Negotiate``, the P x D compatibility matrix) both answer that question, so the rules live
here, once, as pure functions over frozen values.

Sizes:

* bytes per token, whole model: ``2 (K and V) x num_layers x num_kv_heads x head_dim x dtype
  bytes``. Llama-3-8B in bf16: 2 x 32 x 8 x 128 x 2 = 131,072 B = 128 KiB; Llama-3-70B:
  2 x 80 x 8 x 128 x 2 = 327,680 B = 320 KiB; an 8-bit dtype halves both.
* bytes per token on one tensor-parallel rank: the same with that rank's share of the KV heads,
  ``ceil(num_kv_heads / tp_size)``; when ``tp_size`` exceeds the head count each rank holds one
  (replicated) head, so the ranks together hold more than the model's total.

Negotiation answers one of three verdicts:

* COMPATIBLE: the bytes can be copied as they are.
* CONVERTIBLE: they can, after the listed conversion steps; each step has a cost in
  milliseconds per GiB of KV moved, so the hand-off estimate can include it.
* INCOMPATIBLE: no conversion exists (or the policy forbids the only one); every failing rule
  is listed. The scheduler then recomputes the prefill on the decode side instead of dropping
  the pair: KV-incompatible is not the same as unable to execute.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# size: the KV format and the rules for exchanging it are one concept that the scheduler and
# the broker must share (module docstring); a tenth of the module is the rules' own contract
__all__ = [
    "DEFAULT_KV_POLICY",
    "GIB",
    "MAX_BLOCK_SIZE_TOKENS",
    "ConversionStep",
    "KvDtype",
    "KvFormat",
    "KvFormatError",
    "KvLayout",
    "KvPolicy",
    "Negotiation",
    "Reason",
    "Verdict",
    "across_models",
    "negotiate",
]

GIB = 1 << 30
"""Bytes in one GiB; conversion costs are quoted per GiB of KV."""

MAX_BLOCK_SIZE_TOKENS = 1024
"""Largest accepted KV block (page) size in tokens.

Engines page their KV in blocks of 16 to 256 tokens. A page far larger than that strands most
of its memory on short sequences, so a value above 1024 is almost certainly a unit mistake
(bytes given where tokens were meant) and is refused at the edge.
"""


# Bounds well past any model built so far (the largest have about 130 layers, 128 KV heads
# of dimension 256), so a record cannot describe a KV format no fleet model can size.
_MAX_DIMENSION = {"num_layers": 4096, "num_kv_heads": 4096, "head_dim": 8192, "tp_size": 4096}


class KvDtype(enum.StrEnum):
    """Element type of the stored K and V tensors."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    INT8 = "int8"

    @property
    def bytes(self) -> float:
        """Bytes per element (a float so that sub-byte formats can be added later)."""
        return _DTYPE_BYTES[self]


_DTYPE_BYTES: dict[KvDtype, float] = {
    KvDtype.FP32: 4.0,
    KvDtype.FP16: 2.0,
    KvDtype.BF16: 2.0,
    KvDtype.FP8_E4M3: 1.0,
    KvDtype.FP8_E5M2: 1.0,
    KvDtype.INT8: 1.0,
}


class KvLayout(enum.StrEnum):
    """How the KV tensors are laid out in memory.

    ``paged_nhd`` stores each block as [tokens, heads, head_dim] (vLLM's default);
    ``paged_hnd`` as [heads, tokens, head_dim] (FlashInfer's alternative); ``contiguous`` keeps
    one dense buffer per sequence with no pages.
    """

    PAGED_NHD = "paged_nhd"
    PAGED_HND = "paged_hnd"
    CONTIGUOUS = "contiguous"


class Verdict(enum.StrEnum):
    """Outcome of a negotiation; see the module docstring."""

    COMPATIBLE = "compatible"
    CONVERTIBLE = "convertible"
    INCOMPATIBLE = "incompatible"


class Reason(enum.StrEnum):
    """Stable reason codes carried by a :class:`Negotiation` (they are plain strings)."""

    MODEL_MISMATCH = "model_mismatch"
    MODEL_REVISION_MISMATCH = "model_revision_mismatch"
    NUM_LAYERS_MISMATCH = "num_layers_mismatch"
    KV_HEADS_MISMATCH = "kv_heads_mismatch"
    HEAD_DIM_MISMATCH = "head_dim_mismatch"
    KV_DTYPE_MISMATCH = "kv_dtype_mismatch"
    KV_DTYPE_NARROWING_NOT_ALLOWED = "kv_dtype_narrowing_not_allowed"
    KV_LAYOUT_MISMATCH = "kv_layout_mismatch"
    BLOCK_SIZE_MISMATCH = "block_size_mismatch"
    TP_SIZE_MISMATCH = "tp_size_mismatch"
    ATTENTION_BACKEND_MISMATCH = "attention_backend_mismatch"


class KvFormatError(ValueError):
    """A KV format descriptor that is not self-consistent.

    ``field`` names the offending attribute of :class:`KvFormat` so that the API edge can
    answer INVALID_ARGUMENT with the field named.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class KvFormat:
    """The KV cache format a worker produces (prefill) or consumes (decode).

    ``tp_size`` is the tensor-parallel degree over which the KV heads are split. Heads are
    split evenly (``num_kv_heads % tp_size == 0``) or, when there are more ranks than KV heads,
    replicated (``tp_size % num_kv_heads == 0``: each rank holds one head, each head lives on
    ``tp_size / num_kv_heads`` ranks), which is what engines do for grouped-query models at high
    TP. Any other split is refused by :meth:`validate`.

    ``model_revision`` is compared verbatim; an empty string is a value like any other, so an
    unset revision matches only another unset one.
    """

    dtype: KvDtype
    layout: KvLayout
    block_size_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int = 1
    attention_backend: str = "flash_attn"
    model_revision: str = ""

    def bytes_per_token(self) -> int:
        """KV bytes per token for the whole model: 2 x layers x kv_heads x head_dim x dtype B."""
        return int(2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.bytes)

    def heads_per_rank(self) -> int:
        """KV heads one TP rank holds: ``ceil(num_kv_heads / tp_size)`` (1 when replicated)."""
        if self.tp_size <= 0:
            raise KvFormatError("tp_size", f"must be positive, got {self.tp_size}")
        return -(-self.num_kv_heads // self.tp_size)

    def bytes_per_token_per_rank(self) -> int:
        """KV bytes per token held by one TP rank: 2 x layers x heads_per_rank x head_dim x B.

        Llama-3-8B bf16 at TP 2: 2 x 32 x 4 x 128 x 2 = 64 KiB. With replicated heads (TP 16
        over 8 heads) every rank holds one head, so the ranks together hold twice the model's
        total; memory per rank is what bounds a worker's KV capacity.
        """
        return int(2 * self.num_layers * self.heads_per_rank() * self.head_dim * self.dtype.bytes)

    def validate(self) -> None:
        """Raise :class:`KvFormatError` naming the first field that is not self-consistent.

        Checks, in field order: dtype and layout are members of their enums; block size is a
        power of two in [1, MAX_BLOCK_SIZE_TOKENS]; layers, KV heads, head dim and TP size are
        positive integers; the KV heads split evenly over TP or are evenly replicated (see the
        class docstring); the attention backend is not blank.
        """
        if not isinstance(self.dtype, KvDtype):
            raise KvFormatError("dtype", f"unknown KV dtype {self.dtype!r}")
        if not isinstance(self.layout, KvLayout):
            raise KvFormatError("layout", f"unknown KV layout {self.layout!r}")
        for name in ("block_size_tokens", "num_layers", "num_kv_heads", "head_dim", "tp_size"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise KvFormatError(name, f"must be a positive integer, got {value!r}")
            top = _MAX_DIMENSION.get(name)
            if top is not None and value > top:
                raise KvFormatError(name, f"must be at most {top:,}, got {value:,}")
        block = self.block_size_tokens
        if block & (block - 1):
            raise KvFormatError("block_size_tokens", f"must be a power of two, got {block}")
        if block > MAX_BLOCK_SIZE_TOKENS:
            raise KvFormatError(
                "block_size_tokens", f"must be at most {MAX_BLOCK_SIZE_TOKENS}, got {block}"
            )
        heads, tp = self.num_kv_heads, self.tp_size
        if heads % tp != 0 and not (tp > heads and tp % heads == 0):
            raise KvFormatError(
                "tp_size",
                f"{heads} KV heads can neither be split evenly over nor replicated evenly "
                f"across {tp} ranks",
            )
        if not isinstance(self.attention_backend, str) or not self.attention_backend.strip():
            raise KvFormatError("attention_backend", "must not be empty")
        if not isinstance(self.model_revision, str):
            raise KvFormatError("model_revision", "must be a string")


@dataclass(frozen=True, slots=True)
class ConversionStep:
    """One conversion the KV must go through between source and destination.

    ``kind`` is one of ``dtype_cast``, ``layout_permute`` (NHD <-> HND), ``layout_repack``
    (contiguous <-> paged), ``block_regroup`` and ``tp_reshard``; ``cost_ms_per_gib`` is the
    estimated time per GiB of source KV; ``lossy`` marks a cast that loses precision.
    """

    kind: str
    detail: str
    cost_ms_per_gib: float
    lossy: bool = False


@dataclass(frozen=True, slots=True)
class KvPolicy:
    """Which conversions are allowed, and what each costs.

    ``compatible_backends`` declares groups of attention backends that read each other's KV
    memory as is (for example ``{"flash_attn", "flashinfer"}`` when both are configured for the
    same layout); two different backends are accepted only when one group holds both, and then
    no conversion step is needed.

    Cost defaults are order-of-magnitude figures, not measurements: a GPU kernel that reads one
    GiB and writes one GiB at about 1 TB/s effective takes about 2.1 ms, so an element-wise
    cast or a page copy costs about 2 ms/GiB; a permutation touches memory with a stride and is
    taken as 3 ms/GiB; regrouping blocks copies pages but changes no element (1 ms/GiB);
    resharding over TP adds a scatter/gather between ranks on top of the copy (4 ms/GiB).
    Deployments should replace them with figures measured on their own hardware.
    """

    allow_lossy_narrowing: bool = False
    compatible_backends: frozenset[frozenset[str]] = frozenset()
    dtype_cast_ms_per_gib: float = 2.0
    layout_permute_ms_per_gib: float = 3.0
    layout_repack_ms_per_gib: float = 2.0
    block_regroup_ms_per_gib: float = 1.0
    tp_reshard_ms_per_gib: float = 4.0

    def __post_init__(self) -> None:
        for name in (
            "dtype_cast_ms_per_gib",
            "layout_permute_ms_per_gib",
            "layout_repack_ms_per_gib",
            "block_regroup_ms_per_gib",
            "tp_reshard_ms_per_gib",
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def backends_compatible(self, a: str, b: str) -> bool:
        """True when ``a == b`` or one declared group holds both backends."""
        return a == b or any(a in group and b in group for group in self.compatible_backends)


@dataclass(frozen=True, slots=True)
class Negotiation:
    """The answer to "can KV in format src be used by a worker expecting format dst?".

    ``reasons`` are stable codes (see :class:`Reason`). For CONVERTIBLE there is exactly one
    step per reason, in the same order; for INCOMPATIBLE the reasons are the rules that cannot
    be satisfied and there are no steps. ``details`` holds one human-readable sentence per
    reason (same order), for logs, tables and error messages.
    """

    verdict: Verdict
    reasons: tuple[str, ...] = ()
    steps: tuple[ConversionStep, ...] = ()
    details: tuple[str, ...] = ()

    @property
    def transferable(self) -> bool:
        """True when KV can be handed over (COMPATIBLE or CONVERTIBLE)."""
        return self.verdict is not Verdict.INCOMPATIBLE

    @property
    def cost_ms_per_gib(self) -> float:
        """Sum of the steps' costs in ms per GiB of source KV."""
        return math.fsum(step.cost_ms_per_gib for step in self.steps)

    def conversion_ms(self, kv_bytes: int) -> float:
        """Conversion time for ``kv_bytes`` of source KV: sum(step ms/GiB) x kv_bytes / 2^30.

        0.0 for COMPATIBLE; ``math.inf`` for INCOMPATIBLE (no conversion exists, so a transfer
        can never finish; a cost comparison against recompute then picks recompute).
        """
        if kv_bytes < 0:
            raise ValueError(f"kv_bytes must be >= 0, got {kv_bytes}")
        if self.verdict is Verdict.INCOMPATIBLE:
            return math.inf
        return self.cost_ms_per_gib * kv_bytes / GIB


def _dtype_rule(
    src: KvDtype, dst: KvDtype, policy: KvPolicy
) -> tuple[Reason, str, ConversionStep | None]:
    """Cast rule: widening is exact; same width or narrower loses precision (policy-gated).

    Every fp8 and int8 value is representable in fp16, bf16 and fp32, and every fp16 or bf16
    value in fp32, so a cast to more bytes per element is exact. bf16 <-> fp16 (and fp8 e4m3
    <-> e5m2, int8 <-> fp8) keep the width but trade range for mantissa, so they count as lossy
    like a narrowing cast.
    """
    widening = dst.bytes > src.bytes
    lossy = not widening
    if lossy and not policy.allow_lossy_narrowing:
        return (
            Reason.KV_DTYPE_NARROWING_NOT_ALLOWED,
            f"casting {src} to {dst} loses precision and the policy allows no lossy cast",
            None,
        )
    how = "widening, exact" if widening else "lossy, allowed by policy"
    step = ConversionStep(
        "dtype_cast", f"cast {src} -> {dst} ({how})", policy.dtype_cast_ms_per_gib, lossy=lossy
    )
    return Reason.KV_DTYPE_MISMATCH, step.detail, step


def _tp_split_ok(heads: int, tp: int) -> bool:
    if heads <= 0 or tp <= 0:
        return False
    return heads % tp == 0 or (tp > heads and tp % heads == 0)


DEFAULT_KV_POLICY = KvPolicy()
"""No lossy casts, no declared backend aliases, default step costs."""

_COMPATIBLE = Negotiation(Verdict.COMPATIBLE)


_Blocking = list[tuple[Reason, str]]
_Converting = list[tuple[Reason, ConversionStep]]


def _layout_step(src: KvFormat, dst: KvFormat, contiguous: bool, pol: KvPolicy) -> ConversionStep:
    """Rule 3 of `negotiate`: a repack to or from contiguous, else a permute."""
    if contiguous:
        return ConversionStep(
            "layout_repack", f"repack {src.layout} -> {dst.layout}", pol.layout_repack_ms_per_gib
        )
    return ConversionStep(
        "layout_permute", f"permute {src.layout} -> {dst.layout}", pol.layout_permute_ms_per_gib
    )


def _block_rule(
    a_blk: int, b_blk: int, pol: KvPolicy, blocking: _Blocking, converting: _Converting
) -> None:
    """Rule 4 of `negotiate`: regroup blocks when one size divides the other."""
    if min(a_blk, b_blk) > 0 and max(a_blk, b_blk) % min(a_blk, b_blk) == 0:
        verb = "merge" if b_blk > a_blk else "split"
        step = ConversionStep(
            "block_regroup",
            f"{verb} blocks of {a_blk} tokens into blocks of {b_blk}",
            pol.block_regroup_ms_per_gib,
        )
        converting.append((Reason.BLOCK_SIZE_MISMATCH, step))
    else:
        detail = f"block sizes {a_blk} and {b_blk} tokens: neither divides the other"
        blocking.append((Reason.BLOCK_SIZE_MISMATCH, detail))


def _tp_rule(
    src: KvFormat, dst: KvFormat, pol: KvPolicy, blocking: _Blocking, converting: _Converting
) -> None:
    """Rule 5 of `negotiate`: reshard when the KV heads split evenly on both sides."""
    if _tp_split_ok(src.num_kv_heads, src.tp_size) and _tp_split_ok(dst.num_kv_heads, dst.tp_size):
        step = ConversionStep(
            "tp_reshard",
            f"reshard {src.num_kv_heads} KV heads from TP {src.tp_size} to TP {dst.tp_size} "
            f"({src.heads_per_rank()} -> {dst.heads_per_rank()} heads per rank)",
            pol.tp_reshard_ms_per_gib,
        )
        converting.append((Reason.TP_SIZE_MISMATCH, step))
    else:
        detail = (
            f"KV heads {src.num_kv_heads}/{dst.num_kv_heads} do not split evenly over "
            f"TP {src.tp_size}/{dst.tp_size}"
        )
        blocking.append((Reason.TP_SIZE_MISMATCH, detail))


def negotiate(src: KvFormat, dst: KvFormat, policy: KvPolicy = DEFAULT_KV_POLICY) -> Negotiation:
    """Decide whether KV produced in format ``src`` can be consumed by a worker in ``dst``.

    Rules, each with its reason code (every failing rule is reported, not just the first):

    1. model revision, layer count, KV head count and head dim must be equal (the KV of a
       different model is meaningless); otherwise ``model_revision_mismatch``,
       ``num_layers_mismatch``, ``kv_heads_mismatch``, ``head_dim_mismatch``.
    2. dtype equal, or a ``dtype_cast`` (``kv_dtype_mismatch``); a lossy cast (narrowing, or a
       different dtype of the same width such as bf16 <-> fp16) only when
       ``policy.allow_lossy_narrowing``, else ``kv_dtype_narrowing_not_allowed``.
    3. layout equal, or ``layout_permute`` (NHD <-> HND) or ``layout_repack`` (contiguous <->
       paged), both ``kv_layout_mismatch``.
    4. block size equal, or ``block_regroup`` when one divides the other
       (``block_size_mismatch``); not compared when either side is contiguous, because the
       repack writes into the destination's own pages. For formats that pass
       :meth:`KvFormat.validate` (powers of two) one size always divides the other; the
       INCOMPATIBLE outcome is reachable only for unvalidated descriptors.
    5. TP size equal, or ``tp_reshard`` (``tp_size_mismatch``) when the KV heads split or
       replicate evenly on both sides (again always true for validated formats).
    6. attention backend equal, or declared compatible in ``policy.compatible_backends``
       (then no step at all); otherwise ``attention_backend_mismatch``.

    The function is total: it never raises, whatever the field values. Descriptors should be
    validated at the edge (:meth:`KvFormat.validate`); negotiation does not repeat it because
    the scheduler calls it for many pairs per decision.
    """
    pol = policy
    blocking: list[tuple[Reason, str]] = []
    converting: list[tuple[Reason, ConversionStep]] = []

    for reason, attr in (
        (Reason.MODEL_REVISION_MISMATCH, "model_revision"),
        (Reason.NUM_LAYERS_MISMATCH, "num_layers"),
        (Reason.KV_HEADS_MISMATCH, "num_kv_heads"),
        (Reason.HEAD_DIM_MISMATCH, "head_dim"),
    ):
        a, b = getattr(src, attr), getattr(dst, attr)
        if a != b:
            blocking.append((reason, f"{attr} differs: {a!r} vs {b!r}"))

    if src.dtype != dst.dtype:
        reason, detail, cast = _dtype_rule(src.dtype, dst.dtype, pol)
        if cast is None:
            blocking.append((reason, detail))
        else:
            converting.append((reason, cast))

    contiguous = KvLayout.CONTIGUOUS in (src.layout, dst.layout)
    if src.layout != dst.layout:
        converting.append((Reason.KV_LAYOUT_MISMATCH, _layout_step(src, dst, contiguous, pol)))
    if not contiguous and src.block_size_tokens != dst.block_size_tokens:
        _block_rule(src.block_size_tokens, dst.block_size_tokens, pol, blocking, converting)
    if src.tp_size != dst.tp_size:
        _tp_rule(src, dst, pol, blocking, converting)

    if not pol.backends_compatible(src.attention_backend, dst.attention_backend):
        blocking.append(
            (
                Reason.ATTENTION_BACKEND_MISMATCH,
                f"attention backends {src.attention_backend!r} and {dst.attention_backend!r} "
                "are not declared compatible",
            )
        )

    if blocking:
        return Negotiation(
            Verdict.INCOMPATIBLE,
            reasons=tuple(str(r) for r, _ in blocking),
            details=tuple(d for _, d in blocking),
        )
    if converting:
        return Negotiation(
            Verdict.CONVERTIBLE,
            reasons=tuple(str(r) for r, _ in converting),
            steps=tuple(s for _, s in converting),
            details=tuple(s.detail for _, s in converting),
        )
    return _COMPATIBLE


def across_models(n: Negotiation, src_model: str, dst_model: str) -> Negotiation:
    """``n`` (the formats' verdict) for two workers that serve different models.

    A descriptor does not name its model: two models with the same layer count, KV heads, head
    dim and revision name (``main`` on both, say) have formats that negotiate as compatible.
    The KV of one is still meaningless to the other, so the answer is INCOMPATIBLE, led by
    ``model_mismatch``, followed by whatever the formats themselves could not reconcile.
    """
    blocking = n.verdict is Verdict.INCOMPATIBLE
    detail = f"model_id differs: {src_model!r} vs {dst_model!r}"
    return Negotiation(
        Verdict.INCOMPATIBLE,
        reasons=(Reason.MODEL_MISMATCH.value, *(n.reasons if blocking else ())),
        details=(detail, *(n.details if blocking else ())),
    )
