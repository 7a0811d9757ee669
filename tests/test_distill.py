"""FCSD pieces: divergences, gradients only into the student, early stopping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from run_helpers import student_and_teacher, tiny_batch

from farskip_jax.config import Config, DistillConfig, FarSkipConfig, ModelConfig, MoEConfig, TrainConfig
from farskip_jax.losses.divergence import forward_kl, reverse_kl, token_divergence, topk_forward_kl
from farskip_jax.eval.metrics import cast_state
from farskip_jax.model.transformer import Transformer
from farskip_jax.fcsd.distill import make_distill_loss_fn, make_distill_step
from farskip_jax.fcsd.early_stopping import EarlyStopper
from farskip_jax.loading.optimizer import make_optimizer
from farskip_jax.loading.train_state import init_state


def test_kl_of_identical_distributions_is_zero():
    x = jax.random.normal(jax.random.key(0), (2, 3, 50)) * 3
    for kind in ("forward", "reverse", "both"):
        np.testing.assert_allclose(token_divergence(x, x, kind=kind, temperature=2.0), 0.0, atol=1e-6)
    np.testing.assert_allclose(topk_forward_kl(x, x, k=50), 0.0, atol=1e-6)


def test_kl_matches_numpy_definition():
    t = np.random.default_rng(0).normal(size=(1, 2, 7)) * 2
    s = np.random.default_rng(1).normal(size=(1, 2, 7)) * 2
    p = np.exp(t) / np.exp(t).sum(-1, keepdims=True)
    q = np.exp(s) / np.exp(s).sum(-1, keepdims=True)
    np.testing.assert_allclose(forward_kl(t, s), (p * np.log(p / q)).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(reverse_kl(t, s), (q * np.log(q / p)).sum(-1), rtol=1e-5)
    # temperature: T^2 * KL(softmax(t/T) || softmax(s/T))
    pT = np.exp(t / 2) / np.exp(t / 2).sum(-1, keepdims=True)
    qT = np.exp(s / 2) / np.exp(s / 2).sum(-1, keepdims=True)
    np.testing.assert_allclose(token_divergence(t, s, temperature=2.0), 4 * (pT * np.log(pT / qT)).sum(-1), rtol=1e-5)
    # top-k: the teacher's top 3 plus one tail bucket, both from the full softmax (tests/test_divergence.py)
    idx = np.argsort(-t, axis=-1)[..., :3]
    top = np.zeros(t.shape, bool)
    np.put_along_axis(top, idx, True, -1)
    pt, qt = np.where(top, 0, p).sum(-1), np.where(top, 0, q).sum(-1)
    ref = np.where(top, p * np.log(p / q), 0).sum(-1) + pt * np.log(pt / qt)
    np.testing.assert_allclose(topk_forward_kl(t, s, 3), ref, rtol=1e-5)
    assert np.all(np.asarray(topk_forward_kl(t, s, 3)) >= 0)


def tiny_cfg(**distill):
    return Config(model=ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, mlp_hidden=64,
                                    max_seq_len=16),
                  moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
                  farskip=FarSkipConfig(preset="farskip"),
                  train=TrainConfig(mode="distill", steps=10, batch_size=2, seq_len=16, lr=1e-2, warmup_steps=0),
                  distill=DistillConfig(teacher_dtype="float32", **distill))


def test_gradients_flow_only_into_the_student():
    cfg = tiny_cfg(hidden_weight=0.5, ce_weight=0.1)
    graphdef, state, teacher, _, _ = student_and_teacher(cfg)
    loss_fn = make_distill_loss_fn(graphdef, cfg)
    batch = tiny_batch()
    g_s, g_t = jax.grad(lambda p, tp: loss_fn(p, state["bias"], state["rest"], batch, dict(teacher, params=tp))[0],
                        argnums=(0, 1))(state["params"], teacher["params"])
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(g_t))
    assert sum(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(g_s)) >= len(jax.tree.leaves(g_s)) - 2
    # identical weights under standard connectivity: KL exactly 0 before any update
    cfg_std = tiny_cfg()
    from farskip_jax.config import replace

    cfg_std = replace(cfg_std, **{"farskip.preset": "standard"})
    loss, aux = make_distill_loss_fn(graphdef, cfg_std)(state["params"], state["bias"], state["rest"], batch, teacher)
    assert abs(float(aux["kl"])) < 1e-6


def test_distill_step_trains_student_and_leaves_teacher():
    cfg = tiny_cfg()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tx, schedule = make_optimizer(cfg.train)
    graphdef, state = init_state(model, tx, 0)
    # make the teacher sharper than the init so the student has something to learn
    state["params"] = jax.tree.map(lambda x: x * 3.0, state["params"])
    teacher = cast_state(state, jnp.float32)
    t_before = jax.tree.map(np.asarray, teacher["params"])
    step = jax.jit(make_distill_step(graphdef, cfg, tx, schedule), donate_argnums=0)
    batch = tiny_batch()
    kls = []
    for _ in range(8):
        state, m = step(state, batch, teacher)
        kls.append(float(m["kl"]))
    assert kls[-1] < 0.5 * kls[0], kls
    for a, b in zip(jax.tree.leaves(t_before), jax.tree.leaves(teacher["params"])):
        np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("remat", ["minimal", "full"])
def test_distill_step_under_remat_equals_no_remat(remat):
    """The frozen teacher goes into rematerialised blocks (configs/distill_hf.yaml uses remat=minimal):
    the loss and the student's gradient equal those without remat (fp32, 1e-5 of each leaf's largest
    entry), and one jitted step runs. The updated parameters are not compared: Adam's first update is
    lr * g / (|g| + eps), which turns a 1e-12 reordering difference of a near-zero gradient entry into a
    1e-6 parameter difference."""
    from farskip_jax.config import replace

    out = {}
    for r in ("none", remat):
        cfg = replace(tiny_cfg(), **{"runtime.remat": r})
        graphdef, state, teacher, tx, schedule = student_and_teacher(cfg)
        loss_fn = make_distill_loss_fn(graphdef, cfg)
        (loss, _), g = jax.jit(jax.value_and_grad(
            lambda p: loss_fn(p, state["bias"], state["rest"], tiny_batch(), teacher), has_aux=True))(state["params"])
        out[r] = (float(loss), jax.tree.leaves(jax.tree.map(np.asarray, g)))
        if r == remat:
            step = jax.jit(make_distill_step(graphdef, cfg, tx, schedule), donate_argnums=0)
            _, m = step(state, tiny_batch(), teacher)
            np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-5)
    np.testing.assert_allclose(out[remat][0], out["none"][0], rtol=1e-5)
    for a, b in zip(out[remat][1], out["none"][1]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(float(np.abs(b).max()), 1e-12))


def test_early_stopping_patience():
    es = EarlyStopper("min", patience=3, max_drop=0.0)
    seq = [1.0, 0.8, 0.7, 0.71, 0.705, 0.702]
    stops = [es.update(i, v) for i, v in enumerate(seq)]
    assert [d.improved for d in stops[:3]] == [True, True, True]
    assert [d.stop for d in stops] == [False] * 5 + [True]
    assert es.best == 0.7 and es.best_step == 2 and "patience" in stops[-1].reason


def test_early_stopping_resume_replays_history_up_to_the_checkpoint():
    """A resume from step 16 re-runs the evaluation at 24: its state is the one after step 16."""
    es = EarlyStopper("min", patience=2, max_drop=1.0)
    for step, v in [(0, 1.0), (8, 0.9), (16, 0.95), (24, 0.96)]:
        es.update(step, v)
    assert es.bad_evals == 2
    back = EarlyStopper("min", patience=2, max_drop=1.0)
    back.load_state_dict(es.state_dict(), upto=16)
    assert (back.best, back.best_step, back.bad_evals, len(back.history)) == (0.9, 8, 1, 3)
    dec = back.update(24, 0.96)  # the re-run evaluation counts once
    assert back.bad_evals == 2 and dec.stop
    full = EarlyStopper("min", patience=2, max_drop=1.0)
    full.load_state_dict(es.state_dict())
    assert (full.bad_evals, len(full.history)) == (2, 4)


def test_early_stopping_max_drop_and_max_mode():
    es = EarlyStopper("max", patience=100, max_drop=0.02)
    assert not es.update(0, 0.50).stop
    assert es.update(1, 0.60).improved
    assert not es.update(2, 0.595).stop  # 0.8% below the best
    d = es.update(3, 0.58)  # 3.3% below the best
    assert d.stop and "worse" in d.reason and es.best_step == 1
    es2 = EarlyStopper("min", patience=100, max_drop=0.02)
    es2.update(0, 1.0)
    assert es2.update(1, float("nan")).stop


@pytest.mark.extended  # the shared accumulate_grads is checked in the default run by test_train_step.py
def test_grad_accum_equals_the_full_batch_step():
    """train.grad_accum=2 (token-weighted micro-batches) gives the full-batch loss, gradient norm and
    update, with padding confined to one micro-batch (rows 0 and 1 hold 16 and 12 loss tokens)."""
    from farskip_jax.config import replace

    base = tiny_cfg(ce_weight=0.3)
    base = replace(base, **{"runtime.aux_loss_weight": 0.0})  # the balance loss is a per-batch statistic
    model = Transformer(base, rngs=nnx.Rngs(0))
    tx, schedule = make_optimizer(base.train)
    graphdef, state0 = init_state(model, tx, 0)
    state0["params"] = jax.tree.map(lambda x: x * 2.0, state0["params"])
    teacher = cast_state(state0, jnp.float32)
    batch = tiny_batch(3)
    out = {}
    for accum in (1, 2):
        cfg = replace(base, **{"train.grad_accum": accum})
        st = jax.tree.map(lambda x: jnp.array(x, copy=True), state0)
        st, m = jax.jit(make_distill_step(graphdef, cfg, tx, schedule))(st, batch, teacher)
        out[accum] = (st, jax.device_get(m))
    (s1, m1), (s2, m2) = out[1], out[2]
    for k in ("loss", "kl", "ce", "grad_norm", "tokens"):
        np.testing.assert_allclose(m2[k], m1[k], rtol=2e-5, err_msg=k)
    assert m1["tokens"] == 28.0 and m1["grad_norm"] > 0
    # the accumulated gradient itself, leaf by leaf (Adam's first update hides gradient scale)
    from farskip_jax.train.step import accumulate_grads

    loss_fn = make_distill_loss_fn(graphdef, base)
    gfn = jax.value_and_grad(loss_fn, has_aux=True)
    args = (state0["params"], state0["bias"], state0["rest"])
    (_, _), g_full = jax.jit(gfn)(*args, batch, teacher)
    (_, _), g_acc = jax.jit(lambda *a: accumulate_grads(lambda mb: gfn(*a, mb, teacher), batch, 2))(*args)
    for x, y in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_acc)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-7)
    # an unweighted mean of the two micro-batch means (what a naive accumulation does) is different
    halves = [jax.tree.map(lambda x: x[i:i + 1], batch) for i in (0, 1)]
    naive = np.mean([float(loss_fn(state0["params"], state0["bias"], state0["rest"], h, teacher)[0]) for h in halves])
    assert abs(naive - float(m1["loss"])) > 1e-4


def test_compare_fn_confidence_columns_match_numpy():
    """evaluate_pair's teacher max-probability, confident fraction and confident-only top-1 against numpy."""
    from farskip_jax.eval.metrics import evaluate_pair, forward, make_compare_fn

    cfg = tiny_cfg()
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    graphdef, state = init_state(model, make_optimizer(cfg.train)[0], 0)
    state["params"] = jax.tree.map(lambda x: x * 4.0, state["params"])  # sharper: some confident tokens
    batches = [tiny_batch(4), tiny_batch(5)]
    r = evaluate_pair(make_compare_fn(graphdef, cfg.farskip, confidence=0.2), state, state, batches)
    from farskip_jax.eval.metrics import STANDARD

    maxp, agree, mask = [], [], []
    for b in batches:
        t = np.asarray(forward(graphdef, state, b, STANDARD).logits, np.float64)
        s = np.asarray(forward(graphdef, state, b, cfg.farskip).logits, np.float64)
        p = np.exp(t - t.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        maxp.append(p.max(-1).ravel())
        agree.append((t.argmax(-1) == s.argmax(-1)).ravel())
        mask.append(np.asarray(b["loss_mask"]).ravel() > 0)
    maxp, agree, mask = map(np.concatenate, (maxp, agree, mask))
    conf = mask & (maxp >= 0.2)
    assert 0 < conf.sum() < mask.sum()
    np.testing.assert_allclose(r.teacher_maxp, maxp[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(r.confident, conf.sum() / mask.sum(), rtol=1e-6)
    np.testing.assert_allclose(r.top1_confident, agree[conf].mean(), rtol=1e-6)
    np.testing.assert_allclose(r.top1, agree[mask].mean(), rtol=1e-6)


def test_sweep_csv_round_trip(tmp_path):
    """farskip_jax/studies/fcsd_experiment.py --reuse-sweep reads back what write_csv wrote, with the same types."""
    from farskip_jax.eval.sweep import read_csv, write_csv

    rows = [dict(direction=d, layers=n, val_loss=1.5 + n / 7, ppl=4.5, teacher_loss=1.5, kl=n / 3, top1=1 - n / 9)
            for d in ("first", "last") for n in range(3)]
    assert read_csv(write_csv(rows, str(tmp_path / "sweep.csv"))) == rows


def test_fcsd_summary_table_and_plot(tmp_path):
    """farskip_jax/studies/fcsd_summary.py: one row per results*.json, recipe settings that differ from the plain
    recipe named (older recipe lines without hidden_weight / seed read as the defaults), plot written."""
    import json

    from farskip_jax.studies import fcsd_summary as mod

    old = "forward KL, T=1, ce_weight 0, top-k all, lr 0.00075 (warmup 60, cosine to x0.1), batch 2 x 128"
    new = ("reverse KL, T=1, ce_weight 0, hidden_weight 0.01, top-k all, lr 0.00075 (warmup 60, cosine to x0.1), "
           "batch 2 x 128, data-order seed 1")
    for name, recipe, tokens, after_loss in (("results.json", old, 100, 1.01), ("results_b.json", old, 200, 1.005),
                                              ("results_c.json", new, 100, 1.02)):
        (tmp_path / name).write_text(json.dumps(dict(
            recipe=recipe, fcsd_tokens=tokens, teacher_tokens=1000,
            table=[["teacher", 1.0, 1.0, 1.0, 0.0, 0], ["converted", 1.1, 0.8, 0.9, 0.1, 0],
                   ["after", after_loss, 0.9, 0.99, 0.03, tokens]])))
    assert mod.main([str(tmp_path)]) == 0
    table = (tmp_path / "summary.md").read_text().splitlines()
    assert len(table) == 5
    row = next(r for r in table if "results_c.json" in r)
    assert "kl reverse, hidden_weight 0.01, data-order seed 1" in row and "+2.00%" in row
    assert "| - |" in next(r for r in table if "results.json" in r)
    assert (tmp_path / "summary.png").stat().st_size > 0


def test_distill_refuses_a_teacher_of_another_tokenizer(tmp_path):
    """A run trained on BPE ids distilled on byte ids (distill_tiny.yaml's default data) would train the
    student on noise: load_source stops before anything loads, naming the teacher's tokenizer."""
    import yaml

    from farskip_jax.config import load_config, to_dict
    from farskip_jax.errors import ConfigError
    from farskip_jax.fcsd.distill import load_source

    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    run = tmp_path / "teacher"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config(None, [f"data.tokenizer={tok}"]))))
    cfg = load_config(None, ["train.mode=distill", f"distill.init_from_run={run}"])
    with pytest.raises(ConfigError, match=f"data.tokenizer={tok}"):
        load_source(cfg, None)


