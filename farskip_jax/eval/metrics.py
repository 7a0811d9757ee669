"""Validation loss / perplexity, KL to a teacher and top-1 agreement over fixed validation batches.

A model "state" here is the dict {params, bias, rest} of train/step.py (a train state works as is);
teacher and student share one graphdef and differ in parameters and/or connectivity.

    batches = val_batches(cfg, n=8, mesh=mesh)                     # list of device batches
    fn = make_compare_fn(graphdef, student_fs=cfg.farskip)          # teacher: standard connectivity
    r = evaluate_pair(fn, student_state, teacher_state, batches)
    r.val_loss, r.ppl, r.teacher_loss, r.kl, r.top1                 # token means over all batches
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from farskip_jax.config import Config, FarSkipConfig
from farskip_jax.errors import ConfigError
from farskip_jax.losses.divergence import forward_kl, top1_agreement
from farskip_jax.data.pipeline import make_dataset
from farskip_jax.parallel.sharding import shard_batch

STANDARD = FarSkipConfig()


@dataclasses.dataclass
class PairResult:
    val_loss: float  # student cross entropy (nats / token)
    ppl: float
    teacher_loss: float
    kl: float  # forward KL(teacher || student), T = 1
    top1: float  # fraction of tokens where argmax agrees
    tokens: int
    teacher_maxp: float = float("nan")  # mean over tokens of the teacher's largest next-token probability
    confident: float = float("nan")  # fraction of tokens where that probability is >= `confidence`
    top1_confident: float = float("nan")  # top-1 agreement restricted to those tokens (an extra view, not top1)


def forward(graphdef, st: dict, batch: dict, farskip: Optional[FarSkipConfig], return_hidden: bool = False):
    """Run the model of `st` ({params, bias, rest}) on a batch under `farskip` -> ModelOutput."""
    model = nnx.merge(graphdef, st["params"], st["bias"], st["rest"])
    return model(batch["tokens"], batch["positions"], batch["segment_ids"], farskip=farskip,
                 return_hidden=return_hidden)


def ce_sum(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Summed next-token cross entropy over masked tokens: []."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask)


def make_loss_fn(graphdef, farskip: Optional[FarSkipConfig]) -> Callable:
    """jitted fn(state, batch) -> dict(ce_sum, tokens)."""

    def fn(st, batch):
        out = forward(graphdef, st, batch, farskip)
        return dict(ce_sum=ce_sum(out.logits, batch["targets"], batch["loss_mask"]), tokens=jnp.sum(batch["loss_mask"]))

    return jax.jit(fn)


def make_compare_fn(graphdef, student_fs: Optional[FarSkipConfig], teacher_fs: FarSkipConfig = STANDARD,
                    confidence: float = 0.5) -> Callable:
    """jitted fn(student_state, teacher_state, batch) -> sums of student/teacher CE, KL, top-1, tokens,
    and of the teacher's max probability / confident tokens (max probability >= `confidence`)."""

    def fn(s_st, t_st, batch):
        t = forward(graphdef, t_st, batch, teacher_fs).logits
        s = forward(graphdef, s_st, batch, student_fs).logits
        m = batch["loss_mask"]
        agree = top1_agreement(t, s)
        maxp = jnp.max(jax.nn.softmax(t.astype(jnp.float32), axis=-1), axis=-1)
        conf = (maxp >= confidence).astype(jnp.float32) * m
        return dict(ce_s=ce_sum(s, batch["targets"], m), ce_t=ce_sum(t, batch["targets"], m),
                    kl=jnp.sum(forward_kl(t, s) * m), top1=jnp.sum(agree * m), tokens=jnp.sum(m),
                    maxp=jnp.sum(maxp * m), conf=jnp.sum(conf), top1_conf=jnp.sum(agree * conf))

    return jax.jit(fn)


def _pool(outs: Iterable[dict]) -> dict:
    tot: dict = {}
    for o in outs:
        for k, v in jax.device_get(o).items():
            tot[k] = tot.get(k, 0.0) + float(v)
    if not tot:
        raise ConfigError("no validation batch to evaluate: pass at least one (--batches N / eval.batches >= 1)")
    return tot


def evaluate_loss(fn: Callable, st: dict, batches: list) -> float:
    """Token-mean cross entropy of `st` over `batches`."""
    tot = _pool(fn(st, b) for b in batches)
    return tot["ce_sum"] / max(tot["tokens"], 1.0)


def evaluate_pair(fn: Callable, s_st: dict, t_st: dict, batches: list) -> PairResult:
    tot = _pool(fn(s_st, t_st, b) for b in batches)
    n = max(tot["tokens"], 1.0)
    loss = tot["ce_s"] / n
    return PairResult(val_loss=loss, ppl=math.exp(min(loss, 700.0)), teacher_loss=tot["ce_t"] / n,
                      kl=tot["kl"] / n, top1=tot["top1"] / n, tokens=int(tot["tokens"]),
                      teacher_maxp=tot["maxp"] / n, confident=tot["conf"] / n,
                      top1_confident=tot["top1_conf"] / tot["conf"] if tot["conf"] > 0 else float("nan"))


def put_batch(batch: dict, mesh=None) -> dict:
    """numpy batch -> device arrays (batch dim sharded over the mesh when one is given)."""
    if mesh is not None:
        return shard_batch(batch, mesh)
    return {k: jnp.asarray(v) for k, v in batch.items()}


def val_batches(cfg: Config, n: int, *, mesh=None, tokenizer=None, batch_size: Optional[int] = None,
                seq_len: Optional[int] = None) -> list:
    """The first `n` validation batches of cfg.data (fixed: file order), placed on the mesh; every id is
    checked against cfg.model.vocab_size (DataError naming the source)."""
    if n < 1:
        raise ConfigError(f"{n} validation batches: evaluate at least one (--batches N / eval.batches >= 1)")
    t = cfg.train
    ds = make_dataset(cfg.data, "val", batch_size=batch_size or t.batch_size, seq_len=seq_len or t.seq_len,
                      seed=t.seed, process_index=jax.process_index(), process_count=jax.process_count(),
                      tokenizer=tokenizer, vocab_size=cfg.model.vocab_size)
    it = iter(ds)
    return [put_batch({k: np.asarray(v) for k, v in next(it).items()}, mesh) for _ in range(n)]


def cast_state(st: dict, dtype) -> dict:
    """A COPY of {params, bias, rest} with floating parameters cast to `dtype` (e.g. a bf16 teacher).

    Always copies so the result never aliases buffers of `st` (the student's are donated). The leaves
    are plain arrays, not nnx Variables: a frozen teacher passed into a jitted step must not carry
    Variables of the outer trace into rematerialised blocks (flax's TraceContextError under
    runtime.remat != none)."""
    def plain(x):
        return x.get_value() if isinstance(x, nnx.Variable) else x

    def cast(x):
        x = plain(x)
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.array(x, dtype=dtype, copy=True)
        return jnp.array(x, copy=True) if isinstance(x, jax.Array) else x

    def copy(x):
        x = plain(x)
        return jnp.array(x, copy=True) if isinstance(x, jax.Array) else x

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return dict(params=jax.tree.map(cast, st["params"], is_leaf=is_var),
                bias=jax.tree.map(copy, st["bias"], is_leaf=is_var),
                rest=jax.tree.map(copy, st["rest"], is_leaf=is_var))
