"""FCSD: FarSkip-Collective self-distillation (arXiv 2511.11505, section "conversion").

Teacher = the original weights under standard connectivity, frozen (no optimizer state, optionally
bf16); student = a trainable copy of the same weights under `cfg.farskip` (all layers, first/last N
or a list: `farskip.layers`). One jitted step runs both forwards on the same mesh and updates the
student only:

    loss = kl_weight * T^2 * KL_kind(softmax(t/T), softmax(s/T))    (forward | reverse | both; top-k)
         + ce_weight * CE(student, next tokens)
         + hidden_weight * mean_layers ||h_s - h_t||^2 / d           (per-layer full streams)
         + runtime.aux_loss_weight * aux + runtime.z_loss_weight * z          (student router)

all token means over non-padding tokens (`loss_mask`). Every `distill.eval_every` steps the student
is compared with the teacher on fixed validation batches (KL, top-1 agreement, losses); the metric
`distill.metric` (val_kl | val_loss | task) drives early stopping (fcsd/early_stopping.py) and the
best student is kept in `<run_dir>/best/checkpoints`. Weights come from `init_from_hf` (HF folder)
or `distill.init_from_run` (a run folder). Step 0 is evaluated before any update, so the table
"teacher / converted before training / after FCSD" comes from one run's metrics.jsonl.
The run is a task (DistillTask: its loss, the teacher as the loss's frozen input, its evaluations)
of the one training session (train/loop.py), with pretraining's step (train/step.make_step) and
metrics: as in pretraining, SIGTERM/SIGINT (status "preempted") and `train.time_limit_s` save a
checkpoint at the step boundary and return, `train.max_nonfinite` non-finite steps in a row stop it
("diverged", the last good checkpoint intact); re-running the same config resumes (student,
optimizer, data iterator, early-stopping history). `train.grad_accum` splits each batch into
micro-batches.
`farskip.layers: auto` (fcsd/planner.py) is resolved once, after the weights and validation batches
load and before the run folder is touched: an untrained sweep on the teacher chooses the set within
`distill.auto_budget`; the run folder keeps the resolved config and `farskip_auto.json` / `.md`, and
re-running resumes with the stored choice (no new sweep).

    result = distill(cfg)        # DistillResult; also `python train.py --config configs/distill_tiny.yaml`
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from farskip_jax.config import Config
from farskip_jax.data.pipeline import first_batches
from farskip_jax.errors import ConfigError
from farskip_jax.loading.load import restore_train_state
from farskip_jax.eval.metrics import STANDARD, cast_state, evaluate_pair, make_compare_fn, val_batches
from farskip_jax.eval.tasks import load_task, score_tasks
from farskip_jax.losses.ce import token_ce
from farskip_jax.losses.chunked import chunked_fcsd
from farskip_jax.losses.divergence import hidden_l2, masked_mean, token_divergence
from farskip_jax.model.layers import dtype_of
from farskip_jax.parallel.build import model_mesh
from farskip_jax.parallel.distributed import maybe_initialize
from farskip_jax.parallel.sharding import place_state
from farskip_jax.convert.export import run_export_dir  # a relative export_hf is inside the run folder, never another's export
from farskip_jax.fcsd.early_stopping import EarlyStopper
from farskip_jax.fcsd.planner import Plan, apply_choice, plan_conversion, read_plan, request_of, write_plan
from farskip_jax.fcsd.source import check_source, export_student, load_source, source_shape
from farskip_jax.loading.checkpoint import Checkpointer
from farskip_jax.train.host_memory_check import check_host_memory
from farskip_jax.train.loop import Task, check_folder, open_session, train_data
from farskip_jax.train.rundir import check_run_dir
from farskip_jax.train.step import add_model_terms, make_step


@dataclasses.dataclass
class DistillResult:
    status: str  # done | early_stop | token_budget | diverged | preempted (SIGTERM) | time_limit
    step: int
    best_step: Optional[int]
    best_metric: Optional[float]
    tokens: int
    run_dir: str
    evals: list  # [{step, val_loss, teacher_loss, kl, top1, ...}]
    losses: list


# --------------------------------------------------------------------------------------------------
# loss and step
# --------------------------------------------------------------------------------------------------


def make_distill_loss_fn(graphdef, cfg: Config) -> Callable:
    """loss_fn(params, bias, rest, batch, teacher) -> (loss, aux); teacher = {params, bias, rest}. With
    train.loss_chunk both models return their final streams and the KL and CE come from
    losses/chunked.chunked_fcsd (no [b, s, V] logits of either model; same values and gradients)."""
    d = cfg.distill
    want_hidden = d.hidden_weight > 0

    def loss_fn(params, bias, rest, batch, teacher):
        chunk = cfg.train.loss_chunk or 0  # > 0: the logit losses a chunk of positions at a time
        args = (batch["tokens"], batch["positions"], batch["segment_ids"])
        with jax.named_scope("teacher"):
            t_model = nnx.merge(graphdef, teacher["params"], teacher["bias"], teacher["rest"])
            t_out = t_model(*args, farskip=STANDARD, return_hidden=want_hidden, logits=not chunk)
        with jax.named_scope("student"):
            student = nnx.merge(graphdef, params, bias, rest)
            s_out = student(*args, farskip=cfg.farskip, return_hidden=want_hidden, logits=not chunk)
        mask = batch["loss_mask"]
        if chunk:
            kl, ce, n = chunked_fcsd(s_out.final, student.unembed(), t_out.final, t_model.unembed(), batch["targets"],
                                     mask, chunk=chunk, kind=d.kl, temperature=d.temperature, top_k=d.top_k_logits,
                                     compute_dtype=dtype_of(cfg.runtime.compute_dtype))
        else:
            t_logits = jax.lax.stop_gradient(t_out.logits)
            kl = masked_mean(token_divergence(t_logits, s_out.logits, kind=d.kl, temperature=d.temperature,
                                              top_k=d.top_k_logits), mask)
            ce, n = token_ce(s_out.logits, batch["targets"], mask)
        hid = (hidden_l2(jax.lax.stop_gradient(t_out.hidden), s_out.hidden, mask) if want_hidden
               else jnp.zeros((), jnp.float32))
        loss, terms = add_model_terms(d.kl_weight * kl + d.ce_weight * ce + d.hidden_weight * hid, s_out, cfg)
        return loss, dict(kl=kl, ce=ce, hidden=hid, **terms, tokens=n)

    return loss_fn


def make_distill_step(graphdef, cfg: Config, tx: optax.GradientTransformation, schedule: optax.Schedule) -> Callable:
    """Un-jitted step(state, batch, teacher) -> (state, metrics): train/step.make_step with the
    distillation loss. `state` is the student's train state; `teacher` is never differentiated nor
    updated. A non-finite loss or gradient leaves the student untouched, `train.grad_accum` runs
    micro-batches, and the metrics carry the model's (dropped, router losses, load), as in pretraining."""
    return make_step(graphdef, cfg, tx, schedule, make_distill_loss_fn(graphdef, cfg))


