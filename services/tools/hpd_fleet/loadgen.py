"""A load generator for real engines and anything that speaks their OpenAI API (the
gateway, a router): traffic drawn from public traces, scaled to a model's context, sent
open loop at Poisson arrival times or closed loop at a number in flight, each request
streamed and timed (TTFT at the first token event, TPOT over the rest). Used by
``bench/real_fleet.py``.

Mixes: ``azure`` (the Azure LLM conversation trace's prompt and output lengths) or
``chat`` (multi-turn sessions whose every turn repeats the conversation so far, under one
of a few shared system prompts). Lengths are scaled so their 99th percentile fits the
model's context less the largest output (the trace's shape kept, its longest requests
still fitting); outputs to at most ``max_output`` tokens. Prompts are token ids.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from hpd_fleet.real_fleet import FleetStack
from hpd_sim.traces import load_trace

__all__ = [
    "VOCAB",
    "Job",
    "Mix",
    "Result",
    "Shape",
    "closed_loop",
    "drained",
    "engine_counts",
    "for_arm",
    "jobs_at",
    "run_point",
    "saturated",
    "shapes",
    "stream_one",
]

VOCAB = (100, 1000)
"""Token ids drawn for prompts (inside every small vocabulary, past special tokens)."""

Shape = tuple[tuple[int, ...], int]
"""(prompt token ids, output tokens)."""


@dataclass(frozen=True, slots=True)
class Job:
    """One request of a point: arrival offset (s), prompt token ids, output tokens."""

    at_s: float
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass
class Result:
    rid: str
    status: int = 0  # HTTP status; 599: no answer
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    tokens: int = 0


# -- traffic ------------------------------------------------------------------------------


def _scale(values: list[int], budget: int) -> list[int]:
    """Lengths scaled so their 99th percentile is ``budget`` (the shape kept), each in
    [1, budget]."""
    p99 = sorted(values)[int(0.99 * (len(values) - 1))] or 1
    return [max(1, min(budget, round(v * budget / p99))) for v in values]


@dataclass(frozen=True, slots=True)
class Mix:
    """Which traffic (``kind``: azure or chat; module docstring), for a model of
    ``max_model_len`` tokens, outputs of at most ``max_output``; ``trace``: the Azure CSV."""

    kind: str
    trace: Path
    max_model_len: int = 1024
    max_output: int = 48

    def __post_init__(self) -> None:
        if self.kind not in ("azure", "chat"):
            raise ValueError(f"mix must be azure or chat, got {self.kind!r}")
        if self.max_model_len <= self.max_output + 8:
            raise ValueError("the model's length leaves no room for a prompt")


def shapes(mix: Mix, n: int, rng: random.Random) -> list[Shape]:
    """``n`` (prompt token ids, output tokens) of the mix (module docstring)."""
    budget = mix.max_model_len - mix.max_output - 8
    if mix.kind == "azure":
        trace = load_trace(mix.trace).requests
        drawn = [trace[rng.randrange(len(trace))] for _ in range(n)]
        prompts = _scale([r.prompt_tokens for r in drawn], budget)
        outputs = _scale([r.output_tokens for r in drawn], mix.max_output)
        return [(_tokens(rng, p), o) for p, o in zip(prompts, outputs, strict=True)]
    systems = [_tokens(rng, rng.randrange(64, 256)) for _ in range(4)]
    out: list[Shape] = []
    while len(out) < n:
        convo = systems[rng.randrange(len(systems))]
        for _ in range(rng.randrange(2, 6)):
            convo = convo + _tokens(rng, rng.randrange(16, 96))
            if len(convo) > budget:
                break
            answer = rng.randrange(8, mix.max_output + 1)
            out.append((convo, answer))
            convo = convo + _tokens(rng, answer)  # the answer, as the next turn sends it
    return out[:n]


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(*VOCAB) for _ in range(n))


def jobs_at(rate: float, window_s: float, mix: Mix, seed: int) -> list[Job]:
    """Poisson arrivals at ``rate`` over ``window_s`` with the mix's shapes."""
    rng = random.Random(seed)
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < window_s:
        times.append(t)
        t += rng.expovariate(rate)
    got = shapes(mix, len(times), rng)
    return [Job(at, p, o) for at, (p, o) in zip(times, got, strict=True)]


