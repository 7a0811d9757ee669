"""The jitted train / eval steps on a functional train state.

    graphdef, state = init_state(model, tx, seed)   # loading/train_state.py: the train state dict
    step_fn = make_train_step(graphdef, cfg, tx, schedule)   # make_step with the pretraining loss
    state, metrics = step_fn(state, batch)     # batch: dict of [global_batch, seq] arrays

Loss = token-mean cross entropy over `loss_mask` + runtime.aux_loss_weight * aux + runtime.z_loss_weight * z
(the cross entropy from full logits, or `train.loss_chunk` positions at a time: losses/chunked.py).
Gradient accumulation: the batch is cut into `train.grad_accum` micro-batches (lax.scan) and their
gradients averaged. A non-finite loss or gradient norm leaves params, optimizer and bias untouched.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from farskip_jax.config import Config
from farskip_jax.losses.chunked import chunked_ce
from farskip_jax.model.layers import dtype_of
from farskip_jax.losses.ce import token_ce
from farskip_jax.loading.train_state import init_state
from farskip_jax.model.router import RouterBias
from farskip_jax.parallel.build import create_model
from farskip_jax.parallel.sharding import state_shardings


def load_stats(load: jax.Array | None) -> dict:
    """Expert load [n_moe, E] (fractions) -> min/max relative to uniform (1.0 = balanced), entropy / log E."""
    if load is None:
        one = jnp.ones((), jnp.float32)
        return dict(load_min=one, load_max=one, load_entropy=one)
    e = load.shape[-1]
    ent = -jnp.sum(jnp.where(load > 0, load * jnp.log(jnp.maximum(load, 1e-30)), 0.0), axis=-1) / jnp.log(e)
    return dict(load_min=jnp.min(load) * e, load_max=jnp.max(load) * e, load_entropy=jnp.mean(ent))


def add_model_terms(loss: jax.Array, out, cfg: Config) -> tuple[jax.Array, dict]:
    """(loss + runtime.aux_loss_weight * aux + runtime.z_loss_weight * z, the model's metrics) of a forward's
    output, for every training loss: aux_loss, z_loss [], load [n_moe, E] ([0, 1] without MoE layers)
    and dropped [] (assignments dropped by capacity, fp32)."""
    loss = loss + cfg.runtime.aux_loss_weight * out.aux_loss + cfg.runtime.z_loss_weight * out.z_loss
    load = out.load if out.load is not None else jnp.zeros((0, 1), jnp.float32)
    return loss, dict(aux_loss=out.aux_loss, z_loss=out.z_loss, load=load, dropped=out.dropped.astype(jnp.float32))


def make_loss_fn(graphdef, cfg: Config, farskip=None) -> Callable:
    """loss_fn(params, bias, rest, batch) -> (loss, aux dict). With `train.loss_chunk` the model returns
    its final stream (logits=False) and the cross entropy is losses/chunked.chunked_ce over chunks of
    that many positions (same value and gradients; no [b, s, V] logits)."""
    chunk = cfg.train.loss_chunk or 0

    def loss_fn(params, bias, rest, batch):
        model = nnx.merge(graphdef, params, bias, rest)
        out = model(batch["tokens"], batch["positions"], batch["segment_ids"], farskip=farskip, logits=not chunk)
        if chunk:
            ce, n = chunked_ce(out.final, model.unembed(), batch["targets"], batch["loss_mask"], chunk=chunk,
                               compute_dtype=dtype_of(cfg.runtime.compute_dtype))
        else:
            ce, n = token_ce(out.logits, batch["targets"], batch["loss_mask"])
        loss, terms = add_model_terms(ce, out, cfg)
        return loss, dict(ce=ce, **terms, tokens=n)

    return loss_fn


def update_router_bias(graphdef, params, bias, rest, load: jax.Array, rate: float):
    """Aux-loss-free balancing (DeepSeek-V3): b_e += rate * sign(mean_load - load_e), per MoE layer.

    load: [n_moe, E] fractions of the step. Returns the new RouterBias state."""
    bias = jax.tree.map(lambda x: x, bias)  # fresh Variables: the caller's `bias` must stay untouched
    model = nnx.merge(graphdef, params, bias, rest)
    j = 0
    blocks = model.blocks()  # per-layer views under runtime.scan_layers, written back below
    for block in blocks:
        if not block.is_moe:
            continue
        r = block.moe.router
        if r.bias is not None:
            lj = load[j]
            r.bias[...] = r.bias[...] + rate * jnp.sign(jnp.mean(lj) - lj)
        j += 1
    model.write_blocks(blocks)
    return nnx.state(model, RouterBias)


def apply_if_finite(tx: optax.GradientTransformation, finite: jax.Array, grads, opt_state, params,
                    guard: str = "platform"):
    """(params, opt_state) after one optimizer update, or both unchanged when `finite` is False.
    guard: "platform" (below), or "cond" / "select" on every platform (benchmarks/optimizer_memory.py).

    Lowered per platform (`lax.platform_dependent`, decided by the compile target, so a deviceless GPU
    compile on a CPU machine gets the GPU form):
      - CPU: a lax.cond. A select of new vs old makes one more pass over every parameter and optimizer
        moment there (7.7% of a CPU step of a 25M-parameter MoE, measured); the cond costs nothing on
        the taken branch.
      - GPU / TPU: a select per leaf. XLA fuses it into the update, which then writes into the donated
        state; a cond's branch outputs cannot alias the donated inputs, so XLA:GPU builds a second
        copy of the parameters and both AdamW moments among the temporaries (3x the fp32 parameters:
        34.8 GiB per GPU of DeepSeek-V2-Lite at EP 8; `benchmarks/optimizer_memory.py`)."""
    def update(grads, opt_state, params):
        updates, new_opt = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt

    def by_cond(finite, grads, opt_state, params):
        return jax.lax.cond(finite, update, lambda g, o, p: (p, o), grads, opt_state, params)

    def by_select(finite, grads, opt_state, params):
        new = update(grads, opt_state, params)
        return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, (params, opt_state))

    if guard == "cond":
        return by_cond(finite, grads, opt_state, params)
    if guard == "select":
        return by_select(finite, grads, opt_state, params)
    return jax.lax.platform_dependent(finite, grads, opt_state, params, cpu=by_cond, default=by_select)


def accumulate_grads(grad_fn: Callable, batch: dict, accum: int, sum_keys: tuple[str, ...] = ("tokens",)):
    """((loss, aux), grads) of `grad_fn(batch)` computed as `accum` micro-batches along the batch axis
    (lax.scan; activation memory of one micro-batch).

    Each micro-batch is weighted by its loss-token count aux["tokens"], so loss, gradients and the
    other aux entries are full-batch token means whatever the padding; entries named in `sum_keys`
    (counts) are summed instead. grad_fn(batch) -> ((loss, aux dict), grads)."""
    if accum == 1:
        return grad_fn(batch)
    micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)

    def body(carry, mb):
        (l, a), g = grad_fn(mb)
        w = a["tokens"].astype(jnp.float32)
        gsum, lsum, asum = carry
        a = {k: v if k in sum_keys else w * v for k, v in a.items()}
        return (jax.tree.map(lambda s, x: s + w * x, gsum, g), lsum + w * l, jax.tree.map(jnp.add, asum, a)), None

    (_, a0), g0 = jax.eval_shape(lambda: grad_fn(jax.tree.map(lambda x: x[0], micro)))
    zeros = lambda tree: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)  # noqa: E731
    (gsum, lsum, asum), _ = jax.lax.scan(body, (zeros(g0), jnp.zeros((), jnp.float32), zeros(a0)), micro)
    inv = 1.0 / jnp.maximum(asum["tokens"], 1.0)
    grads = jax.tree.map(lambda g, ref: (g * inv).astype(ref.dtype), gsum, g0)
    aux = {k: v if k in sum_keys else v * inv for k, v in asum.items()}
    return (lsum * inv, aux), grads


def update_state(graphdef, cfg: Config, tx: optax.GradientTransformation, state: dict, loss, grads, load):
    """The train state after one step: optimizer update and router-bias update (skipped when the loss
    or the gradient norm is not finite), step and non-finite counters.

    load: [n_moe, E] expert load of the step. -> (new_state, dict(grad_norm, finite, nonfinite_total,
    nonfinite_streak)) for the metrics."""
    params, bias, rest = state["params"], state["bias"], state["rest"]
    gnorm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
    new_params, new_opt = apply_if_finite(tx, finite, grads, state["opt"], params)
    new_bias = bias
    if cfg.moe.num_experts and cfg.moe.selection_bias and load.shape[0] > 0:
        moved = update_router_bias(graphdef, params, bias, rest, load, cfg.runtime.bias_update_rate)
        new_bias = jax.tree.map(lambda n, o: jnp.where(finite, n, o), moved, bias)
    streak = jnp.where(finite, 0, state["nonfinite_streak"] + 1).astype(jnp.int32)
    total = state["nonfinite_total"] + (~finite).astype(jnp.int32)
    new_state = dict(params=new_params, bias=new_bias, rest=rest, opt=new_opt, step=state["step"] + 1,
                     rng=state["rng"], nonfinite_total=total, nonfinite_streak=streak)
    return new_state, dict(grad_norm=gnorm, finite=finite, nonfinite_total=total, nonfinite_streak=streak)


def make_step(graphdef, cfg: Config, tx: optax.GradientTransformation, schedule: optax.Schedule,
              loss_fn: Callable) -> Callable:
    """The one train step of every task, un-jitted: step(state, batch, *frozen) -> (state, metrics).

    loss_fn(params, bias, rest, batch, *frozen) -> (loss, aux): aux holds `tokens` (loss tokens),
    `load` and `dropped` (add_model_terms) and the task's own metrics. `frozen` (FCSD: the teacher) is
    never differentiated nor updated. metrics = loss, the task's aux entries, lr, tokens, dropped,
    grad_norm / finite / non-finite counters (update_state) and the load statistics."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    accum = cfg.train.grad_accum

    def step(state, batch, *frozen):
        params, bias, rest = state["params"], state["bias"], state["rest"]
        (loss, aux), grads = accumulate_grads(lambda mb: grad_fn(params, bias, rest, mb, *frozen), batch, accum,
                                              sum_keys=("tokens", "dropped"))
        new_state, upd = update_state(graphdef, cfg, tx, state, loss, grads, aux["load"])
        own = {k: v for k, v in aux.items() if k not in ("load", "tokens", "dropped")}
        metrics = dict(loss=loss, **own, lr=schedule(state["step"]), tokens=aux["tokens"], dropped=aux["dropped"],
                       **upd, **load_stats(aux["load"] if aux["load"].shape[0] > 0 else None))
        return new_state, metrics

    return step


def make_train_step(graphdef, cfg: Config, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    farskip=None) -> Callable:
    """Un-jitted pretraining step(state, batch) -> (state, metrics): make_step with make_loss_fn."""
    return make_step(graphdef, cfg, tx, schedule, make_loss_fn(graphdef, cfg, farskip))


def make_eval_step(graphdef, cfg: Config, farskip=None) -> Callable:
    """eval_step(state, batch) -> dict(ce_sum, tokens) (sum so batches can be pooled)."""
    loss_fn = make_loss_fn(graphdef, cfg, farskip)

    def eval_step(state, batch):
        _, aux = loss_fn(state["params"], state["bias"], state["rest"], batch)
        return dict(ce_sum=aux["ce"] * aux["tokens"], tokens=aux["tokens"])

    return eval_step


def abstract_train_state(cfg: Config, mesh, tx: optax.GradientTransformation, seed: int = 0):
    """(graphdef, train state of ShapeDtypeStructs with their mesh shardings), allocating nothing.

    For compile-only checks of real shapes: `jax.jit(step).lower(abstract_state, abstract_batch)`.
    Params/bias/rest take the shardings of parallel.sharding.state_shardings; optimizer moments take
    those of their parameter; counters and the RNG are replicated."""
    box = {}

    def build():
        graphdef, state = init_state(create_model(cfg, mesh, seed=seed), tx, seed)
        box["graphdef"] = graphdef
        return state

    abstract = jax.eval_shape(build)
    rep = NamedSharding(mesh, PartitionSpec())

    def with_shardings(tree):
        shard_leaves = jax.tree.leaves(state_shardings(tree, mesh))
        leaves, treedef = jax.tree.flatten(tree)
        return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                                            for a, s in zip(leaves, shard_leaves)])

    params = with_shardings(abstract["params"])
    opt = optax.tree_map_params(tx, lambda a, p: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=p.sharding),
                                abstract["opt"], params,
                                transform_non_params=lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep))
    out = {k: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), v)
           for k, v in abstract.items() if k not in ("params", "opt", "bias", "rest")}
    out.update(params=params, opt=opt, bias=with_shardings(abstract["bias"]), rest=with_shardings(abstract["rest"]))
    return box["graphdef"], out
