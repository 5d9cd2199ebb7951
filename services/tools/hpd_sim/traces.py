"""Request traces: load the public LLM serving traces and reshape them for replay.

Two formats are read, both shipped (attributed) under ``data/traces/`` in the repository:

* **Azure LLM inference trace** (CSV, ``TIMESTAMP,ContextTokens,GeneratedTokens``), e.g. the
  2023 conversation trace published with Patel et al., "Splitwise: Efficient Generative LLM
  Inference Using Phase Splitting", ISCA 2024 (CC-BY 4.0). Timestamps are wall-clock strings
  (``2023-11-16 18:15:46.6805900``, up to 7 fractional digits); arrivals are made relative to
  the first row.
* **Mooncake trace** (JSONL, ``{"timestamp": ms, "input_length", "output_length",
  "hash_ids"}``), from Qin et al., "Mooncake: Trading More Storage for Less Computation",
  FAST 2025 (Apache-2.0). ``hash_ids`` name the prompt's 512-token prefix blocks; they are kept
  so that a replay can hint at shared prefixes.

Reshaping (:func:`reshape`), in this order:

* ``rate_scale`` s: arrival ``t -> t / s`` (s = 2 replays the same requests twice as fast;
  the request mix is unchanged, which is how DistServe and Splitwise sweep load);
* ``duration_s``: keep the requests arriving before this many seconds *after* rate scaling;
* ``max_requests``: keep at most this many (the earliest);
* ``time_scale`` k (emulation only): the returned schedule's offsets are divided by k so an
  emulated fleet can run k times faster than real time; the simulator has its own clock and
  leaves it at 1.

Units: seconds for times, tokens for lengths.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

__all__ = [
    "Trace",
    "TraceError",
    "TraceRequest",
    "load_azure_csv",
    "load_mooncake_jsonl",
    "load_trace",
    "reshape",
]


class TraceError(ValueError):
    """A trace file that cannot be read; carries the file and line (1-based) at fault."""

    def __init__(self, path: str, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = path
        self.line = line
        self.message = message


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: arrival time (s, from the trace start), prompt and output
    lengths (tokens), and the prompt's prefix-block hashes when the trace has them."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Trace:
    """A named, arrival-ordered sequence of requests."""

    name: str
    requests: tuple[TraceRequest, ...]

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        """Last arrival minus first arrival (0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def mean_rate(self) -> float:
        """Requests per second over the trace: ``(n - 1) / duration`` (0 if undefined)."""
        d = self.duration_s
        return (len(self.requests) - 1) / d if d > 0 else 0.0


def _parse_azure_time(text: str) -> float:
    """Seconds since the epoch (UTC assumed) of ``YYYY-MM-DD HH:MM:SS[.fffffff]``; Python's
    parser takes at most 6 fractional digits, so the 7th (100 ns) is kept arithmetically."""
    text = text.strip()
    whole, _, frac = text.partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    seconds = (base - datetime(1970, 1, 1)).total_seconds()
    if frac:
        if not frac.isdigit():
            raise ValueError(f"bad fractional seconds {frac!r}")
        seconds += int(frac) / 10 ** len(frac)
    return seconds


def _positive_int(value: str | int, field: str, allow_zero: bool = False) -> int:
    n = int(value)
    if n < 0 or (n == 0 and not allow_zero):
        raise ValueError(f"{field} must be {'>= 0' if allow_zero else '>= 1'}, got {n}")
    return n


def _finish(name: str, rows: list[TraceRequest]) -> Trace:
    rows.sort(key=lambda r: r.arrival_s)
    if rows:
        t0 = rows[0].arrival_s
        rows = [
            TraceRequest(r.arrival_s - t0, r.prompt_tokens, r.output_tokens, r.hash_ids)
            for r in rows
        ]
    return Trace(name, tuple(rows))


def load_azure_csv(path: str | Path) -> Trace:
    """Read an Azure LLM inference trace CSV. Prompts of 0 tokens are raised to 1 and outputs
    of 0 to 1 (every request yields at least its first token); other bad rows raise
    :class:`TraceError` with the line number."""
    p = Path(path)
    rows: list[TraceRequest] = []
    with p.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if reader.fieldnames is None or not need <= {f.strip() for f in reader.fieldnames}:
            raise TraceError(str(p), 1, f"expected columns {sorted(need)}")
        for i, row in enumerate(reader, start=2):
            try:
                t = _parse_azure_time(row["TIMESTAMP"])
                prompt = max(1, _positive_int(row["ContextTokens"], "ContextTokens", True))
                out = max(1, _positive_int(row["GeneratedTokens"], "GeneratedTokens", True))
            except (ValueError, TypeError, KeyError) as exc:
                raise TraceError(str(p), i, str(exc)) from None
            rows.append(TraceRequest(t, prompt, out))
    return _finish(p.stem, rows)


def load_mooncake_jsonl(path: str | Path) -> Trace:
    """Read a Mooncake JSONL trace (``timestamp`` in ms). Blank lines are skipped."""
    p = Path(path)
    rows: list[TraceRequest] = []
    with p.open(encoding="utf-8") as fh:
        for i, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                t = float(obj["timestamp"]) / 1000.0
                if not math.isfinite(t):
                    raise ValueError("timestamp must be finite")
                prompt = max(1, _positive_int(obj["input_length"], "input_length", True))
                out = max(1, _positive_int(obj["output_length"], "output_length", True))
                hashes = tuple(int(h) for h in obj.get("hash_ids", ()) or ())
            except (ValueError, TypeError, KeyError) as exc:
                raise TraceError(str(p), i, f"{type(exc).__name__}: {exc}") from None
            rows.append(TraceRequest(t, prompt, out, hashes))
    return _finish(p.stem, rows)


def load_trace(path: str | Path) -> Trace:
    """Load by extension: ``.csv`` (Azure) or ``.jsonl`` / ``.json`` (Mooncake)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".csv":
        return load_azure_csv(p)
    if suffix in (".jsonl", ".json"):
        return load_mooncake_jsonl(p)
    raise TraceError(str(p), 0, "unknown trace format (expected .csv or .jsonl)")


def reshape(
    trace: Trace | Sequence[TraceRequest],
    rate_scale: float = 1.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    time_scale: float = 1.0,
    name: str | None = None,
    rate_scale_end: float | None = None,
) -> Trace:
    """Rate-scale, cut and time-scale a trace (module docstring); returns a new :class:`Trace`.

    ``arrival' = arrival / rate_scale / time_scale``; the duration cut applies to
    ``arrival / rate_scale`` (trace seconds at the new rate, before emulation speed-up).

    With ``rate_scale_end`` (and ``duration_s``) the rate is a ramp instead: ``rate_scale``
    x the trace's at the start, rising linearly in replay time to ``rate_scale_end`` x at
    ``duration_s``. Replay time ``t`` of trace time ``s`` solves
    ``s = a t + (b - a) t^2 / (2 D)`` (the integral of the multiplier).
    """
    if not rate_scale > 0 or not math.isfinite(rate_scale):
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    if not time_scale > 0 or not math.isfinite(time_scale):
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if duration_s is not None and duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s}")
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0, got {max_requests}")
    if rate_scale_end is not None:
        if not rate_scale_end > 0 or not math.isfinite(rate_scale_end):
            raise ValueError(f"rate_scale_end must be > 0, got {rate_scale_end}")
        if not duration_s:
            raise ValueError("a rate ramp needs duration_s")
    reqs: Iterable[TraceRequest] = trace.requests if isinstance(trace, Trace) else trace
    out: list[TraceRequest] = []
    ramp = 0.0
    if rate_scale_end is not None and duration_s:
        ramp = (rate_scale_end - rate_scale) / (2.0 * duration_s)
    for r in reqs:
        if ramp:
            disc = rate_scale**2 + 4.0 * ramp * r.arrival_s
            if disc < 0:  # a falling ramp that never reaches this request
                break
            t = (math.sqrt(disc) - rate_scale) / (2.0 * ramp)
        else:
            t = r.arrival_s / rate_scale
        if duration_s is not None and t >= duration_s:
            break
        if max_requests is not None and len(out) >= max_requests:
            break
        out.append(TraceRequest(t / time_scale, r.prompt_tokens, r.output_tokens, r.hash_ids))
    base = trace.name if isinstance(trace, Trace) else "trace"
    return Trace(name or base, tuple(out))
