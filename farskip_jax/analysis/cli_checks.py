"""Argument checks the analysis tools share, run before anything compiles: lists of numbers, output
folders and files, JSON caches. Each raises one ConfigError naming the flag, the value and the fix.

    bws = number_list("25,50", "--sweep-bw", "all-to-all bandwidths in GB/s per GPU", low=0.0)
    check_out_folder("runs/overlap")          # it, or a folder above it, must not be a file
    check_out_file("plan.json", "--out", "the plan")
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

from farskip_jax.errors import ConfigError


def int_list(text: str, flag: str, low: int = 1) -> list[int]:
    """Comma-separated integers >= low."""
    out = []
    for x in text.split(","):
        if not x.strip():
            continue
        try:
            v = int(x)
        except ValueError:
            raise ConfigError(f"{flag} {text!r}: {x.strip()!r} is not an integer; give comma-separated integers, "
                              "e.g. 1,2") from None
        if v < low:
            raise ConfigError(f"{flag} {text!r}: {v} must be >= {low}")
        out.append(v)
    return out


def number_list(text: Optional[str], flag: str, what: str, low: float = 0.0, high: float = math.inf,
                example: str = "25,50,100") -> list[float]:
    """Comma-separated finite numbers in (low, high]; [] for None; `what` names them in messages."""
    out = []
    for x in (text or "").split(","):
        if not x.strip():
            continue
        try:
            v = float(x)
        except ValueError:
            raise ConfigError(f"{flag}: {x.strip()!r} is not a number; give {what}, e.g. {example}") from None
        if not low < v <= high or not math.isfinite(v):
            bounds = f"({low:g}, {high:g}]" if math.isfinite(high) else f"> {low:g}"
            raise ConfigError(f"{flag}: {v:g} is outside {bounds}; give {what}, e.g. {example}")
        out.append(v)
    if text is not None and not out:
        raise ConfigError(f"{flag} names nothing; give {what}, e.g. {example}")
    return out


def _nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def check_out_folder(out: Optional[str], flag: str = "--out", what: str = "report.json and the timeline pictures") -> None:
    """ConfigError unless `out` is (or can be made) a folder this process can write: it, or the nearest
    folder above it that exists, must be a writable folder."""
    if not out:
        return
    p = _nearest_existing(out)
    if not os.path.isdir(p):
        raise ConfigError(f"{flag} {out}: {p} is a file, not a folder; name a folder ({what} go inside it)")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {out}: no write permission in {p}; name a folder you can write")


def check_out_file(path: Optional[str], flag: str, what: str) -> None:
    """ConfigError when `path` cannot be written as a file: it is a folder, or a folder above it is a file."""
    if not path:
        return
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a folder; name the JSON file to write {what} to, e.g. "
                          f"{os.path.join(path, 'plan.json')}")
    parent = _nearest_existing(os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {path}: {parent} is a file, not a folder; name a path in a folder")


def read_json_object(path: str, flag: str, what: str) -> dict:
    """The JSON object in `path` (a cache this tool wrote); ConfigError naming the file otherwise."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{flag} {path} is not {what} (a JSON object this tool wrote): "
                          f"{getattr(e, 'msg', None) or e}; name another file (a new one is created)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{flag} {path} holds a JSON {type(data).__name__}, not {what}; name another file")
    return data
