"""The GPU catalogue `hpd plan` chooses from: GPU kinds with price, availability, worker
sizes and (optionally) the speed a running fleet measured, read from YAML or JSON and
validated with the offending key named.

A catalogue document (JSON is YAML, so either reads)::

    gpus:
      - name: H100-SXM              # the kind's id; a GPU of hpd_common.gpus by this name,
                                    # alias or spelling unless `gpu` or figures are given
        price_per_hour: 6.9         # USD per GPU-hour (default: the GPU table's assumption;
                                    # required for a GPU the table does not know)
        available: 8                # GPUs that may be had (default: no limit)
        tp: [1, 2]                  # worker sizes (GPUs per worker) to consider (default:
                                    # the smallest power of two the model fits on)
      - name: h100-spot             # another kind of the same GPU at another price
        gpu: H100-SXM
        price_per_hour: 2.5
        available: 4
      - name: acme-x1               # a GPU the table does not know: its datasheet figures
        peak_tflops: 400            # dense BF16 TFLOP/s
        hbm_gbps: 1600              # memory bandwidth, GB/s
        hbm_gib: 64                 # memory, GiB
        price_per_hour: 2.2
        learned:                    # optional: how its engines really run against the
          prefill_scale: 1.2        # figures (what `hpd workers -o wide` shows as learned):
          prefill_fixed_ms: 8       # prefill x scale + ms per request, decode step x scale
          decode_scale: 1.1         # + ms per sequence; written to the cluster file as the
          decode_seq_ms: 0.05       # pool's `actual` so the simulator runs them so
        max_batch_size: 256         # optional engine settings (defaults as in cluster files)
        memory_fraction: 0.9

A top-level list is read as the ``gpus`` list.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hpd_common import perfmodel
from hpd_common.gpus import GPU_PROFILES, GpuProfile, UnknownGpuError, gpu_profile

__all__ = [
    "Catalogue",
    "CatalogueError",
    "GpuKind",
    "Learned",
    "load_catalogue",
    "parse_catalogue",
]

_KIND_KEYS = (
    "name",
    "gpu",
    "price_per_hour",
    "available",
    "tp",
    "peak_tflops",
    "hbm_gbps",
    "hbm_gib",
    "learned",
    "max_batch_size",
    "memory_fraction",
)
_LEARNED_KEYS = ("prefill_scale", "prefill_fixed_ms", "decode_scale", "decode_seq_ms")
_MAX_TP = 64


class CatalogueError(ValueError):
    """A bad catalogue document; ``key`` is the dotted path of the offending key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


@dataclass(frozen=True, slots=True)
class Learned:
    """Measured speed against the declared figures: prefill ms = declared x
    ``prefill_scale`` + ``prefill_fixed_ms``; decode step ms = declared x ``decode_scale``
    + ``decode_seq_ms`` x batch (the simulator's ``actual`` of a pool)."""

    prefill_scale: float = 1.0
    prefill_fixed_ms: float = 0.0
    decode_scale: float = 1.0
    decode_seq_ms: float = 0.0

    @property
    def is_declared(self) -> bool:
        """True when it changes nothing (the engines run as declared)."""
        return self == Learned()


@dataclass(frozen=True, slots=True)
class GpuKind:
    """One kind of the catalogue: a GPU, its price per GPU-hour, how many GPUs may be had
    (None: no limit), the worker sizes to consider and the engine settings."""

    name: str
    gpu: GpuProfile
    price_per_hour: float
    available: int | None
    tps: tuple[int, ...]
    known: bool
    learned: Learned = Learned()
    max_batch_size: int = 256
    memory_fraction: float = 0.9


@dataclass(frozen=True, slots=True)
class Catalogue:
    """The kinds, in document order."""

    kinds: tuple[GpuKind, ...]

    def kind(self, name: str) -> GpuKind:
        """The kind called ``name`` (KeyError if none)."""
        for k in self.kinds:
            if k.name == name:
                return k
        raise KeyError(name)


