"""Pretraining: next-token prediction as a task of the one training session (train/loop.py).

    result = train(cfg)          # TrainResult(status, step, final_loss, val_loss, run_dir, ...)

status: "done" (reached train.steps), "preempted" (SIGTERM: saved at the step boundary),
"time_limit" (train.time_limit_s: saved), "diverged" (train.max_nonfinite non-finite steps in a row:
nothing saved, the last good checkpoint is intact). A run folder that already holds this run resumes
from its newest complete checkpoint, or `train.resume_step` (params, optimizer, step, RNG, data
iterator state). A run re-run when it already reached train.steps runs nothing and rewrites nothing
(its config.yaml, evaluations and summary stay as they were). val_step: the update whose weights
gave val_loss.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax

from farskip_jax.config import Config, to_dict
from farskip_jax.data.pipeline import first_batches, make_dataset
from farskip_jax.errors import ConfigError
from farskip_jax.loading.hf_folder import hf_to_config, import_hf, open_checkpoint
from farskip_jax.parallel.build import create_model, model_mesh
from farskip_jax.parallel.distributed import maybe_initialize
from farskip_jax.parallel.sharding import shard_batch
from farskip_jax.train.host_memory_check import check_host_memory
from farskip_jax.train.logger import read_metrics
from farskip_jax.train.loop import Task, check_folder, dataset_args, open_session, train_data
from farskip_jax.train.step import make_eval_step, make_loss_fn


@dataclasses.dataclass
class TrainResult:
    status: str
    step: int
    final_loss: float
    val_loss: Optional[float]
    run_dir: str
    tokens_per_s: Optional[float]  # None when this process ran no timed step (a finished run resumed)
    mfu: Optional[float]
    nonfinite_total: int
    losses: list
    val_step: Optional[int] = None


def shape_from_hf(cfg: Config) -> Config:
    """cfg with the architecture (model and moe sections, whole) of the HF checkpoint `cfg.init_from_hf`;
    runtime, farskip and every other section stay the user's (Config.with_architecture)."""

    user = {k: to_dict(getattr(cfg, k)) for k in ("runtime", "mesh", "train", "inference")}  # checked with its shape
    return cfg.with_architecture(hf_to_config(open_checkpoint(cfg.init_from_hf).config, user, source=cfg.init_from_hf))


def make_model_fn(cfg: Config, mesh):
    """make_model() -> the model of cfg with its parameters placed on `mesh`: streamed from the HF
    folder `init_from_hf` (convert.import_hf) when set, else freshly initialised (train.seed)."""
    if not cfg.init_from_hf:
        return lambda: create_model(cfg, mesh, seed=cfg.train.seed)

    def imported():

        # the run's connectivity, not the one an exported folder carries: the train step runs the model's
        _, model = import_hf(cfg.init_from_hf, mesh=mesh, overrides={
            "model": to_dict(cfg.model), "moe": to_dict(cfg.moe), "runtime": to_dict(cfg.runtime),
            "farskip": to_dict(cfg.farskip)})
        return model

    return imported


class PretrainTask(Task):
    """Next-token training; a validation loss every train.eval_every updates (the final one after the loop)."""

    def __init__(self, graphdef, cfg: Config, mesh, val_ds, log):
        self.loss_fn = make_loss_fn(graphdef, cfg)
        self.eval_fn = jax.jit(make_eval_step(graphdef, cfg))
        self.cfg, self.mesh, self.val_ds, self.log = cfg, mesh, val_ds, log
        self.val_loss: Optional[float] = None
        self.val_step: Optional[int] = None

    def evaluate(self, state) -> float:
        """The token-mean validation loss of `state` on the first train.eval_batches validation batches."""
        it = iter(self.val_ds)
        ce_sum, tokens = 0.0, 0.0
        for _ in range(self.cfg.train.eval_batches):
            out = self.eval_fn(state, shard_batch(next(it), self.mesh))
            ce_sum += float(out["ce_sum"])
            tokens += float(out["tokens"])
        return ce_sum / max(tokens, 1.0)

    def after_step(self, step: int, state, train_it, last: bool) -> Optional[str]:
        every = self.cfg.train.eval_every
        if every and step % every == 0 and not last:
            self.val_loss, self.val_step = self.evaluate(state), step
            self.log.print(f"step {step:>6d} | val loss {self.val_loss:.4f}")
            self.log.write("eval", step, {"val_loss": self.val_loss})
        return None