def resolve_auto_layers(cfg: Config, graphdef, src: dict, val: list, stream=None) -> tuple[Config, object, bool]:
    """(cfg with an explicit farskip.layers, the budget.Plan, reused) for cfg.farskip.layers == "auto".

    A run folder that holds this run's choice (farskip_auto.json made for the same farskip request,
    and the folder resumes under it) keeps it: no sweep, the same layers, so resume stays bit-exact.
    Otherwise the untrained sweep runs on the teacher (its teacher_dtype copy, as step 0 evaluates)
    and the rule of fcsd/planner.py chooses. Writes nothing; ConfigError when no set fits."""

    stored = None if cfg.train.overwrite else read_plan(os.path.abspath(cfg.train.run_dir))
    if stored is not None and stored.get("request") == request_of(cfg):
        resolved = apply_choice(cfg, stored["layers"])
        if check_run_dir(resolved).resume:
            return resolved, Plan.from_json(stored), True
    teacher = cast_state(src, dtype_of(cfg.distill.teacher_dtype))
    plan = plan_conversion(graphdef, src, cfg, val, teacher=teacher, stream=stream or sys.stdout)
    del teacher
    return apply_choice(cfg, plan.layers), plan, False


# --------------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------------


def _metric_value(cfg: Config, r, task_score: Optional[Callable]) -> float:
    if cfg.distill.metric == "val_kl":
        return r.kl
    if cfg.distill.metric == "val_loss":
        return r.val_loss
    return task_score()


