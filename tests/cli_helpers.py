"""Helpers of the entry-point tests (test_user_edges.py, test_convert_export.py): run a CLI as a user
types it, and check that a refusal is one `error:` line, exit 2, nothing written."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["model.num_layers=2", "train.steps=2", "train.warmup_steps=1", "train.batch_size=8", "train.seq_len=32", "train.eval_every=0",
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


def qwen3_hf(path):
    """A 2-layer Qwen3-MoE saved by transformers (vocab 320: the byte tokenizer fits)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=320, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                      num_experts_per_tok=2, num_hidden_layers=2, initializer_range=0.1,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(str(path))
    return str(path)