def train(cfg: Config, *, stream=None) -> TrainResult:
    """Run (or resume) the pretraining described by `cfg`."""
    t = cfg.train
    if t.mode != "pretrain":
        raise ConfigError(f"train.mode={t.mode!r}: this loop runs pretraining; distillation has its own entry point")
    maybe_initialize(cfg.mesh)
    if cfg.init_from_hf:  # continue pretraining an imported checkpoint: its shape, the user's run settings
        cfg = shape_from_hf(cfg)
    # everything that can be validated is, before the run folder is touched: a run that fails on bad
    # input (config, data, tokenizer vs vocabulary, HF folder, mesh, checkpoint) leaves no trace
    tok, train_ds, notes = train_data(cfg, f"the model ({cfg.init_from_hf or 'model.vocab_size'})")
    val_ds = make_dataset(cfg.data, "val", **dataset_args(cfg, tok))
    probe, _ = first_batches(train_ds, val_ds)
    check_host_memory(cfg, "this run")
    folder = check_folder(cfg)
    mesh = model_mesh(cfg)
    shard_batch(probe, mesh)  # the batch splits over the mesh's batch axes
    session = open_session(cfg, folder, mesh, make_model_fn(cfg, mesh), train_ds, notes, stream=stream)
    log, run_dir, finished = session.log, session.run_dir, session.finished
    task = PretrainTask(session.graphdef, cfg, mesh, val_ds, log)
    res = session.run(task)
    status, step, val_loss, val_step, last = res.status, res.step, task.val_loss, task.val_step, res.last
    logged = read_metrics(run_dir, None) if finished else []  # every process: all take the same branches
    if finished:  # how the run ended, from its own records: nothing is logged twice
        last = next((r for r in reversed(logged) if r["kind"] == "train"), {})
        ev = [r for r in logged if r["kind"] == "eval" and r["step"] == step and "val_loss" in r]
        val_loss, val_step = (ev[-1]["val_loss"], step) if ev else (val_loss, val_step)
    if status == "done" and val_step != step:
        val_loss, val_step = task.evaluate(session.state), step
        log.print(f"step {step:>6d} | val loss {val_loss:.4f}")
        log.write("eval", step, {"val_loss": val_loss})
    session.close()
    tps, mfu, data_frac = res.tokens_per_s, res.mfu, res.data_wait_frac
    final_loss = last.get("loss")
    summary = {"status": status, "tokens_per_s": tps, "mfu": mfu, "val_loss": val_loss, "val_loss_step": val_step,
               "data_wait_frac": data_frac, "final_loss": final_loss, "wall_s": res.wall_s}
    if not (finished and any(r["kind"] == "event" and "status" in r and r["step"] == step for r in logged)):
        log.write("event", step, summary)
    speed = (f"mean {tps:,.0f} tokens/s" + (f", MFU {100 * mfu:.1f}%" if mfu else "")
             + (f", {100 * data_frac:.1f}% of the step time waiting for data" if data_frac is not None else "")) if tps else \
        f"no steps left to run (train.steps={t.steps}; raise it to train further)"
    val = "" if val_loss is None else f", val loss {val_loss:.4f}" + (f" (at step {val_step})" if val_step != step else "")
    log.print(f"{status} at step {step}: {speed}{val}")
    session.release()
    return TrainResult(status=status, step=step, final_loss=math.nan if final_loss is None else float(final_loss),
                       val_loss=val_loss, run_dir=run_dir, tokens_per_s=tps, mfu=mfu,
                       nonfinite_total=int(session.state["nonfinite_total"]), losses=res.losses, val_step=val_step)
