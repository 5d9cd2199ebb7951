"""YAML from callers who may be hostile: bounded before anything is built.

``yaml.safe_load`` builds its tree recursively, so a document of a few thousand nested
brackets raises ``RecursionError`` deep in the composer after blocking its thread for about a
second, and aliases let a small document stand for a huge one. :func:`load_bounded` first
walks the document's event stream (PyYAML's parser is a state machine: its memory and time
are without recursion) and refuses it, naming the limit, when it nests deeper than
``max_depth``, has more than ``max_nodes`` nodes or more than ``max_aliases`` aliases; only
then does it build the tree. Before that, a character scan bounds the nesting PyYAML's
scanner is slow on (its cost grows with the square of flow-bracket nesting: 5,000 ``[``
take about half a second before the first event), so a hostile document is refused in
time linear in its length.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["MAX_ALIASES", "MAX_DEPTH", "MAX_NODES", "YamlLimitError", "load_bounded"]

# a policy profile nests about six levels and holds a few hundred nodes
MAX_DEPTH = 64
MAX_NODES = 100_000
MAX_ALIASES = 100


class YamlLimitError(ValueError):
    """The document exceeds a stated limit; the message names it."""


def load_bounded(
    text: str,
    max_depth: int = MAX_DEPTH,
    max_nodes: int = MAX_NODES,
    max_aliases: int = MAX_ALIASES,
) -> Any:
    """``yaml.safe_load(text)`` once the document is known to be within the limits.
    Raises :class:`YamlLimitError` (over a limit) or ``yaml.YAMLError`` (not YAML)."""
    _prescan(text, max_depth)
    depth = nodes = aliases = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            nodes += 1
            if depth > max_depth:
                line = event.start_mark.line + 1 if event.start_mark else 0
                raise YamlLimitError(
                    f"nested deeper than {max_depth} levels (line {line}); "
                    f"limit: {max_depth} levels"
                )
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
        elif isinstance(event, yaml.ScalarEvent):
            nodes += 1
        elif isinstance(event, yaml.AliasEvent):
            aliases += 1
            nodes += 1
            if aliases > max_aliases:
                raise YamlLimitError(f"more than {max_aliases} aliases; limit: {max_aliases}")
        if nodes > max_nodes:
            raise YamlLimitError(f"more than {max_nodes} nodes; limit: {max_nodes}")
    return yaml.safe_load(text)


def _prescan(text: str, max_depth: int) -> None:
    """Refuse flow nesting (``[``, ``{`` outside quotes and comments) deeper than
    ``max_depth``, and block nesting that could be: an indent over ``2 x max_depth``
    columns, or more than ``max_depth`` chained ``- `` on one line. Linear in the text."""
    flow = 0
    quote = ""
    at_line_start = True
    indent = dashes = 0
    prev = "\n"
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if quote:
            if ch == "\\" and quote == '"':
                i += 2
                continue
            if ch == quote:
                quote = ""
        elif ch == "\n":
            at_line_start, indent, dashes = True, 0, 0
        elif at_line_start and ch == " ":
            indent += 1
            if indent > 2 * max_depth:
                raise YamlLimitError(f"indented deeper than {2 * max_depth} columns")
        elif at_line_start and ch == "-" and text[i + 1 : i + 2] in (" ", "\n", ""):
            dashes += 1
            if dashes > max_depth:
                raise YamlLimitError(f"nested deeper than {max_depth} levels (chained '- ')")
            i += 1  # the space after the dash: still the start of the line's content
            indent += 1
        elif ch == "#" and prev in " \t\n":
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        else:
            at_line_start = False
            if ch in "'\"" and prev in " \t\n:,[{-":  # a quoted scalar starts here
                quote = ch
            elif ch in "[{":
                flow += 1
                if flow > max_depth:
                    raise YamlLimitError(
                        f"nested deeper than {max_depth} levels ([ and {{); limit: {max_depth}"
                    )
            elif ch in "]}":
                flow = max(0, flow - 1)
        prev = ch
        i += 1