class DistillTask(Task):
    """FCSD as a task of the one session: the student's loss against the frozen teacher; every
    distill.eval_every updates (and at the last) the student is compared with the teacher, the best is
    kept, and early stopping may end the run ("early_stop")."""

    progress_keys = ("kl", "ce")
    flops_factor = 8 / 6  # the teacher's forward on top of the student's forward and backward

    def __init__(self, graphdef, teacher, cfg: Config, val: list, es: EarlyStopper, es_path: str,
                 best: Checkpointer, log, task_score: Optional[Callable], tokens_per_step: int):
        self.loss_fn = make_distill_loss_fn(graphdef, cfg)
        self.frozen = (teacher,)
        self.cmp_fn = make_compare_fn(graphdef, cfg.farskip)
        self.teacher, self.cfg, self.val = teacher, cfg, val
        self.es, self.es_path, self.best, self.log = es, es_path, best, log
        self.task_score, self.tokens_per_step = task_score, tokens_per_step
        self.evals: list = []

    def evaluate(self, at: int, state, train_it):
        """Compare the student with the teacher at update `at`; keep it when best; the early-stopping decision."""
        d = self.cfg.distill
        r = evaluate_pair(self.cmp_fn, state, self.teacher, self.val)
        m = _metric_value(self.cfg, r, (lambda: self.task_score(state)) if self.task_score else None)
        rec = dict(val_loss=r.val_loss, ppl=r.ppl, teacher_loss=r.teacher_loss, kl=r.kl, top1=r.top1,
                   top1_confident=r.top1_confident, teacher_maxp=r.teacher_maxp, metric=m,
                   tokens_used=at * self.tokens_per_step)
        self.evals.append(dict(step=at, **rec))
        self.log.write("eval", at, rec)
        self.log.print(f"step {at:>6d} | val loss {r.val_loss:.4f} (teacher {r.teacher_loss:.4f}) | KL {r.kl:.5f} | "
                       f"top-1 {100 * r.top1:.2f}% | {d.metric} {m:.5f}")
        dec = self.es.update(at, m)
        if dec.improved:
            self.best.save(at, state, train_it.get_state())
        self.save_stopper()
        return dec

    def save_stopper(self) -> None:
        with open(self.es_path, "w") as f:
            json.dump(self.es.state_dict(), f)

    def drop_discarded_best(self, start: int, state, data_state: dict) -> list[str]:
        """After train.resume_step=start (the steps after it are trained again): best/ may hold a student
        of those discarded steps. Drop it, so best/ holds the student of es.best_step (replayed up to
        start) or none: the student at `start` when it is that best, else the best is forgotten (its
        weights were replaced) and the next evaluation's student becomes it. Lines for the log."""
        held = self.best.latest_step()
        if held is None or held <= start:
            return []
        self.best.drop_after(start)
        head = f"best/ held the student of step {held}, which train.resume_step={start} discards: dropped; "
        lost = self.es.best_step
        if lost == start:
            self.best.save(start, state, data_state)
            why = f"the student of step {start}, the best up to it, is kept instead"
        else:
            self.es.forget_best()
            why = ((f"the best before it (step {lost}) was not kept, so " if lost is not None else "")
                   + "the next evaluation's student becomes the best")
        self.save_stopper()  # the stopper as replayed up to start
        return [head + why]

    def after_step(self, step: int, state, train_it, last: bool) -> Optional[str]:
        if step % self.cfg.distill.eval_every and not last:
            return None
        dec = self.evaluate(step, state, train_it)
        if dec.stop:
            self.log.print(f"early stop at step {step}: {dec.reason}")
            return "early_stop"
        return None


