"""What a new user runs into, through the entry points as they type them (subprocesses of train.py,
eval.py and `python -m farskip_jax.convert`): each mistake is one `error:` line naming the culprit
and the fix, exit 2, and nothing written or overwritten; each thing that should work does.

Covered: an HF config.json that is not JSON (import, init_from_hf, eval --hf); impossible
converted-layer sets; a one-file text corpus (split inside the file); binary files given as text;
the documented notebook runner.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["model.num_layers=2", "train.steps=2", "train.batch_size=8", "train.seq_len=32", "train.eval_every=0",
        "train.eval_batches=1", "train.tensorboard=false", "train.peak_flops=1e9", "train.log_every=1"]


def cli(*args, timeout=300) -> subprocess.CompletedProcess:
    """`python *args` from the repository root, this tree first on the path."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def snapshot(*roots) -> dict:
    """{path: sha1} of every file under each root (absent roots give nothing)."""
    out = {}
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for f in files:
                p = os.path.join(dirpath, f)
                with open(p, "rb") as fh:
                    out[p] = hashlib.sha1(fh.read()).hexdigest()
    return out


def refused(args, match, *watched, timeout=300) -> str:
    """The CLI exits 2 with one `error:` line matching `match`; `watched` folders are unchanged (absent
    ones stay absent). Returns the line."""
    before = snapshot(*watched)
    existed = [os.path.exists(w) for w in watched]
    r = cli(*args, timeout=timeout)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-4000:]
    assert re.search(match, lines[0]), lines[0]
    assert [os.path.exists(w) for w in watched] == existed, "a failing command created a folder"
    assert snapshot(*watched) == before, "a failing command wrote or changed files"
    return lines[0]


def train_args(run, *extra):
    return ["train.py", "--config", "configs/tiny.yaml", f"train.run_dir={run}", *FAST, *extra]


# ------------------------------------------------------------------------------------------------
# an HF config.json that is not JSON: one error naming the file and the position, in every entry point
# ------------------------------------------------------------------------------------------------

def test_hf_config_json_that_is_not_json(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "qwen3_moe",\n "hidden_size": 32,,\n}')
    (hf / "model.safetensors").write_bytes(b"")
    want = re.escape(str(hf / "config.json")) + r" is not valid JSON: .* line 2 column \d+"
    out, run = tmp_path / "imported", tmp_path / "run"
    refused(["-m", "farskip_jax.convert", "import", str(hf), str(out)], want, str(out), str(hf))
    refused(train_args(run, f"init_from_hf={hf}"), want, str(run), str(hf))
    refused(["eval.py", "--hf", str(hf), "--mode", "loss"], want, str(hf))


# ------------------------------------------------------------------------------------------------
# converted-layer sets: nothing clamped, an empty set under a converting preset refused
# ------------------------------------------------------------------------------------------------

def test_impossible_converted_layers_are_refused_before_anything_runs(tmp_path):
    run = tmp_path / "run"
    refused(train_args(run, "model.num_layers=4", "farskip.preset=farskip", "farskip.layers=range:5:2"),
            r"farskip\.layers='range:5:2' .*4 layers.*valid forms: 'all', 'first:N'", str(run))


@pytest.mark.parametrize("spec,needle", [
    ("last:9", r"farskip\.layers='last:9' does not fit the model's 4 layers.*N=9.*valid forms"),
    ("range:2:9", r"farskip\.layers='range:2:9' does not fit the model's 4 layers.*valid forms"),
    ("first:0", r"farskip\.layers='first:0' converts none of the 4 layers.*farskip\.preset: standard"),
    ("none", r"farskip\.layers='none' converts none of the 4 layers"),
    ("[]", r"farskip\.layers=\[\] converts none of the 4 layers"),
    ("[1, 4]", r"farskip\.layers lists layers outside \[0, 4\): \[4\]"),
])
def test_layer_sets_out_of_range_or_empty(spec, needle):
    from farskip_jax.config import load_config, parse_layer_spec
    from farskip_jax.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        load_config(None, ["model.num_layers=4", "farskip.preset=farskip", f"farskip.layers={spec}"])
    if spec.startswith(("last", "range")):
        with pytest.raises(ConfigError, match="does not fit"):  # no silent clamping where sets are parsed
            parse_layer_spec(spec, 4)


def test_empty_layer_set_is_the_standard_model_on_purpose():
    from farskip_jax.config import FarSkipConfig, load_config, parse_layer_spec

    for spec in ("none", "[]", "first:0"):
        cfg = load_config(None, ["model.num_layers=4", "farskip.preset=standard", f"farskip.layers={spec}"])
        assert cfg.farskip.converted_layers(4) == frozenset()
    assert parse_layer_spec("last:4", 4) == {0, 1, 2, 3} and parse_layer_spec("range:1:3", 4) == {1, 2}
    # a sweep's zero point stays an exact empty set of a bare FarSkipConfig (eval/sweep.py)
    assert FarSkipConfig(preset="farskip", layers="first:0").converted_layers(4) == frozenset()


# ------------------------------------------------------------------------------------------------
# text data: one file is a corpus; binary files are not text
# ------------------------------------------------------------------------------------------------

