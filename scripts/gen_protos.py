"""Regenerates the Python code for protos/ into services/common/hetero_pd/.

The generated modules are committed; run this after editing a .proto file:

    .venv/bin/python scripts/gen_protos.py           # write
    .venv/bin/python scripts/gen_protos.py --check   # exit 1 if the tree is out of date
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_ROOT = ROOT / "services" / "common"
PACKAGE = Path("hetero_pd") / "v1"


def generate(out: Path) -> None:
    """Runs protoc over every .proto file into out/hetero_pd/v1."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE).glob("*.proto"))
    if not protos:
        raise SystemExit("no .proto files under protos/hetero_pd/v1")
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    (out / "hetero_pd" / "__init__.py").write_text('"""Generated hetero-pd contracts."""\n')
    (out / PACKAGE / "__init__.py").write_text(
        '"""Generated from protos/hetero_pd/v1; do not edit."""\n'
    )


def differences(a: Path, b: Path) -> list[str]:
    """Relative paths that differ between two generated trees."""
    names = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    names |= {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    names = {n for n in names if "__pycache__" not in n.parts}
    return sorted(
        str(n)
        for n in names
        if not (
            (a / n).is_file() and (b / n).is_file() and filecmp.cmp(a / n, b / n, shallow=False)
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        committed = OUT_ROOT / "hetero_pd"
        if args.check:
            diff = differences(fresh / "hetero_pd", committed)
            for name in diff:
                print(f"out of date: services/common/hetero_pd/{name}")
            return 1 if diff else 0
        if committed.exists():
            shutil.rmtree(committed)
        shutil.copytree(fresh / "hetero_pd", committed)
    print("generated services/common/hetero_pd")
    return 0


if __name__ == "__main__":
    sys.exit(main())
