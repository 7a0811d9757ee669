"""Tokenize a corpus once into ArrayRecord files (one record = one document's int32 ids, BOS..EOS).

    python -m farskip_jax.data.prepare --source text --paths 'corpus/**/*.txt' --out data/corpus.array_record
    python -m farskip_jax.data.prepare --source jsonl --paths data.jsonl --text-field text \\
        --tokenizer path/to/tokenizer.json --out data/corpus.array_record
    python -m farskip_jax.data.prepare --source stdlib --out data/stdlib.array_record

Every document of the source is written (both splits: training later splits ArrayRecord by record
index with data.val_fraction). A `<out>.meta.json` records the tokenizer so training refuses a
mismatched data.tokenizer. Train on it with `data.source=arrayrecord data.paths=[<out>]`. An existing
<out> is replaced only when prepare wrote it (its meta.json is there); anything else is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from array_record.python.array_record_module import ArrayRecordWriter

from farskip_jax.config import DataConfig
from farskip_jax.data.sources import build_source
from farskip_jax.data.tokenizer import load_tokenizer
from farskip_jax.errors import DataError, FarSkipError


class Progress:
    """A single self-rewriting progress line: docs done/total, tokens, rate, ETA."""

    def __init__(self, total: int, stream=None, every_s: float = 0.5):
        self.total, self.stream, self.every = total, stream or sys.stderr, every_s
        self.t0 = self.last = time.perf_counter()

    def update(self, done: int, tokens: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < self.every:
            return
        self.last = now
        el = max(now - self.t0, 1e-9)
        eta = (self.total - done) * el / max(done, 1)
        bar = "#" * int(30 * done / max(self.total, 1))
        self.stream.write(f"\r[{bar:<30}] {done}/{self.total} docs | {tokens:,} tokens | {tokens / el:,.0f} tok/s | "
                          f"eta {eta:,.0f}s")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def _ours(out: str) -> bool:
    """Whether file `out` was written by prepare: a regular file with the meta.json prepare writes."""
    try:
        with open(out + ".meta.json") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return os.path.isfile(out) and isinstance(meta, dict) and "tokenizer" in meta and "documents" in meta


def prepare(cfg: DataConfig, out: str, *, stream=None) -> dict:
    """Write every document of `cfg` (train and val splits) to ArrayRecord `out`. Returns the meta dict."""
    if os.path.exists(out) and not _ours(out):
        raise DataError(f"--out {out} already exists and was not written by prepare (no {out}.meta.json naming a "
                        "tokenizer); choose a new --out, or move that file away yourself")
    tok = load_tokenizer(cfg.tokenizer)
    sources = []
    for split in ("train", "val"):
        try:
            sources.append(build_source(cfg, split, tok))
        except DataError as e:
            if "no documents" not in str(e):
                raise
    total = sum(len(s) for s in sources)
    if total == 0:
        raise DataError(f"data.source={cfg.source!r} with paths {list(cfg.paths)} holds no documents")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    writer = ArrayRecordWriter(tmp, "group_size:1")
    prog = Progress(total, stream)
    done = tokens = 0
    try:
        for src in sources:
            for i in range(len(src)):
                ids = src[i].astype("<i4")
                writer.write(ids.tobytes())
                done += 1
                tokens += int(ids.shape[0])
                prog.update(done, tokens)
    finally:
        writer.close()
    prog.update(done, tokens, force=True)
    prog.close()
    os.replace(tmp, out)
    meta = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "documents": done, "tokens": tokens,
            "source": cfg.source, "paths": list(cfg.paths), "bos_id": tok.bos_id, "eos_id": tok.eos_id}
    with open(out + ".meta.json", "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="stdlib", choices=["stdlib", "text", "jsonl"])
    p.add_argument("--paths", nargs="*", default=[], help="files, folders or glob patterns")
    p.add_argument("--text-field", default="text", help="JSONL field holding the text")
    p.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json path")
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--out", required=True, help="output .array_record file")
    a = p.parse_args(argv)
    try:
        cfg = DataConfig(source=a.source, paths=tuple(a.paths), text_field=a.text_field, tokenizer=a.tokenizer,
                         max_docs=a.max_docs)
        meta = prepare(cfg, a.out)
    except FarSkipError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {meta['documents']} documents, {meta['tokens']:,} tokens to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
