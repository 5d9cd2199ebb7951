"""The operator's tables, one module per service they read: `registry` (`hpd workers`,
`hpd pools`, `hpd watch`), `scheduler` (`hpd routes`), `kvbroker` (`hpd sessions`, `hpd
compat`); the layout helpers they share are here."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["age", "render"]


def render(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by three spaces."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = ["   ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += [
        "   ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return "\n".join(lines)


def age(ms: int, now_ms: int) -> str:
    """How long ago ``ms`` (epoch milliseconds) was, in the unit a table column reads best
    ("-" when never)."""
    if not ms:
        return "-"
    s = max(0, (now_ms - ms) // 1000)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    return f"{s // 3600}h"
