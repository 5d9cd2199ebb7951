"""The recorded engine answers under ``tests/fixtures/engines/``, and edits of them.

The files are real answers of a vLLM 0.32 CPU build serving a tiny Llama (2 layers, 2 KV
heads, head dim 32, bf16) and of an SGLang 0.5 prefill server; tests change copies of
them in memory, never the files.
"""

from __future__ import annotations

import re
from pathlib import Path

from hpd_agent.model_config import ModelGeometry

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "engines"

TINY = ModelGeometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16")
"""The geometry of ``vllm/model_config.json``, written out so a test can check the parser."""

TINY_KV_BYTES = 1_073_741_824
TINY_KV_TOKENS = 2_097_152
TINY_ELEMENTS_PER_TOKEN = 2 * 2 * 2 * 32  # K and V x layers x KV heads x head dim


def read(engine: str, name: str) -> str:
    """One recorded answer as text."""
    return (FIXTURES / engine / name).read_text()


def read_bytes(engine: str, name: str) -> bytes:
    """One recorded file as bytes (the model's config.json is hashed as bytes)."""
    return (FIXTURES / engine / name).read_bytes()


def vllm_answers(metrics: str | None = None) -> dict[str, str]:
    """vLLM's answers to its adapter's info paths; ``metrics`` replaces the recorded scrape."""
    return {
        "/v1/models": read("vllm", "v1_models.json"),
        "/version": read("vllm", "version.json"),
        "/metrics": read("vllm", "metrics_prefill_idle.txt") if metrics is None else metrics,
    }


def sglang_answers(server_info: str | None = None) -> dict[str, str]:
    """SGLang's answers to its adapter's info paths; ``server_info`` replaces the recorded one."""
    return {
        "/v1/models": read("sglang", "v1_models.json"),
        "/get_server_info": (
            read("sglang", "get_server_info.json") if server_info is None else server_info
        ),
        "/metrics": read("sglang", "metrics.txt"),
    }


def with_cache_labels(text: str, **labels: str) -> str:
    """``text`` with the named labels of ``vllm:cache_config_info`` set to new values."""
    out: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.startswith("vllm:cache_config_info{"):
            for key, value in labels.items():
                line, found = re.subn(rf'([{{,]){key}="[^"]*"', rf'\g<1>{key}="{value}"', line)
                assert found == 1, f"cache_config_info has no label {key}"
        out.append(line)
    return "".join(out)


def without_lines(text: str, *prefixes: str) -> str:
    """``text`` without the sample lines that start with any of ``prefixes``."""
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith(prefixes))


def up_to(text: str, prefix: str, *, inclusive: bool) -> str:
    """``text`` cut at the first line starting with ``prefix`` (kept when ``inclusive``)."""
    lines = text.splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if line.startswith(prefix))
    return "".join(lines[: index + 1 if inclusive else index])
