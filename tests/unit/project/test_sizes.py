"""Rooms a newcomer can read: no hand-written module over 500 lines and no function over 80,
unless it says why it must be so.

The why is a comment that starts with ``# size:`` and gives a reason: anywhere at the top
level of a long module, or on the first lines of a long function's body (or just above its
``def``). A table of test cases or a script that reads top to bottom may be long; a room
that grew by accretion should be split instead (docs/architecture.md).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MODULE_LINES = 500
FUNCTION_LINES = 80
WHY = re.compile(r"#\s*size:\s*(\S.{19,})")
"""``# size:`` and a reason of at least 20 characters (a word like "long" is no reason)."""


def hand_written() -> list[Path]:
    files: list[Path] = []
    for top in ("services", "tests", "bench", "scripts"):
        files += (ROOT / top).rglob("*.py")
    return sorted(p for p in files if not {"hetero_pd", "_native"} & set(p.parts))


def oversized(source: str) -> list[str]:
    """What is too long in ``source`` without a ``# size:`` reason: the module, and each
    function (with its line)."""
    lines = source.splitlines()
    found: list[str] = []
    if len(lines) > MODULE_LINES:
        top_level = [ln for ln in lines if not ln.startswith((" ", "\t"))]
        if not any(WHY.search(ln) for ln in top_level):
            found.append(f"module of {len(lines)} lines")
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        assert node.end_lineno is not None
        length = node.end_lineno - node.lineno + 1
        if length <= FUNCTION_LINES:
            continue
        first = min([d.lineno for d in node.decorator_list] + [node.lineno])
        # the line above the def (or its decorators) and the first lines of the body
        window = lines[max(0, first - 2) : node.body[0].lineno + 4]
        if not any(WHY.search(ln) for ln in window):
            found.append(f"{node.name} (line {node.lineno}, {length} lines)")
    return found


@pytest.mark.parametrize("path", hand_written(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_oversized_room_without_a_reason(path: Path) -> None:
    found = oversized(path.read_text())
    assert not found, f"{path.relative_to(ROOT)}: " + "; ".join(found) + " (split it, or say why)"


def _function(n: int, why: str = "") -> str:
    body = "".join(f"    x{i} = {i}\n" for i in range(n))
    return f"def f() -> None:\n{why}{body}"


def test_the_rule_catches_a_long_function_and_accepts_a_reason() -> None:
    assert oversized(_function(FUNCTION_LINES + 5)) == [f"f (line 1, {FUNCTION_LINES + 6} lines)"]
    assert oversized(_function(FUNCTION_LINES - 5)) == []
    reason = "    # size: one table of cases, read top to bottom\n"
    assert oversized(_function(FUNCTION_LINES + 5, reason)) == []
    assert oversized(_function(FUNCTION_LINES + 5, "    # size: long\n")) != []


def test_the_rule_catches_a_long_module_and_accepts_a_reason() -> None:
    long_module = "\n".join(f"X{i} = {i}" for i in range(MODULE_LINES + 10))
    assert oversized(long_module) == [f"module of {MODULE_LINES + 10} lines"]
    assert oversized("# size: the generated table of every GPU profile\n" + long_module) == []