def _num(value: Any, key: str, lo: float, integer: bool = False) -> Any:
    bad = isinstance(value, bool) or not isinstance(value, int | float)
    if bad or not math.isfinite(float(value)):
        raise CatalogueError(key, f"must be a number, got {value!r}")
    if integer and not isinstance(value, int):
        raise CatalogueError(key, f"must be an integer, got {value!r}")
    if value < lo:
        raise CatalogueError(key, f"must be >= {lo}, got {value!r}")
    return value


def _profile(raw: Mapping[str, Any], key: str) -> tuple[GpuProfile, bool]:
    """The kind's GPU: the table's by ``gpu`` (or ``name``), its figures overridden by any of
    ``peak_tflops``/``hbm_gbps``/``hbm_gib`` given; a GPU the table does not know needs
    all three."""
    figures = {f: raw[f] for f in ("peak_tflops", "hbm_gbps", "hbm_gib") if f in raw}
    ref = str(raw.get("gpu", raw["name"]))
    try:
        base: GpuProfile | None = gpu_profile(ref)
    except UnknownGpuError as exc:
        if "gpu" in raw:
            raise CatalogueError(f"{key}.gpu", str(exc)) from None
        base = None
    if base is None and len(figures) < 3:
        missing = sorted({"peak_tflops", "hbm_gbps", "hbm_gib"} - set(figures))
        raise CatalogueError(
            key,
            f"GPU {ref!r} is not in the GPU table (known: "
            f"{', '.join(sorted(GPU_PROFILES))}); give its figures: missing "
            f"{', '.join(missing)}",
        )
    vals = {f: float(_num(v, f"{key}.{f}", 1e-9)) for f, v in figures.items()}
    if base is not None and not vals:
        return base, True
    name = str(raw["name"]).strip()
    if _in_table(name):  # figures of its own: a name the table resolves would override them
        name += "-custom"
    return (
        GpuProfile(
            name,
            vals.get("peak_tflops", base.peak_tflops_bf16 if base else 0.0),
            0.0,
            vals.get("hbm_gib", base.hbm_gib if base else 0.0),
            vals.get("hbm_gbps", base.hbm_gbps if base else 0.0),
            0.0,
            base.price_per_hour_usd if base else 0.0,
        ),
        False,
    )


def _in_table(name: str) -> bool:
    try:
        gpu_profile(name)
    except UnknownGpuError:
        return False
    return True


def _learned(raw: Any, key: str) -> Learned:
    if raw is None:
        return Learned()
    if not isinstance(raw, Mapping):
        raise CatalogueError(key, "must be a mapping")
    for k in raw:
        if k not in _LEARNED_KEYS:
            raise CatalogueError(f"{key}.{k}", f"unknown key; known: {list(_LEARNED_KEYS)}")
    return Learned(
        prefill_scale=float(_num(raw.get("prefill_scale", 1.0), f"{key}.prefill_scale", 1e-6)),
        prefill_fixed_ms=float(
            _num(raw.get("prefill_fixed_ms", 0.0), f"{key}.prefill_fixed_ms", 0)
        ),
        decode_scale=float(_num(raw.get("decode_scale", 1.0), f"{key}.decode_scale", 1e-6)),
        decode_seq_ms=float(_num(raw.get("decode_seq_ms", 0.0), f"{key}.decode_seq_ms", 0)),
    )


def min_tp(model: perfmodel.ModelSpec, gpu: GpuProfile, memory_fraction: float) -> int | None:
    """The smallest power-of-two worker size whose memory holds the model's weights with
    room for KV (``perfmodel.max_kv_tokens > 0``); None if none up to 64 GPUs does."""
    tp = 1
    while tp <= _MAX_TP:
        if perfmodel.max_kv_tokens(model, gpu, tp, memory_fraction) > 0:
            return tp
        tp *= 2
    return None


