"""The model's own config.json, read by the agent: the geometry that fixes the KV format
(layers, KV heads, head dim) and the size the scheduler's performance model prices a model
by when it is not in its table. Pure."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .engines import EngineError

__all__ = ["ModelGeometry", "geometry_from_config", "model_size_from_config"]


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """The model shape the KV format follows (from the model folder's ``config.json``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the config's torch_dtype, e.g. "bfloat16"; "" when absent


def geometry_from_config(text: str, source: str = "config.json") -> ModelGeometry:
    """Layers, KV heads, head dim and dtype of a Hugging Face ``config.json``.

    ``num_key_value_heads`` falls back to ``num_attention_heads`` (no GQA) and ``head_dim``
    to ``hidden_size / num_attention_heads``, as the models themselves do; a multimodal
    config's ``text_config`` is used when the top level has no layer count.
    """
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EngineError(source, f"not JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(cfg, dict):
        raise EngineError(source, "must be a JSON object")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}

    def positive(key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise EngineError(source, f"{key} must be a positive integer, got {value!r}")
        return value

    if "num_hidden_layers" not in cfg:
        raise EngineError(source, "has no num_hidden_layers")
    if "num_attention_heads" not in cfg:
        raise EngineError(source, "has no num_attention_heads")
    layers = positive("num_hidden_layers", cfg["num_hidden_layers"])
    heads = positive("num_attention_heads", cfg["num_attention_heads"])
    raw_kv = cfg.get("num_key_value_heads")
    kv_heads = heads if raw_kv is None else positive("num_key_value_heads", raw_kv)
    head_dim_raw = cfg.get("head_dim")
    if head_dim_raw is None:
        hidden = positive("hidden_size", cfg.get("hidden_size"))
        if hidden % heads:
            raise EngineError(source, f"hidden_size {hidden} is not a multiple of {heads} heads")
        head_dim_raw = hidden // heads
    head_dim = positive("head_dim", head_dim_raw)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or ""
    return ModelGeometry(layers, kv_heads, head_dim, str(dtype))


def model_size_from_config(text: str) -> tuple[int, int] | None:
    """(parameters a token goes through, attention width = query heads x head dim) of a
    Hugging Face ``config.json``, or None when it lacks the numbers. The scheduler's
    performance model prices compute by parameter count; for a model outside its table it
    otherwise assumes 8 B, which made a 3 M parameter model look 2,600x slower than it is.

    Per layer: q and o projections (width x hidden each), k and v (kv heads x head dim x
    hidden each), and a gated MLP (3 x hidden x intermediate; for a mixture of experts, times
    the experts a token is routed to); plus the embedding and, unless tied, the output head
    (vocab x hidden each). Norms and biases are left out (well under 1 %)."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(cfg, dict):
        return None
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}

    def num(key: str, default: int = 0) -> int:
        value = cfg.get(key, default)
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        return int(value) if ok else 0

    layers, hidden, heads = num("num_hidden_layers"), num("hidden_size"), num("num_attention_heads")
    if not (layers and hidden and heads):
        return None
    kv_heads = num("num_key_value_heads") or heads
    head_dim = num("head_dim") or hidden // heads
    inter = num("intermediate_size") or 4 * hidden
    routed = num("num_experts_per_tok") or 1
    width = heads * head_dim
    per_layer = 2 * width * hidden + 2 * kv_heads * head_dim * hidden + 3 * hidden * inter * routed
    embeddings = num("vocab_size") * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings, width
