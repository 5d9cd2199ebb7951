"""Request classification (seed 000's resource need): which stage's resources a request
mostly needs, from its prompt and output lengths.

The seed's other mechanisms (hand-off choice, capability gates, pool-level fallback
routing) are the planner's own rules per worker pair (``planner.py``, ``pairing.py``,
``plugins.py``); their pool-level form, which the seed's test cases call, lives beside those
tests (``tests/unit/policy/seed_mechanisms.py``).
"""

from __future__ import annotations

from .domain import ResourceNeed
from .errors import InvalidInputError

__all__ = ["classify_need"]


def classify_need(
    prompt_tokens: int,
    output_tokens: int,
    long_prompt_threshold: int = 2048,
    long_decode_threshold: int = 256,
) -> ResourceNeed:
    """Dominant pressure of a request.

    PREFILL when ``prompt > long_prompt_threshold`` and ``output <= long_decode_threshold``;
    DECODE when ``output > long_decode_threshold`` and ``prompt <= long_prompt_threshold``;
    SHARED otherwise (both long or both short). Thresholds are exclusive: a prompt of exactly
    the threshold is not long. The three classes are mutually exclusive by construction.
    """
    if prompt_tokens < 0:
        raise InvalidInputError("prompt_tokens", f"must be >= 0, got {prompt_tokens}")
    if output_tokens < 0:
        raise InvalidInputError("decode_tokens", f"must be >= 0, got {output_tokens}")
    if long_prompt_threshold < 0 or long_decode_threshold < 0:
        raise InvalidInputError("threshold", "thresholds must be >= 0")
    long_prompt = prompt_tokens > long_prompt_threshold
    long_decode = output_tokens > long_decode_threshold
    if long_prompt and not long_decode:
        return ResourceNeed.PREFILL
    if long_decode and not long_prompt:
        return ResourceNeed.DECODE
    return ResourceNeed.SHARED
