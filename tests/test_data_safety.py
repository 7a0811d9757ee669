"""Bad records are found when the corpus is indexed, before a run claims its folder: one error naming
the file, the line (record) and what is wrong; `data.skip_bad_records: true` leaves them out and the
run says how many (the split of every other record stays as it was)."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from farskip_jax.config import DataConfig, load_config
from farskip_jax.data.sources import build_source, split_of
from farskip_jax.data.tokenizer import ByteTokenizer
from farskip_jax.errors import DataError
from farskip_jax.train.trainer import train

TINY = ["model.num_layers=1", "train.warmup_steps=0", "model.d_model=32", "model.mlp_hidden=64", "moe.expert_hidden=32", "train.batch_size=8",
        "train.seq_len=16", "train.eval_batches=1", "train.tensorboard=false", "train.peak_flops=1e9",
        "train.log_every=1", "train.eval_every=0", "train.steps=2"]


def _corpus(path, bad: dict) -> str:
    """60 JSONL records of text; line n (1-based) replaced by bad[n]."""
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {'y' * (i % 7)}\n" * 3}) for i in range(60)]
    for n, line in bad.items():
        lines[n - 1] = line
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("line, match", [
    ('{"text": "unterminated', r"line 7: not valid JSON \(Unterminated string"),
    ('{"body": "no text field"}', r"line 7: no field 'text' \(found \['body'\]\); set data.text_field"),
    ('{"text": null}', r"line 7: field 'text' is null, not a string"),
    ('["a", "list"]', r"line 7: a JSON list, not an object")])
def test_a_bad_jsonl_record_is_named_when_the_corpus_is_indexed(tmp_path, line, match):
    path = _corpus(tmp_path / "c.jsonl", {7: line})
    cfg = DataConfig(source="jsonl", paths=(path,), val_fraction=0.2)
    with pytest.raises(DataError, match=r"c.jsonl " + match + r".*data.skip_bad_records=true"):
        build_source(cfg, "train", ByteTokenizer())


def test_the_run_refuses_bad_records_before_claiming_its_folder_or_skips_them_with_a_count(tmp_path):
    path = _corpus(tmp_path / "c.jsonl", {7: '{"text": "unterminated', 12: '{"body": "x"}'})
    run = str(tmp_path / "run")
    data = ["data.source=jsonl", f"data.paths=[{path}]", "data.val_fraction=0.2"]
    with pytest.raises(DataError, match=r"c.jsonl line 7: not valid JSON .*\(2 bad lines in this file\)"):
        train(load_config("configs/tiny.yaml", [f"train.run_dir={run}", *TINY, *data]))
    assert not os.path.exists(run)
    out = io.StringIO()
    res = train(load_config("configs/tiny.yaml", [f"train.run_dir={run}", *TINY, *data, "data.skip_bad_records=true"]),
                stream=out)
    assert res.status == "done"
    assert "data: left out 2 bad record(s) of data.paths" in out.getvalue()
    assert "c.jsonl line 7: not valid JSON" in out.getvalue() and "c.jsonl line 12: no field 'text'" in out.getvalue()
    # the records left are split as before: a bad record never moves another between train and val
    tok = ByteTokenizer()
    cfg = DataConfig(source="jsonl", paths=(path,), val_fraction=0.2, skip_bad_records=True)
    train_recs = build_source(cfg, "train", tok).records
    assert all(split_of(f"c.jsonl:{off}", 0.2) == "train" for _, off, _ in train_recs)
    assert len(train_recs) + len(build_source(cfg, "val", tok).records) == 58


def test_a_bad_arrayrecord_record_is_named_by_its_index(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    path = str(tmp_path / "docs.arrayrecord")
    w = ArrayRecordWriter(path, "group_size:1")
    rng = np.random.RandomState(0)
    for i in range(50):
        ids = rng.randint(0, 250, size=40).astype("<i4").tobytes()
        w.write(ids[:7] if i == 13 else ids)  # record 13: 7 bytes, not whole int32 ids
    w.close()
    tok = ByteTokenizer()
    cfg = DataConfig(source="arrayrecord", paths=(path,), val_fraction=0.2)
    with pytest.raises(DataError, match=r"docs.arrayrecord record 13: 7 bytes, not a whole number of int32 token ids"):
        build_source(cfg, "train", tok)
    notes = []
    src = build_source(DataConfig(source="arrayrecord", paths=(path,), val_fraction=0.2, skip_bad_records=True),
                       "train", tok, report=notes.append)
    assert 13 not in src.indices and len(notes) == 1 and "left out 1 bad record(s)" in notes[0]
    assert all(len(src[i]) == 40 for i in range(len(src)))


def test_prepare_replaces_only_its_own_output(tmp_path, capsys):
    from farskip_jax.data.prepare import main as prepare_main

    (tmp_path / "a.txt").write_text("def f(x):\n    return x\n" * 20)
    (tmp_path / "b.txt").write_text("class A:\n    pass\n" * 20)
    mine = tmp_path / "mine.bin"
    mine.write_bytes(b"my data")
    assert prepare_main(["--source", "text", "--paths", str(tmp_path / "*.txt"), "--out", str(mine)]) == 2
    assert "already exists and was not written by prepare" in capsys.readouterr().err and mine.read_bytes() == b"my data"
    out = str(tmp_path / "c.array_record")
    assert prepare_main(["--source", "text", "--paths", str(tmp_path / "*.txt"), "--out", out]) == 0
    assert prepare_main(["--source", "text", "--paths", str(tmp_path / "*.txt"), "--out", out]) == 0  # its own: replaced
