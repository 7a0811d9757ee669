"""Document sources with random access: each item is one tokenized document (int32 [n], BOS..EOS).

    stdlib       the running interpreter's own standard-library `.py` files (no download); one file =
                 one document; train/val split BY FILE from a hash of the file's relative path
    text         UTF-8 text files / folders / globs in `data.paths`; one file = one document, split by
                 file. When the files are too few for that (the split by file leaves train or val
                 empty, e.g. one book), every file is split inside instead: its last `val_fraction`
                 of bytes (from the first line end at or after that point) is validation, the rest
                 training, and each part is cut at line ends into documents of about PIECE_BYTES
                 (so training shuffles them). Binary files (a NUL byte, or more than
                 BINARY_FRACTION of invalid UTF-8 / control characters in their first SNIFF_BYTES)
                 are refused, naming them
    jsonl        JSON-lines files; one line = one document (its `data.text_field`); split by record
    arrayrecord  ArrayRecord files written by `python -m farskip_jax.data.prepare` (already tokenized)

Records are validated when the corpus is indexed, before a run touches its folder (data/records.py):
every JSONL line must be a JSON object whose `data.text_field` is a string; every ArrayRecord record
whole int32 ids inside the vocabulary (a file whose `<file>.meta.json` from prepare names the same
tokenizer and record count is trusted without reading its records). A bad record is one DataError
naming the file, the line (record) and what is wrong, or with `data.skip_bad_records: true` it is
left out and counted (`report` gets one line from the training split).

The split is deterministic (SHA-1 of a stable key, not Python's salted hash; byte offsets for a split
inside files) and independent of the shuffle seed, so validation text never leaks into training.
Empty or unreadable input raises DataError.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os
import sysconfig
from typing import Optional, Sequence

import numpy as np
import grain

from farskip_jax.config import DataConfig
from farskip_jax.data.records import arrayrecord_bad, index_jsonl, skipped_line
from farskip_jax.errors import DataError


def split_of(key: str, val_fraction: float) -> str:
    """'val' for a deterministic `val_fraction` of keys, else 'train'."""
    h = int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:8], "big") / 2.0**64
    return "val" if h < val_fraction else "train"


def stdlib_files() -> list[tuple[str, str]]:
    """(relative key, absolute path) of the interpreter's stdlib .py files, sorted, site-packages excluded."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for f in filenames:
            if f.endswith(".py"):
                full = os.path.join(dirpath, f)
                out.append((os.path.relpath(full, root), full))
    out.sort()
    if not out:
        raise DataError(f"data.source='stdlib' found no .py files under {root!r}; use data.source=text with data.paths")
    return out


def expand_paths(patterns: Sequence[str], what: str) -> list[str]:
    """Files named by paths, folders (recursive) and glob patterns; sorted, de-duplicated."""
    files: list[str] = []
    for p in patterns:
        p = os.path.expanduser(p)
        if os.path.isdir(p):
            files += [os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs]
        elif any(c in p for c in "*?["):
            files += [f for f in glob.glob(p, recursive=True) if os.path.isfile(f)]
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise DataError(f"data.paths entry {p!r} does not exist ({what}); give files, folders or glob patterns")
    files = sorted(set(os.path.abspath(f) for f in files))
    if not files:
        raise DataError(f"data.paths={list(patterns)} matched no files ({what})")
    return files


PIECE_BYTES = 1 << 16  # documents of a file split inside: about this many bytes, cut at line ends
SNIFF_BYTES = 8192  # how much of each text file is inspected for binary content
BINARY_FRACTION = 0.3  # more than this share of invalid UTF-8 / control characters: not text
_TEXT_CONTROLS = set("\t\n\r\f\v\b\x1b")


def binary_reason(path: str) -> Optional[str]:
    """Why `path` is not UTF-8 text ("NUL bytes", "N% invalid UTF-8 / control characters"), or None.

    Reads the first SNIFF_BYTES only (as git and grep do)."""
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
            more = bool(f.read(1))
    except OSError as e:
        raise DataError(f"cannot read data file {path!r}: {e.strerror or e}") from None
    if b"\0" in head:
        return "NUL bytes"
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(head, final=not more)
    if not text:
        return None
    bad = sum(c == "\ufffd" or (c < " " and c not in _TEXT_CONTROLS) or c == "\x7f" for c in text)
    if bad > BINARY_FRACTION * len(text):
        return f"{100 * bad / len(text):.0f}% invalid UTF-8 / control characters"
    return None


