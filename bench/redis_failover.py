"""Redis Sentinel failover under load: how long until the control plane serves again.

Starts a primary and a replica `redis-server`, a sentinel (down-after 500 ms) and
`hpd up --redis-url redis+sentinel://...?wait_replicas=1`; three workers heartbeat and
clients schedule without pause (retrying UNAVAILABLE with the same request id, as a
gateway does); the primary is SIGKILLed mid-run. Reported: the time from the kill to the
first plan of a request sent after it (`time_to_serve_again_s`), Sentinel's own part of it
(kill to the sentinel naming the replica as primary, measured in the same run: the
baseline, the earliest any Sentinel client can find the new primary), their
ratio `serve_again_vs_promotion` (what our clients add on top of Sentinel), and what was
lost: acknowledged registrations, plans, outcomes, reservations and sessions read back after
the failover (all must be 0), and requests never planned. `--quick` runs one failover,
the full run three (medians).

    .venv/bin/python bench/redis_failover.py --quick --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one failover (about 30 s)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--runs", type=int, default=0, help="failovers to run (default 1 / 3)")
    args = ap.parse_args()
    from tests.support.failover import run_failover

    runs = args.runs or (1 if args.quick else 3)
    results = []
    for i in range(runs):
        with tempfile.TemporaryDirectory(prefix="hpd-failover-") as tmp:
            res = asyncio.run(run_failover(Path(tmp), seconds=8.0, kill_at_s=3.0))
        results.append(res)
        if not args.json:
            print(f"run {i + 1}/{runs}: {res.summary()}", file=sys.stderr, flush=True)
    serve = [r.serve_again_s for r in results]
    promo = [r.promotion_s for r in results]
    lost = sum(
        len(r.lost_registrations) + len(r.missing_records) + len(r.missing_outcomes)
        + len(r.missing_sessions) + len(r.missing_reservations) + len(r.unreleased)
        for r in results
    )  # fmt: skip
    doc = {
        "runs": runs,
        "time_to_serve_again_s": round(statistics.median(serve), 3),
        "time_to_serve_again_s_max": round(max(serve), 3),
        "sentinel_promotion_s": round(statistics.median(promo), 3),
        "serve_again_vs_promotion": round(statistics.median(serve) / statistics.median(promo), 3)
        if min(promo) > 0
        else None,
        "requests_sent": sum(r.sent for r in results),
        "requests_never_planned": sum(r.sent - len(r.acked) for r in results),
        "acknowledged_state_lost": lost,
        "retries": sum(r.retries for r in results),
    }
    if args.json:
        print(json.dumps(doc))
    else:
        for key, value in doc.items():
            print(f"{key:28} {value}")
    ok = all(r.serve_again_s > 0 for r in results)
    return 0 if ok and lost == 0 and doc["requests_never_planned"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
