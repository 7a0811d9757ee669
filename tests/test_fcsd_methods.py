"""FCSD conversion methods (issue 25): connectivity annealing and progressive conversion.

Model: `connectivity_mix` (alpha per layer) gives exactly the FarSkip model at alpha = 1 (bitwise),
the standard model at alpha = 0 (up to the order of a sum), and in between the streams of the
algebra "full stream minus alpha times what FarSkip removes" (rebuilt from a return_trace), with and
without model.scan_layers. Loop: alpha goes 0 -> 1 in the logs, evaluations report the alpha = 1
student, progressive stages run last layer first, resume is bit for bit, bad settings fail clearly.
"""

import io
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from run_helpers import SigtermAt, write_scaled_teacher

from farskip_jax.config import FarSkipConfig, load_config
from farskip_jax.errors import ConfigError
from farskip_jax.model import Transformer
from farskip_jax.train.annealing import ConversionSchedule, GatedStopper

TOL = dict(rtol=1e-5, atol=1e-5)
N_LAYERS = 3  # layer 0 dense, 1-2 MoE with a shared expert
CASES = {
    "farskip": dict(preset="farskip"),
    "attn_only": dict(preset="attn_only"),
    "mlp_only": dict(preset="mlp_only"),
    "outdated": dict(preset="farskip", attn_input="outdated"),
    "skip2": dict(preset="farskip", skip_distance=2),
    "last2_outdated": dict(preset="farskip", attn_input="outdated", layers="last:2"),  # layer 0 unconverted
}
MIXED = np.asarray([0.3, 0.6, 0.85], np.float32)


def _model_cfg(scan: bool):
    return load_config(None, ["model.vocab_size=64", "model.d_model=32", f"model.num_layers={N_LAYERS}",
                              "model.num_heads=4", "model.num_kv_heads=2", "model.mlp_hidden=64",
                              "model.first_k_dense=1", "model.init_std=0.15", "moe.num_experts=4", "moe.top_k=2",
                              "moe.expert_hidden=32", "moe.num_shared_experts=1",
                              f"model.scan_layers={'true' if scan else 'false'}"])


@pytest.fixture(scope="module")
def runs():
    """Per scan mode, fn(mix) -> {case: (FarSkip logits, mixed logits, trace of the mixed forward or
    None)} plus the standard logits: one compile per mode, any mix."""
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)
    out = {}
    for scan in (False, True):
        model = Transformer(_model_cfg(scan), rngs=nnx.Rngs(0))
        gd, st = nnx.split(model)

        def fn(st, mix, gd=gd, scan=scan):
            m = nnx.merge(gd, st)
            res = {"standard": m(tokens, farskip=FarSkipConfig()).logits}
            for name, case in CASES.items():
                fs = FarSkipConfig(**case)
                mixed = m(tokens, farskip=fs, connectivity_mix=mix, return_trace=not scan)
                trace = None if scan else [{k: t[k] for k in ("attn_in", "moe_in", "attn", "shared", "routed")}
                                           for t in mixed.trace]
                res[name] = (m(tokens, farskip=fs).logits, mixed.logits, trace)
            return res

        jfn = jax.jit(fn)
        emb = model.embed(tokens) if not scan else None
        out[scan] = (lambda mix, jfn=jfn, st=st: jfn(st, jnp.asarray(mix, jnp.float32)), emb, jfn)
    return out


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_alpha_one_is_farskip_bitwise_and_zero_is_standard(runs, scan):
    fn = runs[scan][0]
    ones, zeros = fn(np.ones(N_LAYERS)), fn(np.zeros(N_LAYERS))
    for name in CASES:
        farskip, mixed1, _ = ones[name]
        np.testing.assert_array_equal(np.asarray(mixed1), np.asarray(farskip), err_msg=f"{name}: alpha=1 != FarSkip")
        np.testing.assert_allclose(zeros[name][1], zeros["standard"], **TOL, err_msg=f"{name}: alpha=0 != standard")
        # the two endpoints are far apart, so neither check passes by accident
        assert float(jnp.abs(farskip - zeros["standard"]).max()) > 1e-2, name


