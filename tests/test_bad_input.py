"""Bad input claims nothing: each mistake a newcomer makes gives one clear `error:` line, exit 2, and
leaves the run folder exactly as it was (absent for a new run), for pretraining, distillation and eval.

Also: a folder left by a run that never finished a step is reclaimed; byte-level checkpoints with
exactly 256 ids distill with `data.tokenizer=raw_bytes`; out-of-vocabulary ids in pre-tokenized data
are an error naming the source."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

import torch  # the hf extra: CI installs it, these tests never skip
import transformers

import eval as eval_entry
import train as train_entry

FAST = ["model.num_layers=2", "train.steps=2", "train.warmup_steps=1", "train.batch_size=8", "train.seq_len=32", "train.eval_every=0", "train.eval_batches=1",
        "train.tensorboard=false", "train.peak_flops=1e9", "train.log_every=1", "data.max_docs=40"]
DISTILL_FAST = [o for o in FAST if not o.startswith("data.max_docs")] + ["distill.eval_every=2", "train.warmup_steps=1"]


def _snapshot(root) -> dict:
    """{relative path: sha1} of every file under root ({} when root is absent)."""
    out = {}
    if not os.path.isdir(root):
        return out
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha1(fh.read()).hexdigest()
    return out


def _fails_cleanly(capsys, entry, args, run_dir, match):
    """entry.main(args) exits 2 with one `error:` line matching `match`, and run_dir is untouched."""
    before = _snapshot(run_dir)
    existed = os.path.isdir(run_dir)
    capsys.readouterr()  # what the test printed before
    rc = entry.main(args)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert __import__("re").search(match, lines[0]), lines[0]
    assert os.path.isdir(run_dir) == existed, f"{run_dir} was created by a failing run"
    assert _snapshot(run_dir) == before, "a failing run changed the run folder"
    return lines[0]


def _qwen3(vocab: int, path, *, shard: str | None = None):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=vocab, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                      num_experts_per_tok=2, num_hidden_layers=2, initializer_range=0.1,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    if shard:
        model.save_pretrained(str(path), max_shard_size=shard)
    else:
        model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint in several shards (vocab 320 covers the byte tokenizer)."""
    return _qwen3(320, tmp_path_factory.mktemp("hf") / "qwen3", shard="20KB")


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A finished 2-step pretraining run of the tiny config (checkpoint at step 2)."""
    run = str(tmp_path_factory.mktemp("runs") / "tiny")
    assert train_entry.main(["--config", "configs/tiny.yaml", f"train.run_dir={run}", *FAST]) == 0
    return run


def _train(run_dir, *extra):
    return ["--config", "configs/tiny.yaml", f"train.run_dir={run_dir}", *FAST, *extra]


# ------------------------------------------------------------------------------------------------
# pretraining
# ------------------------------------------------------------------------------------------------

def test_missing_data_files_write_nothing_and_the_main_job_still_runs(tmp_path, capsys):
    run = str(tmp_path / "run")
    _fails_cleanly(capsys, train_entry, _train(run, "data.source=text", "data.paths=[/nonexistent/*.txt]"),
                   run, r"data.paths=.*/nonexistent/\*\.txt.*matched no files")
    assert train_entry.main(_train(run)) == 0  # the folder was not claimed: the plain run is not refused


def test_tokenizer_json_that_is_not_one(tmp_path, capsys):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"this is": "not a tokenizer"}')
    run = str(tmp_path / "run")
    _fails_cleanly(capsys, train_entry, _train(run, f"data.tokenizer={bad}"), run,
                   r"cannot read tokenizer file .*tokenizer\.json")


def test_tokenizer_larger_than_the_model(tmp_path, capsys):
    run = str(tmp_path / "run")
    _fails_cleanly(capsys, train_entry, _train(run, "model.vocab_size=256"), run,
                   r"ids up to 258 .*model.vocab_size=256.*data.tokenizer=raw_bytes")


def test_expert_axis_larger_than_the_devices(tmp_path, capsys):
    run = str(tmp_path / "run")
    _fails_cleanly(capsys, train_entry, _train(run, "mesh.expert=16", "moe.num_experts=16", "runtime.dispatch=all_to_all"),
                   run, r"mesh.*16.*8 devices")


def test_hf_folder_missing_a_shard(hf_folder, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(hf_folder, broken)
    shards = sorted(f for f in os.listdir(broken) if f.endswith(".safetensors"))
    assert len(shards) > 1
    os.remove(broken / shards[-1])
    run = str(tmp_path / "run")
    _fails_cleanly(capsys, train_entry, _train(run, f"init_from_hf={broken}"), run, shards[-1].replace(".", r"\."))


def test_unsupported_model_type(hf_folder, tmp_path, capsys):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(hf_folder, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (other / "config.json").write_text(json.dumps(cfg))
    run = str(tmp_path / "run")
    _fails_cleanly(capsys, train_entry, _train(run, f"init_from_hf={other}"), run, r"gpt2.*(supported|qwen3_moe)")


def test_truncated_checkpoint_step_is_named_and_nothing_is_written(run_folder, capsys):
    step_dir = os.path.join(run_folder, "checkpoints", "2")
    biggest = max((os.path.join(d, f) for d, _, fs in os.walk(step_dir) for f in fs), key=os.path.getsize)
    with open(biggest, "r+b") as f:
        f.truncate(os.path.getsize(biggest) // 3)
    line = _fails_cleanly(capsys, train_entry, _train(run_folder, "train.steps=4"), run_folder,
                          r"checkpoint step 2 .*cannot be restored")
    assert "train.overwrite=true" in line and "delete" in line
    # eval of the same folder says the same, and writes nothing either
    _fails_cleanly(capsys, eval_entry, ["--run", run_folder, "--mode", "loss", "--batches", "1"], run_folder,
                   r"checkpoint step 2 .*cannot be restored")


def test_folder_of_a_run_that_never_finished_a_step_is_reclaimed(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    # what a run that died while compiling leaves: the run marker, config.yaml of another config, a metrics
    # file without steps
    from farskip_jax.config import dump_config, load_config
    from farskip_jax.folders import write_marker

    write_marker(str(run), "run")
    (run / "config.yaml").write_text(dump_config(load_config("configs/tiny.yaml", ["model.num_layers=1"])))
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "event", "step": 0}) + "\n")
    assert train_entry.main(_train(str(run))) == 0
    assert "reclaimed" in capsys.readouterr().out
    # a folder with a finished step of another run is refused, with the fix named
    _fails_cleanly(capsys, train_entry, _train(str(run), "model.num_layers=1"), str(run),
                   r"belongs to another run .*model.num_layers.*train.overwrite=true")


def test_pretokenized_ids_outside_the_vocabulary(tmp_path, capsys):
    from array_record.python.array_record_module import ArrayRecordWriter

    path = str(tmp_path / "docs.arrayrecord")
    w = ArrayRecordWriter(path, "group_size:1")
    rng = np.random.RandomState(0)
    for _ in range(100):
        w.write(rng.randint(0, 400, size=80).astype("<i4").tobytes())  # the model has 320 ids
    w.close()
    run = str(tmp_path / "run")
    _fails_cleanly(capsys, train_entry, _train(run, "data.source=arrayrecord", f"data.paths=[{path}]",
                                                         "data.val_fraction=0.3"), run,
                   r"data.source='arrayrecord'.*token id \d+ .*outside the model's vocabulary \[0, 320\)")


# ------------------------------------------------------------------------------------------------
# distillation and eval
# ------------------------------------------------------------------------------------------------

def _distill(run_dir, *extra):
    return ["--config", "configs/distill_tiny.yaml", f"train.run_dir={run_dir}", *DISTILL_FAST, *extra]


def test_distill_from_a_folder_that_is_not_a_run(tmp_path, capsys):
    notrun = tmp_path / "notrun"
    notrun.mkdir()
    run = str(tmp_path / "student")
    _fails_cleanly(capsys, train_entry, _distill(run, f"distill.init_from_run={notrun}"), run,
                   r"notrun.*not a farskip_jax run folder")


def test_distill_checks_the_vocabulary_and_raw_bytes_fit_256_ids(tmp_path, capsys):
    hf = _qwen3(256, tmp_path / "byte256")
    run = str(tmp_path / "student")
    _fails_cleanly(capsys, train_entry, _distill(run, f"init_from_hf={hf}", "distill.init_from_run=null"), run,
                   r"ids up to 258 .*model.vocab_size=256.*data.tokenizer=raw_bytes")
    # the byte tokenizer without BOS/EOS fits: the run trains with a finite loss
    assert train_entry.main(_distill(run, f"init_from_hf={hf}", "distill.init_from_run=null",
                                     "data.tokenizer=raw_bytes")) == 0
    from farskip_jax.train.logger import read_metrics

    losses = [r["loss"] for r in read_metrics(run, "train")]
    assert len(losses) == 2 and all(np.isfinite(losses))
    # eval of that student with the 259-id tokenizer is refused too
    capsys.readouterr()
    _fails_cleanly(capsys, eval_entry, ["--run", run, "--mode", "loss", "data.tokenizer=byte"], run,
                   r"ids up to 258 .*model.vocab_size=256")


def test_raw_bytes_tokenizer():
    from farskip_jax.data.tokenizer import load_tokenizer

    tok = load_tokenizer("raw_bytes")
    ids = tok.encode_document("héllo")
    assert tok.vocab_size == 256 and tok.bos_id is None and tok.eos_id is None
    assert ids.tolist() == list("héllo".encode()) and tok.decode(ids) == "héllo"
