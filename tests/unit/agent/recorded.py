"""The recorded engine answers under ``tests/fixtures/engines/``, and edits of them.

The files are real answers of a vLLM 0.32 CPU build serving a tiny Llama (2 layers, 2 KV
heads, head dim 32, bf16) and of an SGLang 0.5 prefill server; tests change copies of
them in memory, never the files.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpd_agent.engines import SglangAdapter, VllmAdapter
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


# adapters and recorded metric texts the engine tests share
VLLM = VllmAdapter()
SGLANG = SglangAdapter()
IDLE = read("vllm", "metrics_prefill_idle.txt")
DECODE = read("vllm", "metrics_decode.txt")
GAUGES = (
    "vllm:num_requests_running{",
    "vllm:num_requests_waiting{",
    "vllm:kv_cache_usage_perc{",
)


def vllm_gauges(running: str = "0", waiting: str = "0", usage: str = "0") -> str:
    return (
        f"vllm:num_requests_running {running}\n"
        f"vllm:num_requests_waiting {waiting}\n"
        f"vllm:kv_cache_usage_perc {usage}\n"
    )


def sglang_gauges(running: str = "0", waiting: str = "0", usage: str = "0") -> str:
    return (
        f"sglang:num_running_reqs {running}\n"
        f"sglang:num_queue_reqs {waiting}\n"
        f"sglang:token_usage {usage}\n"
    )


MALFORMED = [
    pytest.param("this is not prometheus\n", id="prose"),
    pytest.param("vllm:num_requests_running 1.0.0\n", id="bad-number"),
    pytest.param("vllm:num_requests_running\n", id="no-value"),
    pytest.param('vllm:num_requests_running{engine="0} 1\n', id="unterminated-label"),
    pytest.param('vllm:num_requests_running{engine="0",model_na', id="cut-in-label-set"),
    pytest.param("<html><body>502 Bad Gateway</body></html>\n", id="html-error-page"),
    pytest.param('{"detail": "Not Found"}', id="json-body"),
    pytest.param("\x00\x01\x02", id="binary"),
]