def _expected(emb, trace, fs: FarSkipConfig, alpha):
    """(attn_in, moe_in) of each layer by the algebra: the full stream minus alpha times what FarSkip
    removes (partial: routed of the last d layers; outdated: shared + routed; MoE outdated: a_k)."""
    zero = jnp.zeros_like(emb)
    a = [t["attn"] for t in trace]
    s = [zero if t["shared"] is None else t["shared"] for t in trace]
    r = [zero if t["routed"] is None else t["routed"] for t in trace]
    out = []
    for k in range(len(trace)):
        full = emb + sum((a[j] + s[j] + r[j] for j in range(k)), zero)
        attn_kind, moe_kind = fs.layer_inputs(k, len(trace))
        recent = range(max(k - fs.skip_distance, 0), k)
        removed = {"full": zero, "partial": sum((r[j] for j in recent), zero),
                   "outdated": sum((s[j] + r[j] for j in recent), zero)}[attn_kind]
        x_attn = full - alpha[k] * removed if attn_kind != "full" else full
        x_moe = full + a[k] - (alpha[k] * a[k] if moe_kind == "outdated" else 0.0)
        out.append((x_attn, x_moe))
    return out


def test_per_layer_alpha_matches_the_algebra_and_scan_equals_loop(runs):
    loop_fn, emb, _ = runs[False]
    loop, scanned = loop_fn(MIXED), runs[True][0](MIXED)
    assert runs[False][2]._cache_size() == runs[True][2]._cache_size() == 1  # alpha is data: never recompiles
    for name, case in CASES.items():
        fs = FarSkipConfig(**case)
        _, logits, trace = loop[name]
        for k, (t, (x_attn, x_moe)) in enumerate(zip(trace, _expected(emb, trace, fs, MIXED))):
            np.testing.assert_allclose(t["attn_in"], x_attn, **TOL, err_msg=f"{name} layer {k} attention input")
            np.testing.assert_allclose(t["moe_in"], x_moe, **TOL, err_msg=f"{name} layer {k} MoE input")
        np.testing.assert_allclose(scanned[name][1], logits, **TOL, err_msg=f"{name}: scan != loop")
        # strictly between the endpoints
        assert float(jnp.abs(logits - loop[name][0]).max()) > 1e-3, name
    # the removed contributions are far above the tolerance
    tr = loop["skip2"][2]
    assert min(float(jnp.abs(t["routed"]).mean()) for t in tr if t["routed"] is not None) > 1e-2


def test_mix_shape_is_checked():
    model = Transformer(_model_cfg(False), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="connectivity_mix must have shape"):
        model(jnp.zeros((1, 4), jnp.int32), connectivity_mix=jnp.ones(N_LAYERS + 1))


# ----------------------------------------------------------------------------------------------
# the schedule (pure Python)
# ----------------------------------------------------------------------------------------------


def _sched_cfg(*extra, layers="all", preset="farskip", n=4):
    return load_config(None, [f"model.num_layers={n}", f"farskip.preset={preset}", f"farskip.layers={layers}",
                              "train.mode=distill", *extra])


