"""Document sources with random access: each item is one tokenized document (int32 [n], BOS..EOS).

    stdlib       the running interpreter's own standard-library `.py` files (no download); one file =
                 one document; train/val split BY FILE from a hash of the file's relative path
    text         plain text files / folders / globs in `data.paths`; one file = one document, split by file
    jsonl        JSON-lines files; one line = one document (its `data.text_field`); split by record
    arrayrecord  ArrayRecord files written by `python -m farskip_jax.data.prepare` (already tokenized)

The split is deterministic (SHA-1 of a stable key, not Python's salted hash) and independent of the
shuffle seed, so validation text never leaks into training. Empty or unreadable input raises DataError.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from typing import Sequence

import numpy as np

from farskip_jax.config import DataConfig
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


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    except OSError as e:
        raise DataError(f"cannot read data file {path!r}: {e.strerror or e}") from None


class TextFileSource:
    """One document per file. __getitem__(i) -> int32 token ids [n]."""

    def __init__(self, files: Sequence[str], tokenizer):
        self.files = list(files)
        self.tokenizer = tokenizer

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokenizer.encode_document(_read_text(self.files[int(i)]))

    def __repr__(self) -> str:
        return f"TextFileSource({len(self.files)} files)"


class JsonlSource:
    """One document per JSON line; an index of (file, byte offset) is built once at construction."""

    def __init__(self, records: Sequence[tuple[str, int]], text_field: str, tokenizer):
        self.records = list(records)
        self.text_field = text_field
        self.tokenizer = tokenizer

    @staticmethod
    def index(files: Sequence[str]) -> list[tuple[str, int]]:
        recs = []
        for path in files:
            try:
                with open(path, "rb") as f:
                    off = 0
                    for line in f:
                        if line.strip():
                            recs.append((path, off))
                        off += len(line)
            except OSError as e:
                raise DataError(f"cannot read JSONL file {path!r}: {e.strerror or e}") from None
        return recs

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> np.ndarray:
        path, off = self.records[int(i)]
        with open(path, "rb") as f:
            f.seek(off)
            line = f.readline()
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} at byte {off}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or self.text_field not in obj:
            keys = list(obj) if isinstance(obj, dict) else type(obj).__name__
            raise DataError(f"{path} at byte {off}: no field {self.text_field!r} (found {keys}); set data.text_field")
        return self.tokenizer.encode_document(str(obj[self.text_field]))

    def __repr__(self) -> str:
        return f"JsonlSource({len(self.records)} records)"


class ArrayRecordSource:
    """Pre-tokenized documents (int32 little-endian bytes per record) selected by record index."""

    def __init__(self, files: Sequence[str], indices: Sequence[int]):
        import grain

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


def build_source(cfg: DataConfig, split: str, tokenizer):
    """The documents of `split` ('train' | 'val') for `cfg`, as a random-access source."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    vf = cfg.val_fraction
    if cfg.source in ("stdlib", "text"):
        if cfg.source == "stdlib":
            keyed = stdlib_files()
        else:
            files = expand_paths(cfg.paths, "text")
            common = os.path.commonpath(files) if len(files) > 1 else os.path.dirname(files[0])
            keyed = [(os.path.relpath(f, common), f) for f in files]
        chosen = [f for k, f in keyed if split_of(k, vf) == split]
        if cfg.max_docs is not None:
            chosen = chosen[: cfg.max_docs]
        src = TextFileSource(chosen, tokenizer)
    elif cfg.source == "jsonl":
        files = expand_paths(cfg.paths, "jsonl")
        recs = [r for r in JsonlSource.index(files) if split_of(f"{os.path.basename(r[0])}:{r[1]}", vf) == split]
        if cfg.max_docs is not None:
            recs = recs[: cfg.max_docs]
        src = JsonlSource(recs, cfg.text_field, tokenizer)
    elif cfg.source == "arrayrecord":
        files = expand_paths(cfg.paths, "arrayrecord")
        check_arrayrecord_meta(files, tokenizer)
        try:
            import grain

            n = len(grain.sources.ArrayRecordDataSource(files))
        except Exception as e:
            raise DataError(f"cannot open ArrayRecord files {files}: {e}") from None
        idx = [i for i in range(n) if split_of(f"record:{i}", vf) == split]
        if cfg.max_docs is not None:
            idx = idx[: cfg.max_docs]
        src = ArrayRecordSource(files, idx)
    else:  # pragma: no cover - the config Literal forbids it
        raise DataError(f"unknown data.source {cfg.source!r}")
    if len(src) == 0:
        raise DataError(f"data.source={cfg.source!r} has no documents in the {split!r} split ({src!r}); "
                        "add data or change data.val_fraction")
    return src
