"""hpd gateway against the peer router (vllm-router, P/D mode) on the same two real engines.

Setup (``hpd_fleet.real.RealStack``): a prefill and a decode vLLM engine (CPU build, NIXL KV
transfer, one core each), ``hpd up``, an agent per engine, ``hpd gateway``, and
``vllm-router --vllm-pd-disaggregation`` over the same two engines. Three arms, each
request streamed, TTFT measured by this client at the first token event:

* ``direct``: this script runs vLLM's hand-off itself (prefill POST, then the decode
  stream): the floor, with no proxy at all;
* ``router``: the peer router;
* ``gateway``: hetero-pd's gateway (token count, Schedule, the hand-off, session and
  outcome reports).

Phase 1 (latency, one request at a time): rounds of one request per arm, the arm order
shuffled each round, every request a fresh prompt (so no arm profits from another's prefix
cache), prompt lengths and output lengths drawn from one seeded mix. Phase 2 (throughput,
8 requests in flight): the same number of requests per arm, the arms run A-B-C then C-B-A
and each arm's two passes averaged (drift on a shared machine cancels).

Figures (``--json``): ``ttft_p50_vs_vllm_router``, ``ttft_p99_vs_vllm_router`` (gateway /
router), ``throughput_vs_vllm_router_c8`` (gateway / router);
``ttft_per_round_ratio_p50_vs_vllm_router`` (no target): the median over rounds of the
gateway's TTFT over the router's in the same round (each ratio compares the same prompt
length and output, so the mix's spread of lengths does not enter it); the gateway's added
latency per request, ``gateway_added_ms_p50`` / ``_p99``: its TTFT minus the direct arm's
in the same round (its own time outside the engines, plus the noise of one round);
``gateway_steps_ms_c1``: where the gateway's own time went in the latency phase (p50 and
p99 milliseconds of its tokenize, schedule and prefill steps, from its ``Server-Timing``
header); ``gateway_modes_c8``: the gateway's requests at 8 in flight by the hand-off mode
its plans used (the peer always transfers), ``gateway_fallbacks_c8``: its steps at 8 in
flight that failed and were replaced by the plan's next, by cause;
``gateway_refusals_retried``: 429s (admission) the gateway arm got and retried after their
Retry-After, as the openai SDK does (the wait counts in that request's TTFT; the peer
admits everything).

    .venv/bin/python bench/gateway.py --quick --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from hpd_fleet.real import RealStack

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "prefill",
    "and",
    "decode",
    "share",
    "one",
    "cache",
    "across",
    "the",
    "link",
    "or",
    "recompute",
    "it",
    "on",
    "the",
    "other",
    "side",
    "of",
    "a",
    "heterogeneous",
    "fleet",
]


def prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


def server_timing(header: str) -> dict[str, float]:
    """``a;dur=1.5, b;dur=2`` -> {"a": 1.5, "b": 2.0} (W3C Server-Timing, ms)."""
    out: dict[str, float] = {}
    for part in header.split(","):
        name, _, rest = part.strip().partition(";")
        if rest.startswith("dur="):
            out[name] = float(rest[4:])
    return out


# the gateway's own steps of every latency-phase request (from its Server-Timing header)
GATEWAY_STEPS: list[dict[str, float]] = []


BENCH_TIER = {"x-hpd-tier": "batch"}
"""The gateway arm's tier: the default profile's batch tier (TTFT target 30 s). CPU engines
are predicted slow enough that the standard tier's 3 s target makes admission refuse some
requests at 8 in flight; the peer router admits everything, and this benchmark measures
the cost of the path, not admission (``tests/real_engine`` covers refusals)."""


REFUSED: list[float] = []
"""Retry-After seconds of every 429 the gateway answered (the request was then sent again,
as the openai SDK does; the wait counts in its TTFT, which runs from the first try)."""
MAX_TRIES = 20


async def _stream(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    t0: float,
    headers: dict[str, str] | None = None,
) -> tuple[float, int]:
    """(TTFT seconds from t0, token events) of one streamed completion; a 429 (admission
    refused) is retried after its Retry-After, up to ``MAX_TRIES`` times."""
    for _ in range(MAX_TRIES):
        async with http.post(url, json=body, headers=headers) as resp:
            if resp.status == 429:
                wait = float(resp.headers.get("Retry-After", "1") or 1)
                REFUSED.append(wait)
                await resp.read()
            else:
                return await _tokens(url, resp, t0)
        await asyncio.sleep(wait)
    raise RuntimeError(f"{url}: refused {MAX_TRIES} times in a row (HTTP 429)")


async def _tokens(url: str, resp: aiohttp.ClientResponse, t0: float) -> tuple[float, int]:
    """(TTFT seconds from t0, token events) of a streamed answer."""
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:200]}")
    if "Server-Timing" in resp.headers:
        GATEWAY_STEPS.append(server_timing(resp.headers["Server-Timing"]))
    ttft = 0.0
    tokens = 0
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        event = json.loads(payload)
        if event.get("choices"):
            tokens += 1
            if tokens == 1:
                ttft = time.perf_counter() - t0
    if tokens == 0:
        raise RuntimeError(f"{url}: no token")
    return ttft, tokens


async def one(
    http: aiohttp.ClientSession, arm: str, stack: RealStack, text: str, max_tokens: int
) -> float:
    body: dict[str, Any] = {
        "model": "tiny", "prompt": text, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    t0 = time.perf_counter()
    if arm == "direct":
        pre = stack.engines["prefill"].url + "/v1/completions"
        first_body = {**body, "stream": False, "max_tokens": 1,
                      "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
        async with http.post(pre, json=first_body) as resp:
            params = (await resp.json())["kv_transfer_params"]
        dec = stack.engines["decode"].url + "/v1/completions"
        ttft, _ = await _stream(http, dec, {**body, "kv_transfer_params": params}, t0)
        return ttft
    base = stack.gateway_url if arm == "gateway" else stack.router_url
    tier = BENCH_TIER if arm == "gateway" else None
    ttft, _ = await _stream(http, base + "/v1/completions", body, t0, tier)
    return ttft


PROMPT_WORDS = (40, 400)
OUTPUT_TOKENS = (8, 32)


def mix(rng: random.Random) -> tuple[int, int]:
    """(prompt words, max tokens): short chat turns to long-context prompts, each drawn
    uniformly from its range. Not a few fixed lengths: with four prompt lengths drawn
    equally often, the median TTFT of 120 requests falls at the boundary between the
    second and the third length, where their TTFTs overlap, so which length an arm's median
    comes from is chance (a run had the router's median below the no-proxy arm's by 13 %);
    over a continuous range every arm's median is a request of about the median length."""
    return rng.randint(*PROMPT_WORDS), rng.randint(*OUTPUT_TOKENS)


