"""`hpd gateway-key`: make a client's API key and add it to the gateway's keys file.

    hpd gateway-key --file keys.yaml --tenant acme --tier standard --tiers standard,batch \\
        --requests-per-s 20 --max-concurrent 64 --tokens-per-min 500000

The key is printed once, on stdout; the file keeps only its SHA-256 (``keys.py``), is
created with mode 0600 and checked after the change (a file the gateway would refuse is
not written). Restart the gateway, or start it, with ``--api-keys keys.yaml``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from .keys import ApiKeys, KeyFileError, new_key_entry


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpd gateway-key",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="The key is shown once; only its hash is stored.",
    )
    p.add_argument("--file", required=True, help="the keys file (created if missing)")
    p.add_argument("--tenant", required=True, help="who the key belongs to")
    p.add_argument("--tier", required=True, help="the tier of its requests that name none")
    p.add_argument("--tiers", default="", help="comma-separated tiers it may ask for by header")
    p.add_argument("--requests-per-s", type=float, default=0.0, help="rate limit (0 = none)")
    p.add_argument("--burst", type=float, default=0.0, help="rate limit burst")
    p.add_argument("--max-concurrent", type=int, default=0, help="requests in flight (0 = none)")
    p.add_argument("--tokens-per-min", type=int, default=0, help="token budget (0 = none)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    path = Path(args.file)
    doc: dict[str, list[dict[str, object]]] = {"keys": []}
    if path.exists():
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict) or not isinstance(loaded.get("keys", []), list):
            print(f"hpd gateway-key: {path} is not a keys file", file=sys.stderr)
            return 2
        doc["keys"] = list(loaded.get("keys") or [])
    key, entry = new_key_entry(args.tenant, args.tier)
    if args.tiers:
        entry["tiers"] = sorted({args.tier, *(t.strip() for t in args.tiers.split(",") if t)})
    for name in ("requests_per_s", "burst", "max_concurrent", "tokens_per_min"):
        if getattr(args, name):
            entry[name] = getattr(args, name)
    doc["keys"].append(entry)
    try:
        ApiKeys.parse(doc, str(path))
    except KeyFileError as exc:
        print(f"hpd gateway-key: {exc}", file=sys.stderr)
        return 2
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# hetero-pd gateway API keys (hpd gateway --api-keys). Hashes only.\n")
        yaml.safe_dump(doc, f, sort_keys=False)
    tmp.replace(path)
    print(key)
    print(f"hpd gateway-key: added tenant {args.tenant!r} to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
