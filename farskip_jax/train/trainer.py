"""The pretraining loop: data -> jitted step -> metrics, eval, checkpoints, resume, preemption.

    result = train(cfg)          # TrainResult(status, step, final_loss, val_loss, run_dir, ...)

status: "done" (reached train.steps), "preempted" (SIGTERM: saved at the step boundary),
"time_limit" (train.time_limit_s: saved), "diverged" (train.max_nonfinite non-finite steps in a row:
nothing saved, the last good checkpoint is intact). A run folder that already holds this run resumes
from its newest complete checkpoint (params, optimizer, step, RNG, data iterator state).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from farskip_jax.config import Config, merge_checkpoint_shape, runtime_overrides
from farskip_jax.data.pipeline import close_iterator, first_batches, make_dataset
from farskip_jax.data.tokenizer import check_vocab, load_tokenizer
from farskip_jax.errors import ConfigError
from farskip_jax.parallel.build import create_model, model_mesh
from farskip_jax.parallel.distributed import maybe_initialize
from farskip_jax.parallel.sharding import place_state, shard_batch
from farskip_jax.train.checkpoint import Checkpointer
from farskip_jax.train.flops import measure_matmul_peak, total_params, train_flops_per_token
from farskip_jax.train.host_memory_check import check_host_memory
from farskip_jax.train.logger import RunLogger, config_summary, drop_records_after
from farskip_jax.train.preemption import StopFlag
from farskip_jax.train.optimizer import make_optimizer, schedule_change_warning
from farskip_jax.train.rundir import check_run_dir, claim_run_dir, release_run_dir
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


def shape_from_hf(cfg: Config) -> Config:
    """cfg with the model/moe shape of the HF checkpoint `cfg.init_from_hf` (runtime keys such as
    compute_dtype, remat, dispatch, loss weights and the FoE group count moe.num_groups stay the
    user's: config.RUNTIME_MODEL_KEYS / RUNTIME_MOE_KEYS)."""
    from farskip_jax.convert.loader import hf_to_config, open_checkpoint

    src = hf_to_config(open_checkpoint(cfg.init_from_hf).config, runtime_overrides(cfg), source=cfg.init_from_hf)
    return merge_checkpoint_shape(cfg, src)


def build_model_and_mesh(cfg: Config):
    """The model with its parameters placed on the mesh, and the mesh (parallel.model_mesh: the FoE
    group x expert mesh for num_groups > 1 with EP). With `init_from_hf` the weights are streamed from
    that HF folder (convert.import_hf)."""
    mesh = model_mesh(cfg)
    if cfg.init_from_hf:
        from farskip_jax.config import to_dict
        from farskip_jax.convert.loader import import_hf

        # the run's connectivity, not the one an exported folder carries: the train step runs the model's
        _, model = import_hf(cfg.init_from_hf, mesh=mesh, overrides={
            "model": to_dict(cfg.model), "moe": to_dict(cfg.moe), "farskip": to_dict(cfg.farskip)})
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


def train(cfg: Config, *, stream=None) -> TrainResult:
    """Run (or resume) the pretraining described by `cfg`."""
    t = cfg.train
    if t.mode != "pretrain":
        raise ConfigError(f"train.mode={t.mode!r}: this loop runs pretraining; distillation has its own entry point")
    maybe_initialize(cfg.mesh)
    if cfg.init_from_hf:  # continue pretraining an imported checkpoint: its shape, the user's run settings
        cfg = shape_from_hf(cfg)
    pi, pc = jax.process_index(), jax.process_count()
    primary = pi == 0
    # everything that can be validated is, before the run folder is touched: a run that fails on bad
    # input (config, data, tokenizer vs vocabulary, HF folder, mesh, checkpoint) leaves no trace
    tok = load_tokenizer(cfg.data.tokenizer)
    check_vocab(tok, cfg.model.vocab_size, f"the model ({cfg.init_from_hf or 'model.vocab_size'})")
    ds_kw = dict(batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed, process_index=pi, process_count=pc,
                 tokenizer=tok, vocab_size=cfg.model.vocab_size)
    train_ds = make_dataset(cfg.data, "train", **ds_kw)
    val_ds = make_dataset(cfg.data, "val", **ds_kw)
    probe, _ = first_batches(train_ds, val_ds)
    check_host_memory(cfg, "this run")
    folder = check_run_dir(cfg)

    model, mesh = build_model_and_mesh(cfg)
    shard_batch(probe, mesh)  # the batch splits over the mesh's batch axes
    tx, schedule = make_optimizer(t)
    graphdef, state = init_state(model, tx, t.seed)
    del model
    state = place_state(state, mesh)
    train_it = iter(train_ds)
    start = None
    if folder.resume:  # restored before anything is written: an unreadable checkpoint fails cleanly
        ckpt = Checkpointer(folder.path, keep=t.keep_checkpoints)
        start = ckpt.latest_step()
        if start is not None:
            state, data_state = ckpt.restore(start, state)
            train_it.set_state(data_state)
    if primary:
        claim_run_dir(cfg, folder)
    run_dir = folder.path
    if pc > 1:  # the others wait until process 0 has validated / created (or wiped) the folder
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("farskip_jax run_dir ready")
    if not folder.resume:
        ckpt = Checkpointer(run_dir, keep=t.keep_checkpoints)
    if primary and folder.resume:  # steps after the restored one are logged again
        drop_records_after(run_dir, int(start or 0))
    log = RunLogger(run_dir, tensorboard=t.tensorboard, enabled=primary, stream=stream)
    if folder.note:
        log.print(folder.note)
    log.print(config_summary(cfg, run_dir))
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step_fn = jax.jit(make_train_step(graphdef, cfg, tx, schedule), donate_argnums=0,
                      out_shardings=(shardings, None) if mesh is not None else None)
    eval_fn = jax.jit(make_eval_step(graphdef, cfg))
    if start is not None:
        log.print(f"resumed from checkpoint step {start} in {run_dir}")
        if folder.saved_steps is not None and folder.saved_steps != t.steps:
            log.print(schedule_change_warning(folder.saved_steps, t, start))
        log.write("event", start, {"event": "resume"})
    step = int(state["step"])

    n_dev = jax.device_count()
    peak = t.peak_flops
    if peak is None and jax.default_backend() == "cpu":
        peak = measure_matmul_peak(jnp.float32 if cfg.model.compute_dtype == "float32" else jnp.bfloat16, seconds=0.5)
        log.print(f"measured CPU matmul peak: {peak / 1e9:.1f} GFLOP/s per device (train.peak_flops to override)")
    flops_tok = train_flops_per_token(cfg, t.seq_len)
    log.print(f"model: {total_params(cfg) / 1e6:.2f}M params, {flops_tok / 6e6:.2f}M active matmul-equivalent, "
              f"{n_dev} device(s), {pc} process(es), preset={cfg.farskip.preset}, "
              f"tokens/step={t.batch_size * t.seq_len}, run_dir={run_dir}")

    losses, val_loss, last = [], None, {}
    t_start = time.perf_counter()
    t_prev, timed_steps, timed_s, wait_s = t_start, 0, 0.0, 0.0
    status = "done"
    with StopFlag() as stop:
        while step < t.steps:
            t_data = time.perf_counter()
            host_batch = next(train_it)
            data_wait = time.perf_counter() - t_data
            batch = shard_batch(host_batch, mesh)
            state, m = step_fn(state, batch)
            m = jax.device_get(m)
            step += 1
            now = time.perf_counter()
            dt = now - t_prev
            t_prev = now
            if step > int(start or 0) + 1:  # the first step of a process includes compilation
                timed_steps += 1
                timed_s += dt
            tps = t.batch_size * t.seq_len / dt
            rec = {k: (float(v) if np.ndim(v) == 0 and not isinstance(v, (bool, np.bool_)) else v)
                   for k, v in m.items()}
            rec["finite"] = bool(m["finite"])
            rec["tokens_per_s"] = tps
            rec["mfu"] = (tps * flops_tok / (peak * n_dev)) if peak else None
            rec["step_time_s"] = dt
            rec["data_wait_s"] = data_wait
            if step > int(start or 0) + 1:
                wait_s += data_wait
            losses.append(rec["loss"])
            log.write("train", step, rec)
            last = rec
            avg = timed_s / timed_steps if timed_steps else dt
            if step % t.log_every == 0 or step == 1 or step == t.steps:
                log.progress(step, t.steps, rec, avg * (t.steps - step))
            if not rec["finite"]:
                log.print(f"step {step}: non-finite loss/gradient ({rec['loss']}); update skipped "
                          f"({int(rec['nonfinite_streak'])} in a row, {int(rec['nonfinite_total'])} total)")
                if rec["nonfinite_streak"] >= t.max_nonfinite:
                    status = "diverged"
                    log.print(f"stopping: {t.max_nonfinite} non-finite steps in a row; the last good checkpoint "
                              f"({ckpt.latest_step()}) is left intact")
                    break
            if t.eval_every and step % t.eval_every == 0 and step < t.steps:
                val_loss = evaluate(eval_fn, state, cfg, mesh, val_ds)
                log.print(f"step {step:>6d} | val loss {val_loss:.4f}")
                log.write("eval", step, {"val_loss": val_loss})
            if t.checkpoint_every and step % t.checkpoint_every == 0 and step < t.steps and rec["finite"]:
                ckpt.save(step, state, train_it.get_state())
            if stop.signal is not None:
                status = "preempted"
                log.print(f"signal {stop.signal} received: saving checkpoint at step {step} and exiting")
                break
            if t.time_limit_s is not None and now - t_start > t.time_limit_s:
                status = "time_limit"
                log.print(f"train.time_limit_s={t.time_limit_s} reached at step {step}: saving and exiting")
                break
    if status != "diverged":
        if ckpt.latest_step() != step:
            ckpt.save(step, state, train_it.get_state())
        if status == "done":
            val_loss = evaluate(eval_fn, state, cfg, mesh, val_ds)
            log.print(f"step {step:>6d} | val loss {val_loss:.4f}")
            log.write("eval", step, {"val_loss": val_loss})
    ckpt.close()
    close_iterator(train_it)
    if timed_s > 0:
        tps = t.batch_size * t.seq_len * timed_steps / timed_s
    else:  # one step (compile included) or none at all in this process
        tps = last.get("tokens_per_s")
    mfu = (tps * flops_tok / (peak * n_dev)) if (peak and tps) else None
    data_frac = wait_s / timed_s if timed_s > 0 else None
    summary = {"status": status, "tokens_per_s": tps, "mfu": mfu, "val_loss": val_loss, "data_wait_frac": data_frac,
               "final_loss": last.get("loss", math.nan), "wall_s": time.perf_counter() - t_start}
    log.write("event", step, summary)
    speed = (f"mean {tps:,.0f} tokens/s" + (f", MFU {100 * mfu:.1f}%" if mfu else "")
             + (f", {100 * data_frac:.1f}% of the step time waiting for data" if data_frac is not None else "")) if tps else \
        f"no steps left to run (train.steps={t.steps}; raise it to train further)"
    log.print(f"{status} at step {step}: {speed}" + (f", val loss {val_loss:.4f}" if val_loss is not None else ""))
    log.close()
    release_run_dir(run_dir)
    return TrainResult(status=status, step=step, final_loss=float(last.get("loss", math.nan)), val_loss=val_loss,
                       run_dir=run_dir, tokens_per_s=tps, mfu=mfu,
                       nonfinite_total=int(state["nonfinite_total"]), losses=losses)