async def latency_phase(
    stack: RealStack, rounds: int, rng: random.Random
) -> dict[str, list[float]]:
    ttft: dict[str, list[float]] = {"direct": [], "router": [], "gateway": []}
    async with aiohttp.ClientSession() as http:
        for arm in ttft:  # warm every path once (connections, engine caches of the code)
            await one(http, arm, stack, prompt(rng, 50), 4)
        for i in range(rounds):
            words, max_tokens = mix(rng)
            arms = list(ttft)
            rng.shuffle(arms)
            for arm in arms:
                ttft[arm].append(await one(http, arm, stack, prompt(rng, words), max_tokens))
            if (i + 1) % 10 == 0:
                print(f"  latency: {i + 1}/{rounds} rounds", file=sys.stderr, flush=True)
    return ttft


async def throughput_pass(
    stack: RealStack, arm: str, shapes: list[tuple[int, int]], rng: random.Random
) -> float:
    """8 clients in flight through ``arm`` over the requests ``shapes`` gives (prompt words,
    max tokens); every prompt's text is fresh (no arm profits from another's cache)."""
    n = len(shapes)
    jobs = [(prompt(rng, words), max_tokens) for words, max_tokens in shapes]
    queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    for j in jobs:
        queue.put_nowait(j)

    async def worker(http: aiohttp.ClientSession) -> None:
        while not queue.empty():
            text, max_tokens = queue.get_nowait()
            await one(http, arm, stack, text, max_tokens)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(8)))
        return n / (time.perf_counter() - t0)