def distill(cfg: Config, *, stream=None) -> DistillResult:
    """Run (or resume) FCSD as described by `cfg` (train.mode must be 'distill')."""
    t, d = cfg.train, cfg.distill
    if t.mode != "distill":
        raise ConfigError(f"train.mode={t.mode!r}: distill() runs train.mode=distill")
    if d.metric == "task" and not cfg.eval.tasks:
        raise ConfigError("distill.metric=task needs eval.tasks: [path/to/task.jsonl, ...]")
    check_source(cfg)  # the weights to convert come first: the checks below assume a source
    if d.export_hf and not cfg.init_from_hf and not d.export_family:
        raise ConfigError("distill.export_hf needs distill.export_family (an HF model_type such as qwen2_moe) when "
                          "the weights do not come from init_from_hf")
    export_dir = run_export_dir(d.export_hf, t.run_dir) if d.export_hf else None
    maybe_initialize(cfg.mesh)
    mesh = model_mesh(cfg)  # the FoE group x expert mesh when num_groups > 1 with EP
    check_host_memory(source_shape(cfg), "this FCSD run")  # before any weights are read
    cfg, graphdef, src = load_source(cfg, mesh)
    tokens_per_step = t.batch_size * t.seq_len
    max_steps = t.steps
    if d.max_tokens is not None:
        max_steps = min(max_steps, d.max_tokens // tokens_per_step)
    # everything that can be validated is, before the run folder is touched (see trainer.train)
    tok, train_ds, notes = train_data(cfg, f"the model to convert ({cfg.init_from_hf or cfg.distill.init_from_run})")
    first_batches(train_ds)
    val = val_batches(cfg, t.eval_batches, mesh=mesh, tokenizer=tok)
    plan, plan_reused, auto_request = None, False, None
    if cfg.farskip.layers == "auto":  # the budgeted set, chosen once and before anything is written
        auto_request = request_of(cfg)
        cfg, plan, plan_reused = resolve_auto_layers(cfg, graphdef, src, val, stream)
    task_score = None
    if d.metric == "task":
        for path in cfg.eval.tasks:  # missing or malformed task files fail now
            load_task(path)
        task_score = lambda st: float(np.mean([r["acc"] for r in score_tasks(
            graphdef, st, cfg.eval.tasks, tok, cfg.farskip).values()]))
    folder = check_folder(cfg)
    es_path = os.path.join(folder.path, "early_stopping.json")
    saved_es = None
    if folder.resume and os.path.isfile(es_path):  # read before anything is written
        with open(es_path) as f:
            saved_es = json.load(f)
    src = place_state(src, mesh)
    teacher = cast_state(src, dtype_of(d.teacher_dtype))  # a copy: the student's buffers are donated
    session = open_session(cfg, folder, mesh, lambda: nnx.merge(graphdef, src["params"], src["bias"], src["rest"]),
                           train_ds, notes, max_steps=max_steps, stream=stream)
    del src
    log, run_dir = session.log, session.run_dir
    es = EarlyStopper("max" if d.metric == "task" else "min", d.patience, d.max_drop)
    if saved_es is not None and session.start is not None:  # evaluations after the checkpoint will run again
        es.load_state_dict(saved_es, upto=session.start)
    best = Checkpointer(os.path.join(run_dir, "best"), keep=1, async_save=False)
    if plan is not None:
        if not plan_reused:
            write_plan(plan, run_dir, auto_request)
        for line in plan.lines():
            log.print(line)
        log.print(f"farskip.layers: auto -> {list(plan.layers)} ("
                  + ("the stored choice of this run folder, no new sweep" if plan_reused
                     else f"written to {os.path.join(run_dir, 'farskip_auto.json')}") + ")")
    task = DistillTask(session.graphdef, teacher, cfg, val, es, es_path, best, log, task_score, tokens_per_step)
    if t.resume_step is not None and session.start is not None:
        for line in task.drop_discarded_best(session.start, session.state, session.train_it.get_state()):
            log.print(line)
    if not session.start:
        task.evaluate(0, session.state, session.train_it)  # the converted model before any training
    res = session.run(task)
    status, step, evals = res.status, res.step, task.evals
    if status == "done" and max_steps < t.steps:
        status = "token_budget"
    session.close()
    kept = best.latest_step()  # the student best/ holds: what an export writes
    best.close()
    speed = (f"; mean {res.tokens_per_s:,.0f} tokens/s" + (f", MFU {100 * res.mfu:.1f}%" if res.mfu else "")
             if res.tokens_per_s else "")
    log.print(f"{status} at step {step}: best {d.metric} {es.best} at step {es.best_step} "
              f"({step * tokens_per_step:,} training tokens{speed})")
    if d.export_hf and status not in ("preempted", "time_limit", "diverged"):
        _, best_state = restore_train_state(cfg, os.path.join(run_dir, "best"), "best", mesh)
        other = "" if kept == es.best_step else f"; early stopping's best since the resume is step {es.best_step}"
        log.print(f"exported the best student (step {kept}, kept in best/{other}) to "
                  f"{export_student(cfg, graphdef, best_state, export_dir, kept)}")
    log.write("event", step, dict(status=status, best_step=es.best_step, best_metric=es.best))
    session.release()
    return DistillResult(status=status, step=step, best_step=es.best_step, best_metric=es.best,
                         tokens=step * tokens_per_step, run_dir=run_dir, evals=evals, losses=res.losses)