def _tps(raw: Any, key: str, default: int | None) -> tuple[int, ...]:
    if raw is None:
        if default is None:
            raise CatalogueError(key, "the model fits on no worker of up to 64 such GPUs")
        return (default,)
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        raise CatalogueError(key, "must list at least one worker size")
    out = tuple(sorted({int(_num(t, key, 1, integer=True)) for t in items}))
    if out[-1] > _MAX_TP:
        raise CatalogueError(key, f"worker sizes above {_MAX_TP} GPUs are not planned")
    return out


def _kind(raw: Any, key: str, model: perfmodel.ModelSpec) -> GpuKind:
    if not isinstance(raw, Mapping):
        raise CatalogueError(key, "must be a mapping with at least `name`")
    for k in raw:
        if k not in _KIND_KEYS:
            raise CatalogueError(f"{key}.{k}", f"unknown key; known: {list(_KIND_KEYS)}")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise CatalogueError(f"{key}.name", "must be a non-empty string")
    gpu, known = _profile(raw, key)
    if "price_per_hour" not in raw and gpu.price_per_hour_usd <= 0:
        raise CatalogueError(f"{key}.price_per_hour", f"required for {name!r} (USD per GPU-hour)")
    price = float(
        _num(raw.get("price_per_hour", gpu.price_per_hour_usd), f"{key}.price_per_hour", 0)
    )
    avail_raw = raw.get("available")
    available = None if avail_raw is None else int(_num(avail_raw, f"{key}.available", 0, True))
    mem = float(_num(raw.get("memory_fraction", 0.9), f"{key}.memory_fraction", 0.01))
    if mem > 1:
        raise CatalogueError(f"{key}.memory_fraction", f"must be <= 1, got {mem}")
    tps = _tps(raw.get("tp"), f"{key}.tp", min_tp(model, gpu, mem))
    for tp in tps:
        if perfmodel.max_kv_tokens(model, gpu, tp, mem) <= 0:
            raise CatalogueError(f"{key}.tp", f"{model.name} does not fit a {tp}-GPU {name} worker")
    return GpuKind(
        name=name.strip(),
        gpu=gpu,
        price_per_hour=price,
        available=available,
        tps=tps,
        known=known,
        learned=_learned(raw.get("learned"), f"{key}.learned"),
        max_batch_size=int(_num(raw.get("max_batch_size", 256), f"{key}.max_batch_size", 1, True)),
        memory_fraction=mem,
    )


def parse_catalogue(doc: Any, model: perfmodel.ModelSpec) -> Catalogue:
    """Validate a catalogue document (module docstring) for ``model`` (worker sizes are
    checked against its weights); :class:`CatalogueError` names the key."""
    if isinstance(doc, Mapping):
        extra = [k for k in doc if k != "gpus"]
        if extra:
            raise CatalogueError(str(extra[0]), "unknown key; known: ['gpus']")
        doc = doc.get("gpus")
    if not isinstance(doc, list):
        raise CatalogueError("gpus", "must be a list of GPU kinds")
    if not doc:
        raise CatalogueError("gpus", "the catalogue is empty: list at least one GPU kind")
    kinds = [_kind(raw, f"gpus[{i}]", model) for i, raw in enumerate(doc)]
    seen: set[str] = set()
    for i, k in enumerate(kinds):
        if k.name in seen:
            raise CatalogueError(f"gpus[{i}].name", f"duplicate kind {k.name!r}")
        seen.add(k.name)
    if all(k.available == 0 for k in kinds):
        raise CatalogueError("gpus", "every kind has `available: 0`: nothing may be had")
    return Catalogue(tuple(kinds))


def load_catalogue(path: str | Path, model: perfmodel.ModelSpec) -> Catalogue:
    """Read a catalogue file (YAML or JSON)."""
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise CatalogueError("<file>", f"{p}: not YAML or JSON: {exc}") from None
    return parse_catalogue(doc, model)