async def gateway_counts(stack: RealStack) -> dict[str, dict[str, float]]:
    """The gateway's requests so far by hand-off mode used (``hpd_gateway_requests``) and
    its fallback steps by the failed step's cause (``hpd_gateway_fallbacks``)."""
    async with aiohttp.ClientSession() as http, http.get(stack.gateway_metrics_url) as resp:
        text = await resp.text()
    wanted = {
        "hpd_gateway_requests": ("modes", "mode"),
        "hpd_gateway_fallbacks": ("fallbacks", "cause"),
    }
    counts: dict[str, dict[str, float]] = {"modes": {}, "fallbacks": {}}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        kind, label = wanted[family.name]
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = sample.labels.get(label, "")
                counts[kind][key] = counts[kind].get(key, 0.0) + sample.value
    return counts


async def throughput_phase(
    stack: RealStack, n: int, rng: random.Random
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Requests per second per arm, and what the gateway's requests at 8 in flight did:
    ``modes`` (the hand-off mode used; the peer always transfers, and a plan that prefills
    on the decode engine takes that engine from decoding) and ``fallbacks`` (steps that
    failed and were replaced, by cause)."""
    rates: dict[str, list[float]] = {"router": [], "gateway": []}
    seen: dict[str, dict[str, float]] = {"modes": {}, "fallbacks": {}}
    for order in (["router", "gateway"], ["gateway", "router"]):
        # both arms of an order serve the same work (the same prompt lengths and outputs):
        # drawn per pass, 32 requests of the mix differed by up to 40 % in prompt words
        shapes = [(mix(rng)[0], mix(rng)[1]) for _ in range(n)]
        for arm in order:
            before = await gateway_counts(stack) if arm == "gateway" else {}
            rates[arm].append(await throughput_pass(stack, arm, shapes, rng))
            if arm == "gateway":
                after = await gateway_counts(stack)
                for kind, now in after.items():
                    for key, count in now.items():
                        was = before.get(kind, {}).get(key, 0.0)
                        seen[kind][key] = seen[kind].get(key, 0.0) + count - was
            print(f"  throughput c=8: {arm} {rates[arm][-1]:.2f} req/s", file=sys.stderr)
    return {arm: statistics.fmean(v) for arm, v in rates.items()}, seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="fewer requests (a few minutes)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    rounds, per_pass = (30, 32) if args.quick else (120, 96)
    rng = random.Random(args.seed)
    t_setup = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hpd-bench-gw-") as tmp:
        print("setting up engines, control plane, gateway and router ...", file=sys.stderr)
        with RealStack(Path(tmp), with_router=True) as stack:
            setup_s = time.perf_counter() - t_setup
            ttft = asyncio.run(latency_phase(stack, rounds, rng))
            steps = list(GATEWAY_STEPS)
            rates, seen = asyncio.run(throughput_phase(stack, per_pass, rng))
    added = [(g - d) * 1000 for g, d in zip(ttft["gateway"], ttft["direct"], strict=True)]
    paired = [g / r for g, r in zip(ttft["gateway"], ttft["router"], strict=True) if r > 0]
    figures = {
        "ttft_p50_vs_vllm_router": pct(ttft["gateway"], 0.5) / pct(ttft["router"], 0.5),
        "ttft_p99_vs_vllm_router": pct(ttft["gateway"], 0.99) / pct(ttft["router"], 0.99),
        "throughput_vs_vllm_router_c8": rates["gateway"] / rates["router"],
        "ttft_per_round_ratio_p50_vs_vllm_router": pct(paired, 0.5),
        "gateway_added_ms_p50": pct(added, 0.5),
        "gateway_added_ms_p99": pct(added, 0.99),
        "ttft_ms": {
            arm: {"p50": pct(v, 0.5) * 1000, "p99": pct(v, 0.99) * 1000} for arm, v in ttft.items()
        },
        "throughput_c8_req_per_s": rates,
        "gateway_modes_c8": {k: int(v) for k, v in sorted(seen["modes"].items()) if v},
        "gateway_fallbacks_c8": {k: int(v) for k, v in sorted(seen["fallbacks"].items()) if v},
        "gateway_steps_ms_c1": {
            name: {
                "p50": pct([st[name] for st in steps if name in st], 0.5),
                "p99": pct([st[name] for st in steps if name in st], 0.99),
            }
            for name in ("tokenize", "schedule", "prefill")
            if any(name in st for st in steps)
        },
        "gateway_refusals_retried": len(REFUSED),
        "rounds": rounds,
        "requests_per_pass_c8": per_pass,
        "setup_s": setup_s,
        "quick": args.quick,
    }
    if args.json:
        print(json.dumps(figures))
    else:
        for k, v in figures.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