def test_schedule_ramp_stages_settle_cap_and_resume():
    # 4 ramp updates (steps 0 -> 1 ... 3 -> 4) train at 1/4 ... 1; before any update alpha is 0
    lin = ConversionSchedule.from_config(_sched_cfg("distill.anneal=linear", "distill.anneal_tokens=40"), 10, 100)
    assert [lin.mean_alpha(s) for s in (-1, 0, 1, 2, 3, 9)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert lin.complete_step == 3 and not lin.counts(3) and lin.counts(4)
    cos = ConversionSchedule.from_config(_sched_cfg("distill.anneal=cosine", "distill.anneal_tokens=40"), 10, 100)
    np.testing.assert_allclose(cos.mean_alpha(1), 0.5, atol=1e-7)
    assert 0 < cos.mean_alpha(0) < 0.25 and cos.mean_alpha(3) == 1.0
    # progressive on layers 1, 2, 3 of 4 (layer 0 unconverted): stages 3, 2, 1; steps; cap 10 steps
    p = ConversionSchedule.from_config(_sched_cfg("distill.progressive=true", "distill.settle_rel=0.05",
                                                  "distill.stage_tokens=100", layers="last:3"), 10, 1000)
    assert p.stages == ((3,), (2,), (1,))
    np.testing.assert_array_equal(p.alpha(0), [1, 0, 0, 1])  # unconverted layer 0: 1 (ignored)
    assert not p.needs_stage_kl(0) and p.needs_stage_kl(4)
    assert p.observe(4, 1.0) is None  # first stage KL of the stage: nothing to compare with
    assert p.observe(6, 0.9) is None  # improved 10% >= 5%: not settled
    assert "stage 2/3 (layer 2)" in p.observe(8, 0.88)  # 2.2% < 5%: settled, next stage at step 8
    np.testing.assert_array_equal(p.alpha(8), [1, 0, 1, 1])
    assert p.stage_at(7) == 0 and p.stage_at(8) == 1 and p.complete_step is None and not p.counts(100)
    saved = p.state_dict()
    assert p.advance_to(17) == [] and "stage 3/3 (layer 1)" in p.advance_to(18)[0]  # the cap: 8 + 10
    assert p.starts == [0, 8, 18] and p.complete_step == 18 and p.counts(19) and not p.counts(18)
    np.testing.assert_array_equal(p.alpha(18), [1, 1, 1, 1])
    # resume: starts and stage KLs up to the checkpoint's step; the cap re-derived
    q = ConversionSchedule.from_config(_sched_cfg("distill.progressive=true", "distill.settle_rel=0.05",
                                                  "distill.stage_tokens=100", layers="last:3"), 10, 1000)
    q.load_state_dict(dict(saved, starts=[0, 8, 18], causes=["start", "settled", "stage_tokens"]), upto=7)
    assert q.starts == [0] and [x[0] for x in q.stage_kls] == [4, 6]
    q.load_state_dict(saved, upto=20)
    assert q.starts == [0, 8, 18]
    # progressive with a ramp per stage
    pr = ConversionSchedule.from_config(_sched_cfg("distill.progressive=true", "distill.anneal=linear",
                                                   "distill.anneal_tokens=20", "distill.stage_tokens=50"), 10, 1000)
    assert pr.alpha(0)[3] == 0.5 and pr.alpha(1)[3] == 1.0 and pr.alpha(1)[2] == 0.0
    assert not pr.needs_stage_kl(1) and pr.needs_stage_kl(2)
    assert pr.advance_to(5) and pr.alpha(5)[2] == 0.5 and pr.alpha(6)[2] == 1.0


def test_gated_stopper_counts_only_after_the_conversion():
    es = GatedStopper("min", patience=1, max_drop=0.01, counts=lambda s: s > 10)
    assert es.update(0, 5.0).improved
    assert not es.update(5, 9.0).stop  # worse and beyond max_drop, but during the conversion
    assert es.update(10, 4.0).improved and es.best_step == 10  # any evaluation is a FarSkip student: may be best
    assert es.update(15, 4.01).stop  # counted: patience 1 runs out
    es2 = GatedStopper("min", patience=1, max_drop=0.0, counts=lambda s: s > 10)
    es2.load_state_dict(es.state_dict(), upto=12)
    assert es2.best == 4.0 and es2.bad_evals == 0


@pytest.mark.parametrize("override,needle", [
    ("distill.anneal=exponential", "distill.anneal='exponential' is not allowed"),
    ("distill.anneal=linear", "distill.anneal=linear needs distill.anneal_tokens"),
    ("distill.anneal_tokens=-5", "distill.anneal_tokens must be >= 1"),
    ("distill.anneal_tokens=100", "distill.anneal_tokens=100 has no effect with distill.anneal: none"),
    ("distill.stage_tokens=100", "set distill.progressive: true"),
    ("distill.settle_rel=-1", "distill.settle_rel must be >= 0"),
])
def test_bad_settings_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        _sched_cfg(override)


def test_schedule_checks_against_the_model_and_budget():
    with pytest.raises(ConfigError, match="converts none of the 4 layers.*farskip.preset: farskip"):
        ConversionSchedule.from_config(_sched_cfg("distill.anneal=linear", "distill.anneal_tokens=10",
                                                  preset="standard"), 10, 100)
    with pytest.raises(ConfigError, match="converts none"):
        ConversionSchedule.from_config(_sched_cfg("distill.progressive=true", layers="none"), 10, 100)
    with pytest.raises(ConfigError, match="lower distill.anneal_tokens"):
        ConversionSchedule.from_config(_sched_cfg("distill.anneal=linear", "distill.anneal_tokens=2000"), 10, 100)
    with pytest.raises(ConfigError, match="distill.stage_tokens"):  # 3 caps of 40 steps do not fit in 100
        ConversionSchedule.from_config(_sched_cfg("distill.progressive=true", "distill.stage_tokens=400"), 10, 100)
    assert ConversionSchedule.from_config(_sched_cfg(), 10, 100) is None  # plain FCSD


# ----------------------------------------------------------------------------------------------
# the distillation loop
# ----------------------------------------------------------------------------------------------

TINY = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1", "model.mlp_hidden=64",
        "moe.num_experts=4", "moe.expert_hidden=32", "moe.shared_gate=true", "train.batch_size=8", "train.seq_len=32",
        "train.log_every=50", "train.tensorboard=false", "train.eval_batches=2", "mesh.data=-1"]