def for_arm(jobs: list[Job], arm_index: int) -> list[Job]:
    """The same jobs with their token ids shifted by a per-arm offset (a bijection on the
    vocabulary): the lengths, arrival times and the prefixes shared inside the mix stay,
    but no arm finds another's prompts in an engine's prefix cache."""
    lo, hi = VOCAB
    span, shift = hi - lo, 97 * (arm_index + 1)
    return [
        Job(j.at_s, tuple(lo + (t - lo + shift) % span for t in j.prompt), j.max_tokens)
        for j in jobs
    ]


# -- the client ---------------------------------------------------------------------------


async def stream_one(
    http: aiohttp.ClientSession, url: str, job: Job, rid: str, headers: dict[str, str]
) -> Result:
    body = {"model": "tiny", "prompt": list(job.prompt), "max_tokens": job.max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}  # fmt: skip
    res = Result(rid)
    t0 = time.perf_counter()
    first = last = 0.0
    try:
        async with http.post(url + "/v1/completions", json=body,
                             headers={**headers, "x-request-id": rid}) as resp:  # fmt: skip
            res.status = resp.status
            if resp.status != 200:
                await resp.read()
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    res.status = 502
                    return res
                if event.get("choices"):
                    last = time.perf_counter()
                    res.tokens += 1
                    if res.tokens == 1:
                        first = last
    except (aiohttp.ClientError, TimeoutError):
        res.status = 599
        return res
    if res.tokens:
        res.ttft_s = first - t0
        res.tpot_s = (last - first) / (res.tokens - 1) if res.tokens > 1 else 0.0
    else:
        res.status = 502
    return res


async def run_point(
    url: str, jobs: list[Job], arm: str, tag: str, headers: dict[str, str]
) -> list[Result]:
    """Every job sent at its arrival time (open loop); all answers awaited."""
    timeout = aiohttp.ClientTimeout(total=300, sock_connect=10)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as http:
        t0 = time.perf_counter()

        async def at(i: int, job: Job) -> Result:
            await asyncio.sleep(max(0.0, t0 + job.at_s - time.perf_counter()))
            return await stream_one(http, url, job, f"{tag}-{arm}-{i}", headers)

        return list(await asyncio.gather(*(at(i, j) for i, j in enumerate(jobs))))


# -- engines ------------------------------------------------------------------------------


async def engine_counts(stack: FleetStack) -> dict[str, float]:
    """Requests each engine has finished (``vllm:request_success_total``)."""
    out: dict[str, float] = {}
    async with aiohttp.ClientSession() as http:
        for name, e in stack.engines.items():
            async with http.get(e.url + "/metrics") as resp:
                text = await resp.text()
            total = 0.0
            for fam in text_string_to_metric_families(text):
                if fam.name == "vllm:request_success":
                    total += sum(smp.value for smp in fam.samples if smp.name.endswith("_total"))
            out[name] = total
    return out


async def drained(stack: FleetStack, timeout_s: float = 120.0) -> None:
    """Until no engine has a request running or waiting."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            busy = 0.0
            for e in stack.engines.values():
                async with http.get(e.url + "/metrics") as resp:
                    text = await resp.text()
                for fam in text_string_to_metric_families(text):
                    if fam.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                        busy += sum(smp.value for smp in fam.samples)
            if busy == 0:
                return
            await asyncio.sleep(0.5)


async def closed_loop(
    http: aiohttp.ClientSession, url: str, work: list[Shape], clients: int, seconds: float
) -> float:
    """Requests/s served with ``clients`` requests in flight for ``seconds``."""
    done = 0
    stop = time.perf_counter() + seconds

    async def client(k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() < stop:
            prompt, out = work[i % len(work)]
            i += clients
            done += (await stream_one(http, url, Job(0, prompt, out), "cap", {})).status == 200

    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    return done / (time.perf_counter() - t0)


async def saturated(
    http: aiohttp.ClientSession,
    url: str,
    work: list[Shape],
    seconds: float,
    levels: tuple[int, ...] = (2, 4, 8, 16, 32),
) -> tuple[float, int]:
    """(requests/s, in flight) at saturation: the best rate over ``levels`` requests in
    flight in turn, ``seconds`` in all. An engine batches its decodes, so one level alone
    understates it (4 in flight measured 4.5 req/s on an engine that then served 8.3 req/s
    open loop with every request in SLO)."""
    best, at = 0.0, 0
    for clients in levels:
        rps = await closed_loop(http, url, work, clients, seconds / len(levels))
        if rps > best:
            best, at = rps, clients
    return best, at
