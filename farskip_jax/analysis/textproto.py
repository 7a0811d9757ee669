"""A small reader for protobuf text format (what XLA writes for schedules and target configs).

    tree = parse_textproto(text)      # {"field": [value_or_subtree, ...], ...}

Every field maps to the list of its occurrences (repeated or not); sub-messages are dicts of the
same form; scalars are int, float, bool-as-identifier (str) or str. Only what XLA's dumps use is
supported: `key: value`, `key {`, `}`, comments and quoted strings with C escapes.
"""

from __future__ import annotations

import re
from typing import Any

_NUM = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _scalar(v: str) -> Any:
    if v.startswith('"') and v.endswith('"') and len(v) >= 2:
        return bytes(v[1:-1], "utf-8").decode("unicode_escape")
    if _NUM.match(v):
        return int(v) if re.match(r"^[-+]?\d+$", v) else float(v)
    if v in ("inf", "-inf", "nan"):
        return float(v)
    return v  # enum names, true/false


def parse_textproto(text: str) -> dict[str, list]:
    """Parse protobuf text format into nested dicts of lists (see module docstring)."""
    root: dict[str, list] = {}
    stack = [root]
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line == "}":
            if len(stack) == 1:
                raise ValueError(f"line {lineno}: unbalanced '}}'")
            stack.pop()
            continue
        if line.endswith("{"):
            sub: dict[str, list] = {}
            stack[-1].setdefault(line[:-1].rstrip(" :"), []).append(sub)
            stack.append(sub)
            continue
        key, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"line {lineno}: cannot parse {line!r}")
        stack[-1].setdefault(key.strip(), []).append(_scalar(value.strip()))
    if len(stack) != 1:
        raise ValueError("unbalanced braces: text ended inside a message")
    return root


def first(msg: dict, key: str, default: Any = None) -> Any:
    """The first value of `key` in a parsed message, or `default`."""
    vals = msg.get(key)
    return vals[0] if vals else default
