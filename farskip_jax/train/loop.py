"""The one training session. Pretraining (train/trainer.py) and FCSD (fcsd/distill.py) are tasks in it.

    tok, train_ds, notes = train_data(cfg, "the model (model.vocab_size)")   # tokenizer, batches
    folder = check_folder(cfg)                                     # nothing written yet
    session = open_session(cfg, folder, mesh, make_model, train_ds, notes, max_steps=N, stream=stream)
    res = session.run(task)                                        # LoopResult; session.state: the final state
    session.close(); ...summary...; session.release()

A task brings its loss (`Task.loss_fn`, the inputs it keeps frozen, such as FCSD's teacher), what the
progress line shows and what happens after each update (evaluations, early stopping: `after_step`
returns a status to stop the run). The session owns the rest: the optimizer, the train state made or
restored in one place (`initial_state`), claiming the run folder (process 0 claims, the others wait),
dropping the metrics a resumed run logs again, the one step (train/step.make_step, jitted with the
state donated and kept on its shardings), the batches' placement on the mesh, and the loop with
data-wait timing, tokens/s and MFU (the first step of a process, which compiles, is left out of the
means), the progress line with an ETA, the non-finite guard's stop after `train.max_nonfinite` in a
row, periodic checkpoints (never mid-streak), SIGTERM / SIGINT and `train.time_limit_s` (saved at the
step boundary), and the final save.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from farskip_jax.config import Config
from farskip_jax.data.pipeline import close_iterator, make_dataset
from farskip_jax.data.tokenizer import check_vocab, load_tokenizer
from farskip_jax.errors import ConfigError
from farskip_jax.parallel.sharding import place_state, shard_batch
from farskip_jax.loading.checkpoint import Checkpointer
from farskip_jax.train.flops import cpu_matmul_peak, total_params, train_flops_per_token
from farskip_jax.train.logger import RunLogger, config_summary, drop_records_after
from farskip_jax.loading.optimizer import make_optimizer, schedule_change_warning
from farskip_jax.train.preemption import StopFlag
from farskip_jax.train.rundir import RunFolder, check_run_dir, claim_run_dir, release_run_dir
from farskip_jax.loading.train_state import init_state
from farskip_jax.train.step import make_step


class Task:
    """What one kind of training brings to the session. Subclasses set `loss_fn` and may override the rest."""

    loss_fn: Callable  # (params, bias, rest, batch, *frozen) -> (loss, aux): train/step.make_step
    frozen: tuple = ()  # the loss's inputs after the batch, never differentiated nor updated
    progress_keys: tuple = ()  # metrics shown in the progress line after the loss
    flops_factor: float = 1.0  # a step's FLOPs per training FLOP of the model (for MFU)

    def after_step(self, step: int, state, train_it, last: bool) -> Optional[str]:
        """Evaluations after update `step` (`last`: the run's final step); a status ends the run."""
        return None


@dataclasses.dataclass
class LoopResult:
    status: str  # done | diverged | preempted | time_limit | a task's status (early_stop)
    step: int
    losses: list
    last: dict  # the last train record
    tokens_per_s: Optional[float]  # None when this process ran no step
    mfu: Optional[float]
    data_wait_frac: Optional[float]
    wall_s: float


def train_data(cfg: Config, model: str) -> tuple[Any, Any, list]:
    """(tokenizer, training batches, notes) of cfg.data, checked against model.vocab_size (`model`
    names where the model comes from); notes: the records data.skip_bad_records left out, to log
    once the run folder is open."""
    tok = load_tokenizer(cfg.data.tokenizer)
    check_vocab(tok, cfg.model.vocab_size, model)
    notes: list = []
    ds = make_dataset(cfg.data, "train", **dataset_args(cfg, tok), report=notes.append)
    return tok, ds, notes


def dataset_args(cfg: Config, tok) -> dict:
    """The make_dataset arguments of a run: its batch, sequence, seed, this process's share, tokenizer."""
    t = cfg.train
    return dict(batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed, process_index=jax.process_index(),
                process_count=jax.process_count(), tokenizer=tok, vocab_size=cfg.model.vocab_size)


def check_folder(cfg: Config) -> RunFolder:
    """train.run_dir checked for this run (train/rundir.check_run_dir), writing nothing; a
    train.resume_step with no run of this config there to resume is refused."""
    folder = check_run_dir(cfg)
    if cfg.train.resume_step is not None and not folder.resume:
        raise ConfigError(f"train.resume_step={cfg.train.resume_step}: {folder.path} holds no run of this config to "
                          "resume; drop train.resume_step to start it")
    return folder


def initial_state(cfg: Config, folder: RunFolder, make_model: Callable, mesh, tx,
                  train_it) -> tuple[Any, dict, Optional[Checkpointer], Optional[int]]:
    """(graphdef, train state, checkpointer, restored step) of the run: a fresh state of `make_model()`
    placed on `mesh`, or, when `folder` holds this run, its checkpoint train.resume_step or newest
    complete one (params, optimizer, step, RNG; the data iterator `train_it` is set to its saved
    position). Writes nothing: an unreadable checkpoint fails before the folder is touched."""
    graphdef, state = init_state(make_model(), tx, cfg.train.seed)
    state = place_state(state, mesh)  # counters / optimizer leaves on the mesh too: a restored state must match
    if not folder.resume:
        return graphdef, state, None, None
    ckpt = Checkpointer(folder.path, keep=cfg.train.keep_checkpoints)
    start = ckpt.resume_step(cfg.train.resume_step)
    if start is not None:
        state, data_state = ckpt.restore(start, state)
        train_it.set_state(data_state)
    return graphdef, state, ckpt, start


def open_run(cfg: Config, folder: RunFolder, ckpt: Optional[Checkpointer], restored: Optional[int],
             stream=None, *, keep_config: bool = False) -> tuple[Checkpointer, RunLogger]:
    """Claim the run folder (process 0; the others wait for it; `keep_config`: leave its config.yaml
    as it is), drop the metrics of steps after the restored one, and open the checkpointer (unless
    restoring made one) and the logger."""
    primary = jax.process_index() == 0
    if primary:
        claim_run_dir(cfg, folder, write_config=not keep_config)
    if jax.process_count() > 1:

        multihost_utils.sync_global_devices("farskip_jax run_dir ready")
    if primary and folder.resume:  # steps after the restored one are logged again
        drop_records_after(folder.path, int(restored or 0))
    if ckpt is None:
        ckpt = Checkpointer(folder.path, keep=cfg.train.keep_checkpoints)
    log = RunLogger(folder.path, tensorboard=cfg.train.tensorboard, enabled=primary, stream=stream)
    if folder.note:
        log.print(folder.note)
    log.print(config_summary(cfg, folder.path))
    return ckpt, log


def matmul_peak(cfg: Config, log: RunLogger) -> Optional[float]:
    """train.peak_flops, or on CPU a measured matmul peak per device (for MFU); None elsewhere."""
    peak = cfg.train.peak_flops
    if peak is None and jax.default_backend() == "cpu":
        dtype = jnp.float32 if cfg.runtime.compute_dtype == "float32" else jnp.bfloat16
        peak, where = cpu_matmul_peak(dtype, cfg.kernels.cache_dir)
        log.print(f"MFU is against a CPU matmul peak of {peak / 1e9:.1f} GFLOP/s per device, {where}; "
                  "train.peak_flops=FLOPS overrides it")
    return peak


def run_loop(task: Task, step_fn: Callable, cfg: Config, state, train_it, ckpt: Checkpointer, log: RunLogger, *,
             start: int, max_steps: int, flops_per_token: float, peak: Optional[float], mesh) -> tuple[Any, LoopResult]:
    """Train from update `start` to `max_steps` with the jitted step_fn(state, batch, *task.frozen)
    (see the module docstring); returns the final state."""
    t = cfg.train
    tokens_per_step = t.batch_size * t.seq_len
    n_dev = jax.device_count()
    step, losses, last = start, [], {}
    t_start = time.perf_counter()
    t_prev, timed_steps, timed_s, wait_s = t_start, 0, 0.0, 0.0
    status = "done"
    with StopFlag() as stop:  # SIGTERM / SIGINT: checkpoint at the next step boundary and return
        while step < max_steps:
            t_data = time.perf_counter()
            host_batch = next(train_it)
            data_wait = time.perf_counter() - t_data
            state, m = step_fn(state, shard_batch(host_batch, mesh), *task.frozen)
            m = jax.device_get(m)
            step += 1
            now = time.perf_counter()
            dt, t_prev = now - t_prev, now
            if step > start + 1:  # the first step of a process includes compilation
                timed_steps += 1
                timed_s += dt
                wait_s += data_wait
            tps = tokens_per_step / dt
            rec = {k: (float(v) if np.ndim(v) == 0 and not isinstance(v, (bool, np.bool_)) else v)
                   for k, v in m.items()}
            rec.update(finite=bool(m["finite"]), tokens_per_s=tps, step_time_s=dt, data_wait_s=data_wait,
                       mfu=(tps * flops_per_token / (peak * n_dev)) if peak else None)
            losses.append(rec["loss"])
            log.write("train", step, rec)
            last = rec
            avg = timed_s / timed_steps if timed_steps else dt
            if step % t.log_every == 0 or step == start + 1 or step == max_steps:
                log.progress(step, max_steps, rec, avg * (max_steps - step), extra=task.progress_keys)
            if not rec["finite"]:
                log.print(f"step {step}: non-finite loss/gradient ({rec['loss']}); update skipped "
                          f"({int(rec['nonfinite_streak'])} in a row, {int(rec['nonfinite_total'])} total)")
                if rec["nonfinite_streak"] >= t.max_nonfinite:
                    status = "diverged"
                    ckpt.wait()  # a save still in flight is the last good checkpoint
                    good = ckpt.latest_step()
                    log.print(f"stopping: {t.max_nonfinite} non-finite steps in a row; "
                              + (f"the last good checkpoint (step {good}) is left intact: re-running resumes from it"
                                 if good is not None else
                                 "no checkpoint was saved before (train.checkpoint_every sets how often one is): "
                                 "lower train.lr or raise train.warmup_steps and re-run with train.overwrite=true"))
                    break
            stop_as = task.after_step(step, state, train_it, step == max_steps)
            if stop_as is not None:
                status = stop_as
                break
            if t.checkpoint_every and step % t.checkpoint_every == 0 and step < max_steps and rec["finite"]:
                ckpt.save(step, state, train_it.get_state())
            if stop.signal is not None:
                status = "preempted"
                log.print(f"signal {stop.signal} received: saving checkpoint at step {step} and exiting "
                          "(re-running resumes)")
                break
            if t.time_limit_s is not None and now - t_start > t.time_limit_s:
                status = "time_limit"
                log.print(f"train.time_limit_s={t.time_limit_s} reached at step {step}: saving and exiting")
                break
    if status != "diverged" and ckpt.latest_step() != step:
        ckpt.save(step, state, train_it.get_state())
    if timed_s > 0:
        tps = tokens_per_step * timed_steps / timed_s
    else:  # one step (compile included) or none at all in this process
        tps = last.get("tokens_per_s")
    mfu = (tps * flops_per_token / (peak * n_dev)) if (peak and tps) else None
    return state, LoopResult(status=status, step=step, losses=losses, last=last, tokens_per_s=tps, mfu=mfu,
                             data_wait_frac=wait_s / timed_s if timed_s > 0 else None,
                             wall_s=time.perf_counter() - t_start)


@dataclasses.dataclass
class Session:
    """One run in its folder: the config, mesh, optimizer, train state, data iterator, checkpointer and
    log that `open_session` made; `run` trains a task on them."""

    cfg: Config
    folder: RunFolder
    mesh: Any
    tx: Any
    schedule: Any
    graphdef: Any
    state: dict
    train_it: Any
    ckpt: Checkpointer
    log: RunLogger
    start: Optional[int]  # the restored update; None for a fresh run
    max_steps: int

    @property
    def run_dir(self) -> str:
        return self.folder.path

    @property
    def finished(self) -> bool:
        """Restored at or past max_steps: nothing runs and the folder's config.yaml stays as it is."""
        return self.start is not None and self.start >= self.max_steps

    def run(self, task: Task) -> LoopResult:
        """Train `task` from the restored update (or 0) to max_steps; self.state becomes the final state."""
        cfg, t, log = self.cfg, self.cfg.train, self.log
        shardings = jax.tree.map(lambda x: x.sharding, self.state)  # outputs keep the inputs' placement
        step_fn = jax.jit(make_step(self.graphdef, cfg, self.tx, self.schedule, task.loss_fn), donate_argnums=0,
                          out_shardings=(shardings, None))
        if self.start is not None:
            log.print(f"resumed from checkpoint step {self.start} in {self.run_dir}")
            if not self.finished:
                if self.folder.saved_steps is not None and self.folder.saved_steps != t.steps:
                    log.print(schedule_change_warning(self.folder.saved_steps, t, self.start))
                log.write("event", self.start, {"event": "resume"})
        peak = matmul_peak(cfg, log)
        flops_tok = train_flops_per_token(cfg, t.seq_len)
        log.print(f"model: {total_params(cfg) / 1e6:.2f}M params, {flops_tok / 6e6:.2f}M active matmul-equivalent, "
                  f"{jax.device_count()} device(s), {jax.process_count()} process(es), preset={cfg.farskip.preset}, "
                  f"tokens/step={t.batch_size * t.seq_len}, run_dir={self.run_dir}")
        self.state, res = run_loop(task, step_fn, cfg, self.state, self.train_it, self.ckpt, log,
                                   start=int(self.state["step"]), max_steps=self.max_steps,
                                   flops_per_token=flops_tok * task.flops_factor, peak=peak, mesh=self.mesh)
        return res

    def close(self) -> None:
        """Finish the checkpoint writes and stop the data iterator (the log stays open for the summary)."""
        self.ckpt.close()
        close_iterator(self.train_it)

    def release(self) -> None:
        """Close the log and give up the run folder."""
        self.log.close()
        release_run_dir(self.run_dir)


def open_session(cfg: Config, folder: RunFolder, mesh, make_model: Callable, train_ds, notes=(), *,
                 max_steps: Optional[int] = None, stream=None) -> Session:
    """The optimizer of cfg.train and the state of `initial_state`; then the folder is claimed, the log
    opened (open_run) and `notes` and what resuming did are logged. max_steps: train.steps unless given."""
    max_steps = cfg.train.steps if max_steps is None else max_steps
    tx, schedule = make_optimizer(cfg.train)
    train_it = iter(train_ds)
    graphdef, state, ckpt, start = initial_state(cfg, folder, make_model, mesh, tx, train_it)
    ckpt, log = open_run(cfg, folder, ckpt, start, stream, keep_config=start is not None and start >= max_steps)
    for line in list(notes) + ckpt.after_resume(start, cfg.train.resume_step):
        log.print(line)
    return Session(cfg=cfg, folder=folder, mesh=mesh, tx=tx, schedule=schedule, graphdef=graphdef, state=state,
                   train_it=train_it, ckpt=ckpt, log=log, start=start, max_steps=max_steps)