def check_text_files(files: Sequence[str]) -> None:
    """DataError naming the files of `files` that are not text (binary_reason)."""
    bad = [(f, r) for f in files if (r := binary_reason(f)) is not None]
    if bad:
        shown = ", ".join(f"{f} ({r})" for f, r in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise DataError(f"data.source='text' reads UTF-8 text, but {len(bad)} of the {len(files)} file(s) of "
                        f"data.paths are binary: {shown}; remove them or narrow data.paths to the text files (e.g. "
                        "'corpus/**/*.txt'); already tokenized data goes through data.source=arrayrecord")


def _cut_near(f, pos: int, end: int) -> int:
    """A cut position near byte `pos` of open file `f` (< end): just after the first line end in the
    SNIFF_BYTES from `pos` on, else `pos` moved back to the start of its UTF-8 character."""
    f.seek(pos)
    block = f.read(min(SNIFF_BYTES, end - pos))
    nl = block.find(b"\n")
    if nl >= 0:
        return pos + nl + 1
    while 0 < pos and block[:1] and 0x80 <= block[0] < 0xC0:  # a UTF-8 continuation byte
        pos -= 1
        f.seek(pos)
        block = f.read(1)
    return pos


def _pieces(f, path: str, start: int, end: int) -> list[tuple[str, int, int]]:
    """(path, start, end) byte ranges of about PIECE_BYTES covering [start, end), cut at line ends."""
    out, a = [], start
    while a < end:
        b = end if end - a <= PIECE_BYTES else _cut_near(f, a + PIECE_BYTES, end)
        b = end if b <= a else b
        out.append((path, a, b))
        a = b
    return out


def split_inside(path: str, val_fraction: float) -> dict[str, list[tuple[str, int, int]]]:
    """{"train": ranges, "val": ranges} of one file split inside (module docstring): validation is its
    tail from the first line end at or after (1 - val_fraction) of its bytes."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            cut = _cut_near(f, int(size * (1.0 - val_fraction)), size) if size else 0
            return {"train": _pieces(f, path, 0, cut), "val": _pieces(f, path, cut, size)}
    except OSError as e:
        raise DataError(f"cannot read data file {path!r}: {e.strerror or e}") from None


def _read_text(path: str, start: int = 0, end: Optional[int] = None) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            raw = f.read() if end is None else f.read(end - start)
        return raw.decode("utf-8", errors="replace")
    except OSError as e:
        raise DataError(f"cannot read data file {path!r}: {e.strerror or e}") from None


class TextFileSource:
    """One document per file, or per (file, start, end) byte range of a file split inside.
    __getitem__(i) -> int32 token ids [n]."""

    def __init__(self, files: Sequence, tokenizer):
        self.items = [(f, 0, None) if isinstance(f, str) else tuple(f) for f in files]
        self.files = [f for f, _, _ in self.items]
        self.tokenizer = tokenizer

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokenizer.encode_document(_read_text(*self.items[int(i)]))

    def __repr__(self) -> str:
        ranges = sum(e is not None for _, _, e in self.items)
        if ranges:
            return f"TextFileSource({len(self.items)} pieces of {len(set(self.files))} files split inside)"
        return f"TextFileSource({len(self.items)} files)"


class JsonlSource:
    """One document per JSON line; `records` = (file, byte offset, line number) of each (records.index_jsonl)."""

    def __init__(self, records: Sequence[tuple[str, int, int]], text_field: str, tokenizer):
        self.records = list(records)
        self.text_field = text_field
        self.tokenizer = tokenizer

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> np.ndarray:
        path, off, line_no = self.records[int(i)]
        with open(path, "rb") as f:
            f.seek(off)
            line = f.readline()
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {line_no}: not valid JSON ({e.msg}); the file changed after the run "
                            "indexed it") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(self.text_field), str):
            raise DataError(f"{path} line {line_no}: no string field {self.text_field!r}; the file changed after "
                            "the run indexed it")
        return self.tokenizer.encode_document(obj[self.text_field])

    def __repr__(self) -> str:
        return f"JsonlSource({len(self.records)} records)"


class ArrayRecordSource:
    """Pre-tokenized documents (int32 little-endian bytes per record) selected by record index."""

    def __init__(self, files: Sequence[str], indices: Sequence[int]):
        self.files = list(files)
        self._src = grain.sources.ArrayRecordDataSource(self.files)
        self.indices = np.asarray(indices, np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.frombuffer(self._src[int(self.indices[int(i)])], dtype="<i4").astype(np.int32)

    def __repr__(self) -> str:
        return f"ArrayRecordSource({len(self.indices)} records in {len(self.files)} files)"


def check_arrayrecord_meta(files: Sequence[str], tokenizer) -> None:
    """The `<file>.meta.json` written by prepare must name the same tokenizer as data.tokenizer."""
    for f in files:
        meta_path = f + ".meta.json"
        if not os.path.isfile(meta_path):
            continue
        with open(meta_path) as fh:
            meta = json.load(fh)
        if meta.get("tokenizer") != tokenizer.name or meta.get("vocab_size") != tokenizer.vocab_size:
            raise DataError(f"{f} was tokenized with {meta.get('tokenizer')!r} (vocab {meta.get('vocab_size')}) but "
                            f"data.tokenizer is {tokenizer.name!r} (vocab {tokenizer.vocab_size}); re-run prepare or "
                            "set data.tokenizer to match")


def build_source(cfg: DataConfig, split: str, tokenizer, *, vocab_size: Optional[int] = None, report=None):
    """The documents of `split` ('train' | 'val') for `cfg`, as a random-access source. `vocab_size`:
    the model's (ArrayRecord ids must lie below it; default the tokenizer's). `report` gets one line
    when bad records were skipped (data.skip_bad_records), from the training split."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    vf = cfg.val_fraction
    bad: list = []  # (split key, description) of skipped records
    if cfg.source in ("stdlib", "text"):
        if cfg.source == "stdlib":
            keyed = stdlib_files()
        else:
            files = expand_paths(cfg.paths, "text")
            check_text_files(files)
            common = os.path.commonpath(files) if len(files) > 1 else os.path.dirname(files[0])
            keyed = [(os.path.relpath(f, common), f) for f in files]
        by_file = {s: [f for k, f in keyed if split_of(k, vf) == s] for s in ("train", "val")}
        if cfg.source == "text" and not (by_file["train"] and by_file["val"]):
            chosen = [r for _, f in keyed for r in split_inside(f, vf)[split]]  # too few files: split inside
        else:
            chosen = by_file[split]
        if cfg.max_docs is not None:
            chosen = chosen[: cfg.max_docs]
        src = TextFileSource(chosen, tokenizer)
    elif cfg.source == "jsonl":
        files = expand_paths(cfg.paths, "jsonl")
        good, bad = index_jsonl(files, cfg.text_field, skip=cfg.skip_bad_records)
        recs = [r for r in good if split_of(f"{os.path.basename(r[0])}:{r[1]}", vf) == split]
        if cfg.max_docs is not None:
            recs = recs[: cfg.max_docs]
        src = JsonlSource(recs, cfg.text_field, tokenizer)
    elif cfg.source == "arrayrecord":
        files = expand_paths(cfg.paths, "arrayrecord")
        check_arrayrecord_meta(files, tokenizer)
        try:
            n = len(grain.sources.ArrayRecordDataSource(files))
        except Exception as e:
            raise DataError(f"cannot open ArrayRecord files {files}: {e}") from None
        bad = arrayrecord_bad(files, vocab_size or tokenizer.vocab_size, tokenizer, skip=cfg.skip_bad_records,
                              model_vocab=vocab_size is not None)
        dropped = {i for i, _ in bad}
        idx = [i for i in range(n) if i not in dropped and split_of(f"record:{i}", vf) == split]
        bad = [(f"record:{i}", what) for i, what in bad]
        if cfg.max_docs is not None:
            idx = idx[: cfg.max_docs]
        src = ArrayRecordSource(files, idx)
    else:  # pragma: no cover - the config Literal forbids it
        raise DataError(f"unknown data.source {cfg.source!r}")
    if bad and report is not None and split == "train":
        report(skipped_line(bad, lambda key: split_of(key, vf)))
    if len(src) == 0:
        raise DataError(f"data.source={cfg.source!r} has no documents in the {split!r} split ({src!r}); "
                        "add data or change data.val_fraction"
                        + (" (the text is too short to split)" if cfg.source == "text" else ""))
    return src
