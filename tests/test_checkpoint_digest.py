"""Checkpoints are verified on every read and a run always keeps its final checkpoint.

- keep_checkpoints < 1 and checkpoint_every < 0 are refused when the config loads (one `error:` line
  from train.py, nothing written); a run keeping fewer checkpoints than it saves ends with its final one;
- 4 KiB scribbled into a data file of the newest step: orbax alone restores incompressible arrays
  (weights) without a word and with other values (its zstd raw blocks carry no checksum; it does
  notice some scribbles into compressed blocks); resume and eval (export reads through the same
  loader) refuse it in one error naming the step, the newest earlier good step and how to use it;
  `train.resume_step` resumes from that step, drops the damaged one and trains to the same loss as
  the run that never saw the damage;
- a folder written before digests existed is read, and says it was not verified.
"""

from __future__ import annotations

import io
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from cli_helpers import snapshot

import train as train_entry
from farskip_jax.config import load_config
from farskip_jax.errors import CheckpointError, ConfigError
from farskip_jax.loading.checkpoint import Checkpointer
from farskip_jax.train.logger import read_metrics
from farskip_jax.train.trainer import train

TINY = ["model.num_layers=1", "train.warmup_steps=0", "model.d_model=32", "model.mlp_hidden=64", "moe.expert_hidden=32", "train.batch_size=8",
        "train.seq_len=16", "train.eval_batches=1", "train.tensorboard=false", "train.peak_flops=1e9",
        "train.log_every=1", "train.eval_every=0", "data.max_docs=40"]


def _cfg(run, *extra):
    return load_config("configs/tiny.yaml", [f"train.run_dir={run}", *TINY, *extra])


@pytest.mark.parametrize("bad, match", [("train.keep_checkpoints=0", r"train\.keep_checkpoints must be >= 1 .*keep at least the run's final one.*got 0"),
                                        ("train.keep_checkpoints=-1", r"train\.keep_checkpoints must be >= 1 .*got -1"),
                                        ("train.checkpoint_every=-1", r"train\.checkpoint_every must be >= 0 \(the steps between checkpoints.*got -1")])