@pytest.mark.parametrize("kl,top_k", [("forward", 0), ("both", 0), ("forward", 5)])
def test_chunked_fcsd_loss_equals_the_full_logit_loss(kl, top_k):
    """train.loss_chunk = 5 (chunks of 5, 5, 5, 1 positions of 16): same loss, metrics and student
    gradients as the full logits (fp32), the teacher still without a gradient."""
    from farskip_jax.config import replace

    cfg = tiny_cfg(hidden_weight=0.5, ce_weight=0.3, kl=kl, top_k_logits=top_k, temperature=2.0)
    graphdef, state, teacher, _, _ = student_and_teacher(cfg)
    batch = dict(tiny_batch(), loss_mask=tiny_batch()["loss_mask"].at[0, :3].set(0.0))

    def run(c):
        fn = make_distill_loss_fn(graphdef, c)
        return jax.value_and_grad(lambda p, tp: fn(p, state["bias"], state["rest"], batch, dict(teacher, params=tp)),
                                  argnums=(0, 1), has_aux=True)(state["params"], teacher["params"])

    (l0, a0), (g0, t0) = run(cfg)
    (l1, a1), (g1, t1) = run(replace(cfg, **{"train.loss_chunk": 5}))
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    for k in ("kl", "ce", "hidden", "tokens"):
        np.testing.assert_allclose(float(a1[k]), float(a0[k]), rtol=1e-6, atol=1e-9)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(t1))
