"""The one training loop. Pretraining (train/trainer.py) and FCSD (fcsd/distill.py) are tasks in it.

    ckpt, log = open_run(cfg, folder, ckpt, restored_step, stream)   # claim, metrics, summary
    state, res = run_loop(task, cfg, state, train_it, ckpt, log, start=step, max_steps=N,
                          flops_per_token=F, mesh=mesh)

The loop owns what both share: claiming the run folder (process 0 claims, the others wait), dropping
the metrics a resumed run logs again, the step loop with data-wait timing, tokens/s and MFU (the first
step of a process, which compiles, is left out of the means), the progress line with an ETA, the
non-finite guard's stop after `train.max_nonfinite` in a row, periodic checkpoints (never mid-streak),
SIGTERM / SIGINT and `train.time_limit_s` (saved at the step boundary), and the final save. A task
brings its jitted step, how a host batch reaches the devices, and what happens after each step
(evaluations, early stopping: `after_step` returns a status to stop the run).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from farskip_jax.config import Config
from farskip_jax.train.checkpoint import Checkpointer
from farskip_jax.train.flops import cpu_matmul_peak
from farskip_jax.train.logger import RunLogger, config_summary, drop_records_after
from farskip_jax.train.preemption import StopFlag
from farskip_jax.train.rundir import RunFolder, claim_run_dir


class Task:
    """What one kind of training plugs into `run_loop`. Subclasses set `step_fn` and may override the rest."""

    step_fn: Any  # jitted (state, device batch) -> (state, metrics dict); metrics hold loss, finite, streaks
    progress_keys: tuple = ()  # metrics shown in the progress line after the loss

    def put(self, host_batch: dict, mesh) -> dict:
        """The host batch on the devices (the mesh's batch sharding)."""
        from farskip_jax.parallel.sharding import shard_batch

        return shard_batch(host_batch, mesh)

    def step(self, state, batch):
        return self.step_fn(state, batch)

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


def open_run(cfg: Config, folder: RunFolder, ckpt: Optional[Checkpointer], restored: Optional[int],
             stream=None, *, keep_config: bool = False) -> tuple[Checkpointer, RunLogger]:
    """Claim the run folder (process 0; the others wait for it; `keep_config`: leave its config.yaml
    as it is), drop the metrics of steps after the restored one, and open the checkpointer (unless
    restoring made one) and the logger."""
    primary = jax.process_index() == 0
    if primary:
        claim_run_dir(cfg, folder, write_config=not keep_config)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

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


def run_loop(task: Task, cfg: Config, state, train_it, ckpt: Checkpointer, log: RunLogger, *, start: int,
             max_steps: int, flops_per_token: float, peak: Optional[float], mesh=None) -> tuple[Any, LoopResult]:
    """Train from update `start` to `max_steps` (see the module docstring); returns the final state."""
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
            state, m = task.step(state, task.put(host_batch, mesh))
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
