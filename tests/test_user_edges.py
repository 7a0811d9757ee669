"""What a new user runs into, through the entry points as they type them (subprocesses of train.py,
eval.py and `python -m farskip_jax.convert`): each mistake is one `error:` line naming the culprit
and the fix, exit 2, and nothing written or overwritten; each thing that should work does.

Covered: an HF config.json that is not JSON (import, init_from_hf, eval --hf); impossible
converted-layer sets; a one-file text corpus (split inside the file); binary files given as text;
the documented notebook runner.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from cli_helpers import REPO, cli, qwen3_hf, refused, train_args


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
    from farskip_jax.config import load_config
    from farskip_jax.connectivity.layer_sets import parse_layer_spec
    from farskip_jax.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        load_config(None, ["model.num_layers=4", "farskip.preset=farskip", f"farskip.layers={spec}"])
    if spec.startswith(("last", "range")):
        with pytest.raises(ConfigError, match="does not fit"):  # no silent clamping where sets are parsed
            parse_layer_spec(spec, 4)


def test_empty_layer_set_is_the_standard_model_on_purpose():
    from farskip_jax.config import FarSkipConfig, load_config
    from farskip_jax.connectivity.layer_sets import parse_layer_spec

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


# ------------------------------------------------------------------------------------------------
# a finished run: eval, resume and export print no orbax warnings; eval --mode loss = training's val loss;
# generation past the model's positions is refused
# ------------------------------------------------------------------------------------------------

ORBAX_WARNING = "could not be restored"


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A 2-step pretraining run of the tiny config (qwen2_moe-shaped: gated shared expert), 2 val batches."""
    run = str(tmp_path_factory.mktemp("runs") / "tiny")
    r = cli(*train_args(run, "moe.shared_gate=true", "train.eval_batches=2", "train.eval_every=2",
                        "model.max_seq_len=64"))
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def test_eval_loss_is_the_val_loss_training_printed_without_orbax_warnings(run_folder):
    r = cli("eval.py", "--run", run_folder, "--mode", "loss")
    assert r.returncode == 0, r.stderr[-3000:]
    assert ORBAX_WARNING not in r.stderr + r.stdout
    res = json.loads(r.stdout)
    logged = [json.loads(ln) for ln in open(os.path.join(run_folder, "metrics.jsonl")) if '"val_loss"' in ln][-1]
    assert res["val_batches"] == 2 and "train.eval_batches" in res["val_batches_from"]
    np.testing.assert_allclose(res["val_loss"], logged["val_loss"], rtol=1e-6)
    # a fresh process reads the step's metadata too: the per-layer checkpoint restores into stacked layers
    r = cli("eval.py", "--run", run_folder, "--mode", "loss", "runtime.scan_layers=true")
    assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_allclose(json.loads(r.stdout)["val_loss"], logged["val_loss"], rtol=1e-5)


def test_generation_past_the_models_positions_is_refused(run_folder):
    refused(["eval.py", "--run", run_folder, "--mode", "generate", "--prompt", "def main(", "eval.max_new_tokens=60"],
            r"eval\.max_new_tokens=60 after a 10-token prompt needs 70 positions, but the model has "
            r"model\.max_seq_len=64: set eval\.max_new_tokens <= 54", run_folder)


def test_export_refuses_a_family_that_cannot_hold_the_model(run_folder, tmp_path):
    """A model with a shared expert and no q/k norm as qwen3_moe: transformers would drop the shared expert
    and draw q_norm / k_norm at random. Refused before any weights are read, naming who can hold it."""
    out = str(tmp_path / "hf")
    refused(["-m", "farskip_jax.convert", "export", run_folder, out, "--family", "qwen3_moe"],
            r"HF family 'qwen3_moe' cannot hold this model .*q/k norm False -> True; shared experts 1 -> 0\); "
            r"families that can: qwen2_moe", out, run_folder)


def test_resume_and_export_print_no_orbax_warnings(run_folder, tmp_path):
    """Resumes the module's run (last of its users: it moves the run to step 3)."""
    run = run_folder
    r = cli(*train_args(run, "moe.shared_gate=true", "train.eval_batches=2", "train.eval_every=2",
                        "model.max_seq_len=64", "train.steps=3"))
    assert r.returncode == 0 and "resum" in r.stdout, r.stderr[-3000:]
    assert ORBAX_WARNING not in r.stderr + r.stdout
    out = tmp_path / "hf"
    r = cli("-m", "farskip_jax.convert", "export", run, str(out), "--family", "qwen2_moe")
    assert r.returncode == 0, r.stderr[-3000:]
    assert ORBAX_WARNING not in r.stderr + r.stdout
    info = json.loads((out / "farskip_export.json").read_text())
    assert info["run"] == run and info["checkpoint"] == "latest" and info["step"] == 3  # a pretraining run: latest


# ------------------------------------------------------------------------------------------------
# an import folder (python -m farskip_jax.convert import) is named as such, and eval --hf reads it
# ------------------------------------------------------------------------------------------------

def test_an_import_folder_is_named_and_eval_reads_it(tmp_path):
    hf = qwen3_hf(tmp_path / "hf")
    imp = str(tmp_path / "imported")
    r = cli("-m", "farskip_jax.convert", "import", hf, imp)
    assert r.returncode == 0, r.stderr[-3000:]
    what = re.escape(imp) + r" is an import folder written by `python -m farskip_jax.convert import` .*imported from "
    refused(["eval.py", "--run", imp, "--mode", "loss"], what + r".*not a run folder .*eval\.py --hf", imp)
    run = str(tmp_path / "run")
    refused(["train.py", "--config", "configs/distill_hf_small.yaml", f"train.run_dir={run}",
             f"distill.init_from_run={imp}", "distill.export_hf=null"], what + r".*not a run folder", imp, run)
    refused(train_args(run, f"init_from_hf={imp}"), what + r".*not an HF folder: pass the HF folder it was imported",
            imp, run)
    # as train.run_dir it is never reclaimed (wiped) as a folder left by a run that never ran a step
    refused(train_args(imp), r"train.run_dir: " + what + r".*not a run folder; choose another train.run_dir", imp)
    # eval --hf reads it as it is: the same val loss as the HF folder it came from
    a, b = (cli("eval.py", "--hf", p, "--mode", "loss", "--batches", "1", "train.seq_len=32", "train.batch_size=4")
            for p in (imp, hf))
    assert a.returncode == 0 and b.returncode == 0, a.stderr[-2000:] + b.stderr[-2000:]
    np.testing.assert_allclose(json.loads(a.stdout)["val_loss"], json.loads(b.stdout)["val_loss"], rtol=1e-6)
