"""Pretraining: the model and data of a config as a task of the one training loop (train/loop.py).

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
from farskip_jax.data.pipeline import close_iterator, first_batches, make_dataset
from farskip_jax.data.tokenizer import check_vocab, load_tokenizer
from farskip_jax.errors import ConfigError
from farskip_jax.parallel.build import create_model, model_mesh
from farskip_jax.parallel.distributed import maybe_initialize
from farskip_jax.parallel.sharding import place_state, shard_batch
from farskip_jax.train.checkpoint import Checkpointer
from farskip_jax.train.flops import total_params, train_flops_per_token
from farskip_jax.train.host_memory_check import check_host_memory
from farskip_jax.train.logger import read_metrics
from farskip_jax.train.loop import Task, matmul_peak, open_run, run_loop
from farskip_jax.train.optimizer import make_optimizer, schedule_change_warning
from farskip_jax.train.rundir import check_run_dir, release_run_dir
from farskip_jax.train.step import init_state, make_eval_step, make_train_step


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
    from farskip_jax.convert.loader import hf_to_config, open_checkpoint

    user = {k: to_dict(getattr(cfg, k)) for k in ("runtime", "mesh", "train", "inference")}  # checked with its shape
    return cfg.with_architecture(hf_to_config(open_checkpoint(cfg.init_from_hf).config, user, source=cfg.init_from_hf))


def build_model_and_mesh(cfg: Config):
    """The model with its parameters placed on the mesh, and the mesh (parallel.model_mesh: the FoE
    group x expert mesh for num_groups > 1 with EP). With `init_from_hf` the weights are streamed from
    that HF folder (convert.import_hf)."""
    mesh = model_mesh(cfg)
    if cfg.init_from_hf:
        from farskip_jax.convert.loader import import_hf

        # the run's connectivity, not the one an exported folder carries: the train step runs the model's
        _, model = import_hf(cfg.init_from_hf, mesh=mesh, overrides={
            "model": to_dict(cfg.model), "moe": to_dict(cfg.moe), "runtime": to_dict(cfg.runtime),
            "farskip": to_dict(cfg.farskip)})
        return model, mesh
    return create_model(cfg, mesh, seed=cfg.train.seed), mesh


def evaluate(eval_fn, state, cfg: Config, mesh, val_ds) -> float:
    it = iter(val_ds)
    ce_sum, tokens = 0.0, 0.0
    for _ in range(cfg.train.eval_batches):
        out = eval_fn(state, shard_batch(next(it), mesh))
        ce_sum += float(out["ce_sum"])
        tokens += float(out["tokens"])
    return ce_sum / max(tokens, 1.0)


class PretrainTask(Task):
    """Next-token training; a validation loss every train.eval_every updates (the final one after the loop)."""

    def __init__(self, step_fn, eval_fn, cfg: Config, mesh, val_ds, log):
        self.step_fn, self.eval_fn, self.cfg, self.mesh, self.val_ds, self.log = step_fn, eval_fn, cfg, mesh, val_ds, log
        self.val_loss: Optional[float] = None
        self.val_step: Optional[int] = None

    def after_step(self, step: int, state, train_it, last: bool) -> Optional[str]:
        every = self.cfg.train.eval_every
        if every and step % every == 0 and not last:
            self.val_loss, self.val_step = evaluate(self.eval_fn, state, self.cfg, self.mesh, self.val_ds), step
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
    pi, pc = jax.process_index(), jax.process_count()
    # everything that can be validated is, before the run folder is touched: a run that fails on bad
    # input (config, data, tokenizer vs vocabulary, HF folder, mesh, checkpoint) leaves no trace
    tok = load_tokenizer(cfg.data.tokenizer)
    check_vocab(tok, cfg.model.vocab_size, f"the model ({cfg.init_from_hf or 'model.vocab_size'})")
    ds_kw = dict(batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed, process_index=pi, process_count=pc,
                 tokenizer=tok, vocab_size=cfg.model.vocab_size)
    notes: list = []  # records left out by data.skip_bad_records: logged once the run folder is open
    train_ds = make_dataset(cfg.data, "train", **ds_kw, report=notes.append)
    val_ds = make_dataset(cfg.data, "val", **ds_kw)
    probe, _ = first_batches(train_ds, val_ds)
    check_host_memory(cfg, "this run")
    folder = check_run_dir(cfg)
    if t.resume_step is not None and not folder.resume:
        raise ConfigError(f"train.resume_step={t.resume_step}: {folder.path} holds no run of this config to resume; "
                          "drop train.resume_step to start it")

    model, mesh = build_model_and_mesh(cfg)
    shard_batch(probe, mesh)  # the batch splits over the mesh's batch axes
    tx, schedule = make_optimizer(t)
    graphdef, state = init_state(model, tx, t.seed)
    del model
    state = place_state(state, mesh)
    train_it = iter(train_ds)
    start, ckpt = None, None
    if folder.resume:  # restored before anything is written: an unreadable checkpoint fails cleanly
        ckpt = Checkpointer(folder.path, keep=t.keep_checkpoints)
        start = ckpt.resume_step(t.resume_step)
        if start is not None:
            state, data_state = ckpt.restore(start, state)
            train_it.set_state(data_state)
    finished = start is not None and start >= t.steps  # nothing to run: nothing is rewritten
    ckpt, log = open_run(cfg, folder, ckpt, start, stream, keep_config=finished)
    run_dir = folder.path
    for line in notes + ckpt.after_resume(start, t.resume_step):
        log.print(line)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step_fn = jax.jit(make_train_step(graphdef, cfg, tx, schedule), donate_argnums=0,
                      out_shardings=(shardings, None) if mesh is not None else None)
    eval_fn = jax.jit(make_eval_step(graphdef, cfg))
    if start is not None:
        log.print(f"resumed from checkpoint step {start} in {run_dir}")
        if folder.saved_steps is not None and folder.saved_steps != t.steps and not finished:
            log.print(schedule_change_warning(folder.saved_steps, t, start))
        if not finished:
            log.write("event", start, {"event": "resume"})
    step = int(state["step"])
    peak = matmul_peak(cfg, log)
    flops_tok = train_flops_per_token(cfg, t.seq_len)
    log.print(f"model: {total_params(cfg) / 1e6:.2f}M params, {flops_tok / 6e6:.2f}M active matmul-equivalent, "
              f"{jax.device_count()} device(s), {pc} process(es), preset={cfg.farskip.preset}, "
              f"tokens/step={t.batch_size * t.seq_len}, run_dir={run_dir}")
    task = PretrainTask(step_fn, eval_fn, cfg, mesh, val_ds, log)
    state, res = run_loop(task, cfg, state, train_it, ckpt, log, start=step, max_steps=t.steps,
                          flops_per_token=flops_tok, peak=peak, mesh=mesh)
    status, step, val_loss, val_step, last = res.status, res.step, task.val_loss, task.val_step, res.last
    logged = read_metrics(run_dir, None) if finished else []  # every process: all take the same branches
    if finished:  # how the run ended, from its own records: nothing is logged twice
        last = next((r for r in reversed(logged) if r["kind"] == "train"), {})
        ev = [r for r in logged if r["kind"] == "eval" and r["step"] == step and "val_loss" in r]
        val_loss, val_step = (ev[-1]["val_loss"], step) if ev else (val_loss, val_step)
    if status == "done" and val_step != step:
        val_loss, val_step = evaluate(eval_fn, state, cfg, mesh, val_ds), step
        log.print(f"step {step:>6d} | val loss {val_loss:.4f}")
        log.write("eval", step, {"val_loss": val_loss})
    ckpt.close()
    close_iterator(train_it)
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
    log.close()
    release_run_dir(run_dir)
    return TrainResult(status=status, step=step, final_loss=math.nan if final_loss is None else float(final_loss),
                       val_loss=val_loss, run_dir=run_dir, tokens_per_s=tps, mfu=mfu,
                       nonfinite_total=int(state["nonfinite_total"]), losses=res.losses, val_step=val_step)
