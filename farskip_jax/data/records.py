"""Validation of the records of a corpus when it is indexed, before a run writes anything.

    good, bad = index_jsonl(files, "text", skip=False)   # good: (file, byte offset, line number)
    bad = arrayrecord_bad(files, vocab, tokenizer, skip=False)   # [(global record index, what is wrong)]

A JSONL line is good when it is a JSON object whose text field is a string (blank lines are no
records). An ArrayRecord record is good when its bytes are whole int32 ids in [0, vocab); a file whose
`<file>.meta.json` (data/prepare.py) names the data's tokenizer and the file's record count is
trusted without reading its records. With skip=False the first bad record raises one DataError
naming the file, the line (record index) and what is wrong; with skip=True bad records are returned
for the caller to leave out and count (`skipped_line`).
"""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from farskip_jax.errors import DataError

_FIX = "fix or remove it, or set data.skip_bad_records=true to leave such records out (they are counted)"
_CACHE: dict = {}  # (file, size, mtime, text field) -> (good, bad) of index_jsonl: the splits share one index


def _jsonl_problem(line: bytes, field: str):
    """(text, None) of a good JSONL line, or (None, what is wrong)."""
    try:
        obj = json.loads(line.rstrip(b"\r\n"))
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg}, column {e.colno})"
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 ({e.reason} at byte {e.start})"
    if not isinstance(obj, dict):
        return None, f"a JSON {type(obj).__name__}, not an object with a {field!r} field"
    if field not in obj:
        return None, f"no field {field!r} (found {sorted(obj)[:8]}); set data.text_field to the field holding the text"
    if not isinstance(obj[field], str):
        return None, f"field {field!r} is {json.dumps(obj[field])[:40]}, not a string"
    return obj[field], None


def _index_file(path: str, field: str) -> tuple[list, list]:
    key = None
    try:
        st = os.stat(path)
        key = (path, st.st_size, st.st_mtime_ns, field)
        if key in _CACHE:
            return _CACHE[key]
        good, bad = [], []
        with open(path, "rb") as f:
            off = 0
            for n, line in enumerate(f, start=1):
                if line.strip():
                    _, why = _jsonl_problem(line, field)
                    if why is None:
                        good.append((path, off, n))
                    else:
                        bad.append((path, off, n, why))
                off += len(line)
    except OSError as e:
        raise DataError(f"cannot read JSONL file {path!r}: {e.strerror or e}") from None
    for k in [k for k in _CACHE if k[0] == path or len(_CACHE) > 256]:  # an older version of the file; bounded
        del _CACHE[k]
    _CACHE[key] = (good, bad)
    return good, bad


def index_jsonl(files: Sequence[str], field: str, *, skip: bool) -> tuple[list, list]:
    """(good records (file, byte offset, line number), bad [(split key, description)]) of `files`."""
    good, bad = [], []
    for path in files:
        g, b = _index_file(path, field)
        if b and not skip:
            p, _, n, why = b[0]
            more = f" ({len(b)} bad lines in this file)" if len(b) > 1 else ""
            raise DataError(f"{p} line {n}: {why}{more}; {_FIX}")
        good += g
        bad += [(f"{os.path.basename(p)}:{off}", f"{p} line {n}: {why}") for p, off, n, why in b]
    return good, bad


def _meta_trusted(path: str, n: int, tokenizer) -> bool:
    try:
        with open(path + ".meta.json") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return (isinstance(meta, dict) and meta.get("documents") == n and meta.get("tokenizer") == tokenizer.name
            and meta.get("vocab_size") == tokenizer.vocab_size)


def arrayrecord_bad(files: Sequence[str], vocab: int, tokenizer, *, skip: bool, model_vocab: bool = True,
                    chunk: int = 4096) -> list[tuple[int, str]]:
    """[(global record index, description)] of the bad records of `files` (module docstring)."""
    whose = "the model's" if model_vocab else "the tokenizer's"
    out, base = [], 0
    for path in files:
        reader = ArrayRecordReader(path)
        try:
            n = reader.num_records()
            if not _meta_trusted(path, n, tokenizer):
                for a in range(0, n, chunk):
                    for i, rec in enumerate(reader.read(a, min(a + chunk, n)), start=a):
                        why = None
                        if len(rec) % 4:
                            why = f"{len(rec)} bytes, not a whole number of int32 token ids"
                        else:
                            ids = np.frombuffer(rec, "<i4")
                            off = ids[(ids < 0) | (ids >= vocab)]
                            if off.size:
                                why = (f"holds token id {int(off[0])} that lies outside {whose} vocabulary [0, {vocab}): "
                                       "re-tokenize the data with the model's tokenizer (python -m "
                                       "farskip_jax.data.prepare --tokenizer ...)")
                        if why is not None:
                            if not skip:
                                raise DataError(f"data.source='arrayrecord': {path} record {i}: {why}; {_FIX}")
                            out.append((base + i, f"{path} record {i}: {why}"))
        finally:
            reader.close()
        base += n
    return out


def skipped_line(bad: list, split_of: Callable[[str], str]) -> str:
    """'data: left out N bad records ...' for bad [(split key, description)]."""
    n_train = sum(split_of(k) == "train" for k, _ in bad)
    shown = "; ".join(d for _, d in bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3 else "")
    return (f"data: left out {len(bad)} bad record(s) of data.paths ({n_train} of the train split, "
            f"{len(bad) - n_train} of val; data.skip_bad_records=true): {shown}")
