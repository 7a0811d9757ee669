"""Input pipeline: with data.prefetch the step does not wait on host data work; without it the step
waits for every batch. The wait is recorded per step (metrics.jsonl data_wait_s, the progress line).

The host work is made slow on purpose (a 5 ms sleep per packed row, 40 ms per batch of 8 rows; a
sleep holds no core, as a tokenizer releasing the GIL would not), so the no-prefetch wait has a hard
lower bound and the comparison does not depend on this machine's speed."""

from __future__ import annotations

import time

import numpy as np

from farskip_jax.config import load_config
from farskip_jax.data import pipeline
from farskip_jax.data.pipeline import make_dataset
from farskip_jax.train.logger import read_metrics
from farskip_jax.train.trainer import train

ROW_DELAY_S = 0.005
ROWS = 8


def _run(tmp_path, prefetch: int):
    run = str(tmp_path / f"prefetch{prefetch}")
    cfg = load_config("configs/tiny.yaml", [f"train.run_dir={run}", "train.steps=10", "train.warmup_steps=9", f"train.batch_size={ROWS}",
                                            "train.seq_len=128", "train.eval_every=0", "train.checkpoint_every=0",
                                            "train.eval_batches=1", "train.tensorboard=false", "train.log_every=1",
                                            "train.peak_flops=1e9", f"data.prefetch={prefetch}"])
    res = train(cfg)
    assert res.status == "done"
    recs = read_metrics(run, "train")
    return res, [r["data_wait_s"] for r in recs[2:]]  # steps 3.. (step 1 compiles, step 2 refills)


def test_prefetch_hides_host_data_work(tmp_path, monkeypatch, capsys):
    fmt = pipeline._format

    def slow_format(row):
        time.sleep(ROW_DELAY_S)
        return fmt(row)

    monkeypatch.setattr(pipeline, "_format", slow_format)
    res0, wait0 = _run(tmp_path, 0)
    res2, wait2 = _run(tmp_path, 2)
    batch_work = ROWS * ROW_DELAY_S
    assert np.median(wait0) >= 0.9 * batch_work, wait0  # every batch is built on demand
    assert np.median(wait2) < 0.25 * batch_work, wait2  # built while the previous step computes
    assert res0.losses == res2.losses  # same batches, same order
    out = capsys.readouterr().out
    assert "| data " in out and "waiting for data" in out


def test_prefetched_iterator_state_resumes_exactly():
    cfg = load_config("configs/tiny.yaml", ["data.prefetch=3"])
    kw = dict(batch_size=4, seq_len=64, seed=0)
    it = iter(make_dataset(cfg.data, "train", **kw))
    for _ in range(3):
        next(it)
    state = it.get_state()  # the state after the 3 batches handed out, not after those buffered ahead
    want = [next(it)["tokens"] for _ in range(2)]
    it.close()
    again = iter(make_dataset(cfg.data, "train", **kw))
    again.set_state(state)
    got = [next(again)["tokens"] for _ in range(2)]
    again.close()
    plain = iter(make_dataset(load_config("configs/tiny.yaml", ["data.prefetch=0"]).data, "train", **kw))
    ref = [next(plain)["tokens"] for _ in range(5)][3:]
    for w, g, r in zip(want, got, ref):
        np.testing.assert_array_equal(w, g)
        np.testing.assert_array_equal(w, r)
