"""The capability record an agent registers: its flags plus what the engine said. Pure.

What the engine states wins over nothing, and a flag wins over the engine only where the
engine cannot know (its GPU kind, pool, zone, role in a P/D pair, its KV connector's side
channel). Every field the registry needs has either a stated default or a clear error:

* ``worker_id``: the flag, else ``<engine>-<host>-<port>`` of the engine's URL;
* ``pool_id``: the flag, else ``<model>-<role>-<gpu type>`` (lower-cased, sanitised);
* ``endpoint``: the flag, else the engine URL's ``host:port`` (what a gateway calls);
* ``model_id``: the flag, else the first model the engine lists;
* ``model_revision``: the flag, else ``cfg-`` + the first 12 hex digits of the SHA-256 of the
  model folder's ``config.json`` (two engines serving different configs never share KV);
  with neither, an error;
* the KV format: block size, dtype, layout from the engine (see ``engines``), layers, KV
  heads and head dim from ``config.json``; ``--kv-dtype`` overrides the dtype only for an
  engine whose answers cannot tell it; ``attention_backend`` is the flag, else the engine
  family's name (two engines of one family and version run the same kernels);
* ``max_batch_size``: the flag, else the engine's own maximum (SGLang states it), else 256
  (vLLM's default ``--max-num-seqs``);
* labels: the user's, plus ``kv-connector`` and ``kv-side-channel`` (vLLM's NIXL handshake
  address) or ``bootstrap-port`` (SGLang's), so a gateway knows how to hand KV over, and
  ``kv-role`` (``--kv-role``, else from ``--role``) so the scheduler plans transfers only
  the way the connector moves KV.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from hpd_common.kvformat import KvDtype, KvFormat
from hpd_common.worker_model import NetworkLocation, Stage, WorkerSpec

from .engines import EngineFacts
from .model_config import ModelGeometry, model_size_from_config

__all__ = ["ROLES", "AgentFlags", "CapabilityError", "build_spec", "config_revision", "host_port"]

ROLES = {
    "prefill": (Stage.PREFILL,),
    "decode": (Stage.DECODE,),
    "both": (Stage.PREFILL, Stage.DECODE),
}
DEFAULT_MAX_BATCH = 256
_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]+")


class CapabilityError(ValueError):
    """A capability field that can be neither derived nor defaulted; names the flag."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclass(frozen=True, slots=True)
class AgentFlags:
    """What the operator told the agent (``hpd agent --help`` documents each)."""

    engine_url: str
    role: str = "both"
    worker_id: str = ""
    pool_id: str = ""
    endpoint: str = ""
    model_id: str = ""
    model_revision: str = ""
    gpu_type: str = ""
    gpu_count: int = 1
    tp_size: int = 1
    peak_tflops: float = 0.0
    hbm_gbps: float = 0.0
    zone: str = ""
    rack: str = ""
    host: str = ""
    nic_gbps: float = 0.0
    kv_connector: str = ""
    kv_side_channel: str = ""
    kv_role: str = ""
    kv_dtype: str = ""
    attention_backend: str = ""
    max_batch_size: int = 0
    labels: tuple[tuple[str, str], ...] = field(default_factory=tuple)