TPS = 8 * 32  # tokens per step


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    """A run folder holding an untrained tiny MoE with weights scaled up 4x (opinionated predictions,
    an untrained-conversion KL of ~2 nats): the mechanics need no trained teacher."""
    return write_scaled_teacher(str(tmp_path_factory.mktemp("teacher")), TINY, 4.0)


def _distill_cfg(teacher, run, *extra):
    return load_config("configs/distill_tiny.yaml", [*TINY, f"distill.init_from_run={teacher}", "train.steps=6",
                                                     "distill.eval_every=2", "train.lr=3e-3", "train.warmup_steps=1",
                                                     "train.log_every=1", "train.checkpoint_every=0",
                                                     f"train.run_dir={run}", *extra])


def test_anneal_loop_logs_alpha_and_evaluates_the_farskip_student(teacher_run, tmp_path):
    from farskip_jax.eval.loading import load_run
    from farskip_jax.eval.metrics import evaluate_pair, make_compare_fn, val_batches
    from farskip_jax.train.distill import distill, make_mix_kl_fn
    from farskip_jax.train.logger import read_metrics

    run = str(tmp_path / "anneal")
    log = io.StringIO()
    cfg = _distill_cfg(teacher_run, run, "distill.anneal=linear", f"distill.anneal_tokens={3 * TPS}",
                       "train.checkpoint_every=2", "train.keep_checkpoints=5")
    res = distill(cfg, stream=log)
    assert res.status == "done" and res.step == 6
    train = {r["step"]: r for r in read_metrics(run, "train")}
    np.testing.assert_allclose([train[s]["alpha"] for s in range(1, 7)], [1 / 3, 2 / 3, 1, 1, 1, 1], rtol=1e-6)
    assert train[3]["alpha"] == 1.0
    assert train[1]["kl"] < 0.2 * train[3]["kl"]  # the student starts near the teacher
    text = log.getvalue()
    assert "| alpha 0.333 |" in text and "| alpha 1.000 |" in text and "not counted (conversion in progress)" in text
    evals = {e["step"]: e for e in read_metrics(run, "eval")}
    assert sorted(evals) == [0, 2, 4, 6]
    assert [evals[s]["counted"] for s in sorted(evals)] == [False, False, True, True]
    assert evals[0]["alpha"] == 0.0 and evals[2]["alpha_layers"] == pytest.approx([2 / 3, 2 / 3])
    # evaluations report the alpha = 1 student: step 0 is the untrained FarSkip conversion (alpha 0 would be
    # the teacher, KL 0), and a mid-annealing checkpoint reproduces its logged KL at alpha 1, not at its alpha
    _, _, teacher = load_run(teacher_run, "latest")
    ck_cfg, graphdef, st = load_run(run, 2)
    val = val_batches(ck_cfg, 2)
    fs_fn, mix_fn = make_compare_fn(graphdef, ck_cfg.farskip), make_mix_kl_fn(graphdef, ck_cfg)
    np.testing.assert_allclose(evaluate_pair(fs_fn, teacher, teacher, val).kl, evals[0]["kl"], rtol=1e-4)
    assert evals[0]["kl"] > 1e-3
    np.testing.assert_allclose(evaluate_pair(fs_fn, st, teacher, val).kl, evals[2]["kl"], rtol=1e-4)
    mixed = [mix_fn(st, teacher, b, np.full(2, 2 / 3, np.float32)) for b in val]
    mixed_kl = sum(float(m["kl"]) for m in mixed) / sum(float(m["tokens"]) for m in mixed)
    assert abs(mixed_kl - evals[2]["kl"]) > 0.1 * evals[2]["kl"]
    assert "every converted layer trains at alpha 1 from update 3 on" in text