def _book(path, lines=3000):
    rng = np.random.RandomState(0)
    words = ["the", "river", "ran", "past", "a", "mill", "where", "old", "Jón", "kept", "his", "books", "and"]
    with open(path, "w") as f:
        for i in range(lines):
            f.write(" ".join(rng.choice(words, size=8)) + f" ({i}).\n")
    return str(path)


def test_one_text_file_trains(tmp_path):
    book = _book(tmp_path / "book.txt")
    run = tmp_path / "run"
    r = cli(*train_args(run, "data.source=text", f"data.paths=[{book}]", "train.eval_every=2"))
    assert r.returncode == 0, r.stderr[-3000:]
    evals = [json.loads(ln) for ln in open(run / "metrics.jsonl") if '"val_loss"' in ln]
    assert evals and np.isfinite(evals[-1]["val_loss"])


@pytest.mark.parametrize("val_fraction", [0.02, 0.3])
def test_split_inside_one_file_covers_it_once_and_never_leaks(tmp_path, val_fraction):
    from farskip_jax.config import DataConfig
    from farskip_jax.data.sources import PIECE_BYTES, build_source
    from farskip_jax.data.tokenizer import ByteTokenizer

    book = _book(tmp_path / "book.txt", lines=8000)
    text = open(book, encoding="utf-8").read()
    raw = open(book, "rb").read()
    tok = ByteTokenizer()
    cfg = DataConfig(source="text", paths=(book,), val_fraction=val_fraction)
    tr, va = build_source(cfg, "train", tok), build_source(cfg, "val", tok)
    train_txt = "".join(tok.decode(tr[i]) for i in range(len(tr)))
    val_txt = "".join(tok.decode(va[i]) for i in range(len(va)))
    assert train_txt + val_txt == text  # every byte once, in order: the train head, the val tail
    cut = len(train_txt.encode())
    assert raw[cut - 1:cut] == b"\n" and cut >= int(len(raw) * (1 - val_fraction))  # the first line end after
    assert len(tr) > 1 and all(e - s <= PIECE_BYTES + 8192 for _, s, e in tr.items)  # shuffled in pieces
    assert build_source(cfg, "val", tok).items == va.items  # deterministic


def test_many_files_still_split_by_file(tmp_path):
    from farskip_jax.config import DataConfig
    from farskip_jax.data.sources import build_source
    from farskip_jax.data.tokenizer import ByteTokenizer

    for i in range(60):
        (tmp_path / f"d{i}.txt").write_text(f"document {i}\n" * 5)
    cfg = DataConfig(source="text", paths=(str(tmp_path),), val_fraction=0.2)
    tr, va = build_source(cfg, "train", ByteTokenizer()), build_source(cfg, "val", ByteTokenizer())
    assert len(tr) + len(va) == 60 and set(tr.files).isdisjoint(va.files)


def test_binary_files_are_refused_naming_them(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.RandomState(0)
    for i in range(3):
        (data / f"shard{i}.bin").write_bytes(rng.bytes(4096))
    (data / "tiny.bin").write_bytes(bytes([0x8F, 0x9A, 0xC3, 0x01, 0xFF, 0x02, 0x80, 0x41]))  # no NUL, not text
    (data / "readme.txt").write_text("a text file next to them\n" * 50)
    run = tmp_path / "run"
    line = refused(train_args(run, "data.source=text", f"data.paths=[{data}]"),
                   r"data\.source='text' reads UTF-8 text, but 4 of the 5 file\(s\) of data\.paths are binary: .*"
                   r"shard0\.bin \(NUL bytes\).*tiny\.bin \(\d+% invalid UTF-8", str(run), str(data))
    assert "readme.txt" not in line and "data.source=arrayrecord" in line


def test_latin1_and_utf8_text_are_text(tmp_path):
    from farskip_jax.data.sources import binary_reason

    (tmp_path / "fr.txt").write_bytes(("Ça a été très élégant, à côté du château.\n" * 100).encode("latin-1"))
    (tmp_path / "ja.txt").write_text("日本語のテキストです。\n" * 500, encoding="utf-8")
    (tmp_path / "empty.txt").write_bytes(b"")
    assert [binary_reason(str(tmp_path / f)) for f in ("fr.txt", "ja.txt", "empty.txt")] == [None, None, None]


# ------------------------------------------------------------------------------------------------
# docs/notebooks.md: the documented rerun command works with what the extras install
# ------------------------------------------------------------------------------------------------

def test_documented_notebook_command_runs(tmp_path):
    import nbformat

    doc = open(os.path.join(REPO, "docs", "notebooks.md")).read()
    cmd = re.search(r"^\s+(jupyter \S+ .*?notebooks/ablation_partial_vs_outdated\.ipynb)\s*$", doc, re.M)
    assert cmd, "docs/notebooks.md has no rerun command for the ablation notebook"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "probe.ipynb"
    nbformat.write(nb, str(path))
    argv = cmd.group(1).replace("notebooks/ablation_partial_vs_outdated.ipynb", str(path)).split()
    exe = os.path.join(os.path.dirname(sys.executable), "jupyter")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    r = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    out = nbformat.read(str(path), as_version=4).cells[0].outputs
    assert out and out[0].get("text", "").strip() == "42"