def host_port(url: str) -> tuple[str, int]:
    """``(host, port)`` of an http(s) URL; the scheme's port when none is given."""
    parts = urlsplit(url if "://" in url else "http://" + url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CapabilityError("--engine-url", f"must be http://host:port, got {url!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise CapabilityError("--engine-url", f"bad port in {url!r}") from exc
    return parts.hostname, port


def config_revision(config_bytes: bytes) -> str:
    """``cfg-`` + 12 hex digits of the SHA-256 of a model's ``config.json``."""
    return "cfg-" + hashlib.sha256(config_bytes).hexdigest()[:12]


def _safe(text: str) -> str:
    return _UNSAFE.sub("-", text).strip("-")[:128] or "x"


KV_ROLES = ("producer", "consumer", "both", "none")


def kv_role_of(flags: AgentFlags) -> str:
    """Which way the engine's KV connector moves KV: ``producer`` (sends only: vLLM's
    ``kv_producer``), ``consumer`` (receives only), ``both``, or ``none`` (the engine runs
    no KV connector: it serves requests whole, prefill and decode on itself). ``--kv-role``
    when given, else the role's: prefill -> producer, decode -> consumer, both -> both. The
    scheduler never plans a transfer out of a consumer or ``none``, nor into a producer or
    ``none``."""
    if flags.kv_role:
        if flags.kv_role not in KV_ROLES:
            known = ", ".join(KV_ROLES)
            raise CapabilityError("--kv-role", f"must be one of {known}, got {flags.kv_role!r}")
        return flags.kv_role
    return {"prefill": "producer", "decode": "consumer"}.get(flags.role, "both")


def _kv_dtype(flags: AgentFlags, facts: EngineFacts) -> KvDtype:
    """The KV dtype: the engine's own (from its KV size), or ``--kv-dtype``, which must agree
    with the engine's when both are known."""
    dtype = facts.kv_dtype
    if flags.kv_dtype:
        try:
            flagged = KvDtype(flags.kv_dtype)
        except ValueError:
            known = ", ".join(d.value for d in KvDtype)
            raise CapabilityError("--kv-dtype", f"must be one of {known}") from None
        if dtype is not None and dtype is not flagged:
            raise CapabilityError(
                "--kv-dtype",
                f"says {flagged.value} but the engine's own KV size says {dtype.value}",
            )
        dtype = flagged
    if dtype is None:
        raise CapabilityError("--kv-dtype", "the engine does not state its KV dtype; give it")
    return dtype


def _labels(flags: AgentFlags, facts: EngineFacts, config_bytes: bytes | None) -> dict[str, str]:
    """The worker's labels: the operator's, then the KV connector's (connector, side channel,
    role, bootstrap port) and the model's size for the scheduler's performance model."""
    labels = dict(flags.labels)
    if flags.kv_connector:
        labels["kv-connector"] = flags.kv_connector
    if flags.kv_side_channel:
        labels["kv-side-channel"] = flags.kv_side_channel
    if flags.kv_connector or flags.kv_role:
        labels["kv-role"] = kv_role_of(flags)
    if facts.bootstrap_port:
        labels["bootstrap-port"] = str(facts.bootstrap_port)
    size = model_size_from_config(config_bytes.decode("utf-8", "replace")) if config_bytes else None
    if size is not None:  # for the scheduler's performance model (capacity.resolve_model)
        labels["model-params"], labels["model-attention-width"] = str(size[0]), str(size[1])
    return labels


def build_spec(
    flags: AgentFlags,
    facts: EngineFacts,
    geometry: ModelGeometry | None,
    config_bytes: bytes | None,
) -> WorkerSpec:
    """The worker record for the registry (module docstring); CapabilityError otherwise."""
    if flags.role not in ROLES:
        raise CapabilityError("--role", f"must be one of {', '.join(ROLES)}, got {flags.role!r}")
    if not flags.gpu_type:
        raise CapabilityError(
            "--gpu-type",
            "is required (a GPU profile such as H100-SXM, A100-80G, L40S; any other name "
            "needs --peak-tflops and --hbm-gbps)",
        )
    host, port = host_port(flags.engine_url)
    model_id = flags.model_id or facts.model_id
    revision = flags.model_revision or (config_revision(config_bytes) if config_bytes else "")
    if not revision:
        raise CapabilityError(
            "--model-revision", "give the served model's revision, or --model-dir to derive it"
        )
    if geometry is None:
        raise CapabilityError(
            "--model-dir",
            "is required: the KV format needs the model's config.json (layers, KV heads, head dim)",
        )
    dtype = _kv_dtype(flags, facts)
    if facts.kv_memory_bytes <= 0:
        raise CapabilityError("--engine-url", "the engine does not state its KV cache size")
    kv = KvFormat(
        dtype=dtype,
        layout=facts.kv_layout,
        block_size_tokens=facts.block_size_tokens,
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        tp_size=flags.tp_size,
        attention_backend=flags.attention_backend or facts.engine,
        model_revision=revision,
    )
    labels = _labels(flags, facts, config_bytes)
    return WorkerSpec(
        worker_id=flags.worker_id or _safe(f"{facts.engine}-{host}-{port}"),
        pool_id=flags.pool_id or _safe(f"{model_id}-{flags.role}-{flags.gpu_type}".lower()),
        endpoint=flags.endpoint or f"{host}:{port}",
        stages=ROLES[flags.role],
        model_id=model_id,
        model_revision=revision,
        engine=facts.engine,
        engine_version=facts.engine_version,
        gpu_type=flags.gpu_type,
        gpu_count=flags.gpu_count,
        tp_size=flags.tp_size,
        pp_size=1,
        peak_tflops=flags.peak_tflops,
        hbm_gbps=flags.hbm_gbps,
        kv_memory_total_bytes=facts.kv_memory_bytes,
        max_batch_size=flags.max_batch_size or facts.max_num_seqs or DEFAULT_MAX_BATCH,
        max_context_tokens=max(0, facts.max_model_len),
        kv_format=kv,
        network=NetworkLocation(
            zone=flags.zone, rack=flags.rack, host=flags.host or host, nic_gbps=flags.nic_gbps
        ),
        labels=tuple(sorted(labels.items())),
    )