def test_checkpoint_settings_that_lose_the_model_are_refused_before_anything_is_written(tmp_path, capsys, bad, match):
    run = str(tmp_path / "run")
    with pytest.raises(ConfigError, match=match):
        _cfg(run, bad)
    assert train_entry.main(["--config", "configs/tiny.yaml", f"train.run_dir={run}", *TINY, bad]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and __import__("re").search(match, err[0])
    assert not os.path.exists(run)


def _scribble(step_dir) -> str:
    """The issue's damage: 4 KiB of junk into the middle of the largest file of a step; returns the file."""
    big = max((os.path.join(d, f) for d, _, fs in os.walk(step_dir) for f in fs), key=os.path.getsize)
    with open(big, "r+b") as f:
        f.seek(os.path.getsize(big) // 2)
        f.write(np.random.default_rng(0).bytes(4096))
    return big


def test_orbax_alone_restores_a_scribbled_step_with_other_values_the_digest_refuses_it(tmp_path):
    """Weights do not compress, so orbax's zstd stores them as raw blocks that carry no checksum."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    state = {"w": jnp.asarray(rng.integers(0, 2**32, size=(512, 512), dtype=np.uint32)), "b": jnp.arange(10.0)}
    ck = Checkpointer(str(tmp_path), keep=3, async_save=False)
    ck.save(1, state, {"pos": 1})
    ck.save(2, state, {"pos": 2})
    _scribble(os.path.join(ck.dir, "2", "state"))
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in state.items()}
    plain = ocp.CheckpointManager(ck.dir, item_handlers={"state": ocp.StandardCheckpointHandler()})
    got = plain.restore(2, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    plain.close()
    changed = int((np.asarray(got["w"]) != np.asarray(state["w"])).sum())
    assert changed > 0  # orbax alone: no error, other values
    with pytest.raises(CheckpointError, match=r"checkpoint step 2 in .* cannot be restored: state/.* \(bytes \d+-\d+\) "
                                              r"differs from what was saved .*earlier step that matches its digest is 1"):
        ck.restore(2, state)
    np.testing.assert_array_equal(np.asarray(ck.restore(1, state)[0]["w"]), np.asarray(state["w"]))
    ck.close()


def test_a_scribbled_checkpoint_is_named_on_every_read_and_resume_step_recovers(tmp_path):
    from farskip_jax.loading.load import load_run

    run = str(tmp_path / "run")
    keep = ["train.checkpoint_every=1", "train.keep_checkpoints=2"]
    first = train(_cfg(run, "train.steps=4", *keep), stream=io.StringIO())
    ck_dir = os.path.join(run, "checkpoints")
    assert Checkpointer(run).complete_steps() == [3, 4]  # the final checkpoint is always among those kept
    _scribble(os.path.join(ck_dir, "4", "state"))  # the damage, in the newest step
    before = snapshot(run)
    step_error = r"checkpoint step 4 in .*checkpoints cannot be restored: state/.* \(bytes \d+-\d+\) differs from what "
    with pytest.raises(CheckpointError, match=step_error + r".*newest earlier step that matches its digest is 3: "
                                                           r"re-run with train.resume_step=3"):
        train(_cfg(run, "train.steps=6", *keep), stream=io.StringIO())
    with pytest.raises(CheckpointError, match=step_error + r".*is 3: read that one instead .*--which 3"):
        load_run(run, "latest")
    assert snapshot(run) == before  # refused before anything was written
    load_run(run, 3)  # the earlier step reads
    out = io.StringIO()
    res = train(_cfg(run, "train.steps=4", *keep, "train.resume_step=3"), stream=out)
    assert "train.resume_step=3: resumed from checkpoint step 3; dropped the later checkpoint steps [4]" in out.getvalue()
    assert res.status == "done" and res.step == 4 and Checkpointer(run).complete_steps() == [3, 4]
    assert [r["step"] for r in read_metrics(run, "train")] == [1, 2, 3, 4]
    assert res.final_loss == first.final_loss  # bit-exact resume from the good step
    load_run(run, "latest")  # the new step 4 verifies
    with pytest.raises(ConfigError, match=r"train.resume_step=2 is not a complete checkpoint .*steps \[3, 4\]"):
        train(_cfg(run, "train.steps=4", "train.resume_step=2"), stream=io.StringIO())


def test_a_checkpoint_without_a_digest_is_read_and_says_so(tmp_path):
    import jax.numpy as jnp

    ck = Checkpointer(str(tmp_path), keep=3, async_save=False)
    ck.save(1, {"w": jnp.arange(4.0)}, {"pos": 1})
    ck.close()
    for p in (os.path.join(ck.data_dir, "1", "digest.json"), os.path.join(ck.data_dir, "digests")):
        os.remove(p)  # what a version before digests wrote
    old = Checkpointer(str(tmp_path))
    assert old.complete_steps() == [1]
    state, data = old.restore(1, {"w": jnp.zeros(4)})
    assert old.verified is False and data == {"pos": 1}
    assert "written by a farskip_jax that wrote no digests" in old.after_resume(1, None)[0]
    old.close()


def test_processes_that_share_the_reading_hash_each_block_once_and_agree_on_the_first_bad_one(tmp_path, monkeypatch):
    """first_mismatch with share=(i, n): process i hashes blocks i, i+n, ...; `agree` (the collective
    of a multi-host run, here the minimum over the n shares) gives every share the same first
    differing block, which is the one a single reader names."""
    from farskip_jax.loading import digest

    monkeypatch.setattr(digest, "BLOCK", 1024)
    rng = np.random.default_rng(0)
    files = {}
    for name, size in (("a", 5000), ("b", 0), ("c", 3000)):
        files[name] = str(tmp_path / name)
        with open(files[name], "wb") as f:
            f.write(rng.bytes(size))
    expected = digest.digest_files(files)
    hashed, real = [], digest._hash_blocks

    def counting(blocks):
        hashed.extend(b[:3] for b in blocks)  # (name, path, start) of each block hashed
        return real(blocks)

    monkeypatch.setattr(digest, "_hash_blocks", counting)

    def shared(n):
        """What each of n processes returns (their shares' first bad blocks exchanged by `agree`)."""
        firsts = []
        for i in range(n):  # each process: its own share, up to the exchange
            digest.first_mismatch(expected, files, (i, n), lambda k: firsts.append(k) or -1)
        hits = [k for k in firsts if k >= 0]
        return [digest.first_mismatch(expected, files, (i, n), lambda k: min(hits, default=-1)) for i in range(n)]

    assert shared(3) == [None] * 3
    blocks = [(name, path, start) for name, path, start, _ in digest._blocks(files)]
    hashed.clear()
    for i in range(3):
        digest.first_mismatch(expected, files, (i, 3), lambda k: k)
    assert sorted(hashed) == sorted(blocks) and len(hashed) == len(blocks) == 5 + 1 + 3  # each block once
    for name, at, first in (("c", 2100, "c (bytes 2048-2999)"), ("a", 4500, "a (bytes 4096-4999)")):
        with open(files[name], "r+b") as f:  # damage c's last block, then a's last block too
            f.seek(at)
            f.write(b"\x00" * 16)
        one = digest.first_mismatch(expected, files)  # a single reader
        assert one == f"{first} differs from what was saved"
        assert shared(3) == [one] * 3 and shared(2) == [one] * 2
