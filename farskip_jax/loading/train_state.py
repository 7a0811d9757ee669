"""The train state a run folder's checkpoints hold, and a fresh one to train from or restore into.

    graphdef, state = init_state(model, tx, seed)     # tx: loading/optimizer.make_optimizer(cfg.train)
    graphdef, params, bias, rest = split_model(model)
    st = model_state(state)                           # {params, bias, rest}: what evaluation reads

Train state (a plain dict so checkpoints are a plain tree):
    params            nnx.State of nnx.Param (fp32 master weights; matmuls run in runtime.compute_dtype)
    bias              nnx.State of RouterBias (aux-loss-free selection bias; updated by the step, not by optax)
    rest              nnx.State of any other variables (carried unchanged)
    opt               optax state
    step              int32 []   number of steps taken (skipped non-finite steps included)
    rng               uint32 [2] PRNG key data (folded with the step for any stochastic op)
    nonfinite_total   int32 []   steps whose loss or gradient was not finite (update skipped)
    nonfinite_streak  int32 []   consecutive such steps up to now
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from farskip_jax.model.router import RouterBias


def split_model(model: nnx.Module):
    """-> graphdef, params, bias, rest."""
    return nnx.split(model, nnx.Param, RouterBias, ...)


def init_state(model: nnx.Module, tx: optax.GradientTransformation, seed: int) -> tuple[Any, dict]:
    """(graphdef, fresh train state) for `model`."""
    graphdef, params, bias, rest = split_model(model)
    state = dict(params=params, bias=bias, rest=rest, opt=tx.init(params), step=jnp.zeros((), jnp.int32),
                 rng=jax.random.key_data(jax.random.key(seed)), nonfinite_total=jnp.zeros((), jnp.int32),
                 nonfinite_streak=jnp.zeros((), jnp.int32))
    return graphdef, state


def model_state(st: dict) -> dict:
    """{params, bias, rest} of a train state (drops optimizer state and counters)."""
    return {k: st[k] for k in ("params", "bias", "rest")}
