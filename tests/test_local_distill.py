"""FCSD's local reconstruction term (train/local_distill.py, Transformer.teacher_forced).

Oracle: the FarSkip inputs of every layer rebuilt by hand from the teacher's recorded sub-block
outputs (DESIGN.md section 1: partial = embedding + sum_{j<k} (a_j + s_j) + sum_{j<k-1} r_j; MoE
outdated = R_{k-1}), each student sub-block called on them directly. fp32, rtol 1e-5.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from run_helpers import student_and_teacher, tiny_batch

from farskip_jax.config import Config, DistillConfig, FarSkipConfig, ModelConfig, MoEConfig, TrainConfig
from farskip_jax.errors import ConfigError
from farskip_jax.eval.metrics import STANDARD
from farskip_jax.model.transformer import Transformer
from farskip_jax.train.distill import make_distill_loss_fn, make_distill_step
from farskip_jax.train.local_distill import local_reconstruction, trace_arrays

FARSKIP = FarSkipConfig(preset="farskip")


def cfg_of(scan=False, remat="none", **distill):
    return Config(model=ModelConfig(vocab_size=64, d_model=32, num_layers=4, num_heads=2, num_kv_heads=1, mlp_hidden=64,
                                    max_seq_len=16, first_k_dense=1, scan_layers=scan, remat=remat),
                  moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32, num_shared_experts=1),
                  farskip=FARSKIP,
                  train=TrainConfig(mode="distill", steps=10, batch_size=2, seq_len=16, lr=3e-3, warmup_steps=0),
                  distill=DistillConfig(teacher_dtype="float32", **distill))


def perturbed(model, scale=0.05, seed=1):
    """The same model with every parameter moved a little (a 'student' that differs from the teacher)."""
    gd, params, rest = nnx.split(model, nnx.Param, ...)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params))))
    params = jax.tree.map(lambda p: p + scale * jax.random.normal(next(keys), p.shape, p.dtype), params)
    return nnx.merge(gd, params, rest)


def test_teacher_forced_inputs_match_the_algebra():
    cfg = cfg_of()
    teacher = Transformer(cfg, rngs=nnx.Rngs(0))
    student = perturbed(teacher)
    b = tiny_batch()
    tr = teacher(b["tokens"], b["positions"], b["segment_ids"], farskip=STANDARD, return_trace=True).trace
    outs = student.teacher_forced(trace_arrays(tr, jnp.float32), b["positions"], b["segment_ids"], farskip=FARSKIP)
    emb = tr[0]["attn_in"]
    zero = jnp.zeros_like(emb)
    s_of = lambda t: zero if t["shared"] is None else t["shared"]  # noqa: E731
    r_of = lambda t: zero if t["routed"] is None else t["routed"]  # noqa: E731
    for k, (blk, o) in enumerate(zip(student.layers, outs)):
        full_prev = emb + sum((tr[j]["attn"] + s_of(tr[j]) + r_of(tr[j]) for j in range(k)), zero)
        partial = emb + sum((tr[j]["attn"] + s_of(tr[j]) for j in range(k)), zero) + sum(
            (r_of(tr[j]) for j in range(k - 1)), zero)
        np.testing.assert_allclose(o.attn, blk.attention(partial, b["positions"], b["segment_ids"]), rtol=1e-5, atol=1e-6)
        ref = blk.ffn(full_prev)  # MoE input outdated: R_{k-1}, without the layer's own attention
        np.testing.assert_allclose(o.shared, ref.shared, rtol=1e-5, atol=1e-6)
        if ref.routed is not None:
            np.testing.assert_allclose(o.routed, ref.routed, rtol=1e-5, atol=1e-6)
    assert outs[0].routed is None and outs[1].routed is not None  # layer 0 dense


def test_standard_teacher_forcing_reproduces_the_teacher_and_the_term_is_zero():
    cfg = cfg_of()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    b = tiny_batch()
    tr = trace_arrays(model(b["tokens"], b["positions"], b["segment_ids"], farskip=STANDARD, return_trace=True).trace,
                      jnp.float32)
    same = model.teacher_forced(tr, b["positions"], b["segment_ids"], farskip=STANDARD)
    for t, o in zip(tr, same):
        np.testing.assert_allclose(o.attn, t["attn"], rtol=1e-5, atol=1e-6)
    assert float(local_reconstruction(tr, same, b["loss_mask"])) < 1e-10
    conv = model.teacher_forced(tr, b["positions"], b["segment_ids"], farskip=FARSKIP)
    assert float(local_reconstruction(tr, conv, b["loss_mask"])) > 1e-4  # FarSkip inputs differ


def test_local_term_value_matches_numpy_and_ignores_masked_tokens():
    cfg = cfg_of()
    teacher = Transformer(cfg, rngs=nnx.Rngs(0))
    student = perturbed(teacher)
    b = tiny_batch()
    tr = trace_arrays(teacher(b["tokens"], b["positions"], b["segment_ids"], farskip=STANDARD, return_trace=True).trace,
                      jnp.float32)
    outs = student.teacher_forced(tr, b["positions"], b["segment_ids"], farskip=FARSKIP)
    m = np.asarray(b["loss_mask"])[..., None]
    terms = []
    for t, o in zip(tr, outs):
        pairs = [(o.attn, t["attn"])]
        s_mlp = o.shared if o.routed is None else o.shared + o.routed
        t_mlp = t["shared"] if t["routed"] is None else t["shared"] + t["routed"]
        pairs.append((s_mlp, t_mlp))
        for s, tt in pairs:
            s, tt = np.asarray(s, np.float64), np.asarray(tt, np.float64)
            terms.append(((s - tt) ** 2 * m).sum() / (tt ** 2 * m).sum())
    np.testing.assert_allclose(float(local_reconstruction(tr, outs, b["loss_mask"])), np.mean(terms), rtol=1e-5)
    # a change at a masked position moves nothing
    outs2 = [o.replace(attn=o.attn.at[1, 13].add(5.0)) for o in outs]
    np.testing.assert_allclose(float(local_reconstruction(tr, outs2, b["loss_mask"])), np.mean(terms), rtol=1e-5)


def test_scanned_and_rematerialised_students_match_unrolled():
    b = tiny_batch()
    unrolled = Transformer(cfg_of(), rngs=nnx.Rngs(0))
    tr = trace_arrays(unrolled(b["tokens"], b["positions"], b["segment_ids"], farskip=STANDARD,
                               return_trace=True).trace, jnp.float32)
    u = unrolled.teacher_forced(tr, b["positions"], b["segment_ids"], farskip=FARSKIP)
    for cfg in (cfg_of(scan=True), cfg_of(remat="full")):
        other = Transformer(cfg, rngs=nnx.Rngs(0))
        o = other.teacher_forced(tr, b["positions"], b["segment_ids"], farskip=FARSKIP)
        for x, y in zip(u, o):
            np.testing.assert_allclose(x.attn, y.attn, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(x.shared, y.shared, rtol=1e-5, atol=1e-6)
        # gradients through the rematerialised / scanned layers equal the plain ones
        g = lambda m: nnx.grad(lambda mm: local_reconstruction(  # noqa: E731
            tr, mm.teacher_forced(tr, b["positions"], b["segment_ids"], farskip=FARSKIP), b["loss_mask"]))(m)
        gu, go = g(unrolled), g(other)
        nu = sum(float(jnp.sum(jnp.square(x))) for x in jax.tree.leaves(gu))
        no = sum(float(jnp.sum(jnp.square(x))) for x in jax.tree.leaves(go))
        np.testing.assert_allclose(no, nu, rtol=1e-4)


def test_distill_step_with_local_term_trains_the_student_only_and_lowers_it():
    cfg = cfg_of(local_weight=1.0, kl_weight=0.0)
    graphdef, state, teacher, tx, schedule = student_and_teacher(cfg)
    b = tiny_batch()
    loss_fn = make_distill_loss_fn(graphdef, cfg)
    g_s, g_t = jax.grad(lambda p, tp: loss_fn(p, state["bias"], state["rest"], dict(teacher, params=tp), b)[0],
                        argnums=(0, 1))(state["params"], teacher["params"])
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(g_t))
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(g_s))
    step = jax.jit(make_distill_step(graphdef, cfg, tx, schedule))
    first = None
    for _ in range(8):
        state, m = step(state, teacher, b)
        first = float(m["local"]) if first is None else first
    assert float(m["local"]) < 0.7 * first, (first, float(m["local"]))
    # the plain recipe reports the term as 0 and builds no teacher trace
    _, m0 = jax.jit(make_distill_step(graphdef, cfg_of(), tx, schedule))(state, teacher, b)
    assert float(m0["local"]) == 0.0


def test_local_weight_is_validated():
    with pytest.raises(ConfigError, match="local_weight"):
        DistillConfig(local_weight=-1.0)
    base = cfg_of(local_weight=1.0)
    with pytest.raises(ConfigError, match="local_weight.*Federation of Experts"):
        dataclasses.replace(base, model=dataclasses.replace(base.model, num_kv_heads=2),
                            moe=dataclasses.replace(base.moe, num_groups=2))