def test_progressive_stages_last_layer_first_and_resume_bit_for_bit(teacher_run, tmp_path):
    from farskip_jax.train.distill import distill
    from farskip_jax.train.logger import read_metrics

    extra = ("distill.progressive=true", "distill.settle_rel=10.0", f"distill.stage_tokens={5 * TPS}")
    straight, broken = str(tmp_path / "straight"), str(tmp_path / "broken")
    log = io.StringIO()
    a = distill(_distill_cfg(teacher_run, straight, *extra), stream=log)
    assert a.status == "done" and a.step == 6
    train = {r["step"]: r for r in read_metrics(straight, "train")}
    # stage 1 = the last layer (1); the stage KL is measured at evaluation 2, settled at 4 -> layer 0 from step 4
    assert [train[s]["stage"] for s in range(1, 7)] == [0, 0, 0, 0, 1, 1]
    assert [train[s]["alpha"] for s in range(1, 7)] == [0.5] * 4 + [1.0] * 2
    evals = {e["step"]: e for e in read_metrics(straight, "eval")}
    assert evals[2]["alpha_layers"] == [0.0, 1.0] and evals[6]["alpha_layers"] == [1.0, 1.0]
    assert "stage_kl" in evals[2] and "stage_kl" in evals[4] and "stage_kl" not in evals[6]
    assert [evals[s]["counted"] for s in sorted(evals)] == [False, False, False, True]
    assert "conversion stage 2/2 (layer 0) starts at step 4 (settled" in log.getvalue()
    with open(os.path.join(straight, "early_stopping.json")) as f:
        assert json.load(f)["conversion"]["starts"] == [0, 4]

    # SIGTERM after step 3 (the stage KL of step 2 saved, the settle at 4 not yet): the resumed run
    # decides the same stage start and repeats the straight run bit for bit
    hook = SigtermAt(3)
    b = distill(_distill_cfg(teacher_run, broken, *extra), stream=hook)
    assert hook.sent and b.status == "preempted" and b.step == 3
    c = distill(_distill_cfg(teacher_run, broken, *extra), stream=io.StringIO())
    assert c.status == "done" and c.step == 6
    tb = {r["step"]: r for r in read_metrics(broken, "train")}
    for s in range(1, 7):
        for k in ("loss", "kl", "alpha", "stage"):
            assert train[s][k] == tb[s][k], (s, k, train[s][k], tb[s][k])
    ea = {e["step"]: e["kl"] for e in a.evals}
    assert [e["step"] for e in c.evals] == [4, 6] and all(ea[e["step"]] == e["kl"] for e in c.evals)
    with open(os.path.join(broken, "early_stopping.json")) as f:
        assert json.load(f)["conversion"]["starts"] == [0, 4]


def test_distill_rejects_annealing_without_converted_layers(teacher_run, tmp_path):
    from farskip_jax.train.distill import distill

    run = tmp_path / "none"
    with pytest.raises(ConfigError, match="converts none of the 2 layers"):
        distill(_distill_cfg(teacher_run, str(run), "distill.anneal=cosine", f"distill.anneal_tokens={TPS}",
                             "farskip.layers=none"))
    assert not run.exists()  # nothing written
