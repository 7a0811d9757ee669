"""farskip.layers: auto (budgeted conversion, fcsd/planner.py).

The choice rule against hand-computed sweep rows; the freed-all-to-all count against docs/design.md
section 1 by hand; config errors name the key; an unresolved `auto` never reaches a model; the
default retention covers every plain-FCSD run recorded at 5%; in the loop: a budget nothing fits
fails before the run folder exists, the chosen set trains exactly as the explicit list would, and a
preempted run resumes with its stored choice (no new sweep) bit for bit.
"""

import io
import json
import os

import pytest

from run_helpers import SigtermAt, write_scaled_teacher

from farskip_jax.config import FarSkipConfig, ModelConfig, load_config
from farskip_jax.errors import ConfigError
from farskip_jax.fcsd.planner import (DEFAULT_RETENTION, Candidate, apply_choice, choose,
                                     overlap_estimate)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _c(name, layers, gap, freed):
    return Candidate(name, tuple(layers), val_loss=1.0 + gap, teacher_loss=1.0, kl=0.0, top1=1.0, freed=freed)


# ----------------------------------------------------------------------------------------------
# the rule, by hand
# ----------------------------------------------------------------------------------------------

# a 4-layer all-MoE model, farskip preset: freed = dispatches of converted layers + combines of layers
# whose next layer is converted (last:2 = {2, 3}: d2 d3 c1 c2 = 4; all: 4 dispatches + c0 c1 c2 = 7)
ROWS = [_c("last:1", [3], 0.010, 2), _c("last:2", [2, 3], 0.030, 4), _c("last:3", [1, 2, 3], 0.080, 6),
        _c("last:4", [0, 1, 2, 3], 0.150, 7), _c("first:1", [0], 0.040, 1), _c("first:2", [0, 1], 0.070, 3),
        _c("first:3", [0, 1, 2], 0.120, 5)]


@pytest.mark.parametrize("budget,retention,expected", [
    (0.01, 0.41, "last:1"),    # predicted 0.41 x gap: last:1 0.41% fits; last:2 1.23%, first:1 1.64% do not
    (0.02, 0.41, "last:2"),    # last:2 1.23% and first:1 1.64% fit: last:2 frees 4 > 1
    (0.04, 0.41, "last:3"),    # last:3 3.28% (6 freed) fits; first:3 4.92% and last:4 6.15% do not
    (0.07, 0.41, "last:4"),    # everything fits: the most freed
    (0.031, 1.0, "last:2"),    # retention 1: the untrained gap itself; first:1 (4%) over
    (0.045, 1.0, "last:2"),    # first:1 fits too but frees 1 < 4
])
def test_choice_rule_on_hand_rows(budget, retention, expected):
    assert choose(ROWS, budget, retention).name == expected


def test_choice_ties_break_on_gap_then_size_and_none_fitting_names_the_fix():
    rows = [_c("a", [1, 2], 0.02, 3), _c("b", [0, 2], 0.01, 3), _c("c", [0, 1, 2], 0.01, 3), _c("d", [2], -0.01, 2)]
    assert choose(rows, 0.05, 1.0).name == "b"  # same freed: lower gap, then fewer layers
    assert choose(rows, 0.005, 1.0).name == "d"  # a negative gap predicts 0
    with pytest.raises(ConfigError, match=r"auto_budget=0.001: no candidate set fits; the cheapest, last:1 .*"
                                          r"at least 0.0041"):
        choose(ROWS, 0.001, 0.41)
    with pytest.raises(ConfigError, match="frees an all-to-all"):
        choose([_c("first:1", [0], 0.0, 0)], 0.01, 1.0)  # a dense layer alone buys nothing


def test_freed_all_to_alls_by_hand():
    m = ModelConfig(num_layers=4)
    fs = lambda layers, preset="farskip": FarSkipConfig(preset=preset, layers=layers)  # noqa: E731
    assert overlap_estimate(m, fs((2, 3)))["freed"] == 4
    assert overlap_estimate(m, fs((3,)))["freed"] == 2  # d3 + c2; the last combine gates the final norm
    o = overlap_estimate(m, fs("all"))
    assert (o["freed"], o["total"], o["converted_moe"]) == (7, 8, 4) and o["share"] == pytest.approx(7 / 8)
    assert o["hidden_fwd_est"] == pytest.approx(0.968)  # every layer: docs/overlap.md's farskip figure
    half = overlap_estimate(m, fs((2, 3)))
    assert half["hidden_fwd_est"] == pytest.approx(0.432 + 4 / 7 * (0.968 - 0.432))
    assert overlap_estimate(m, fs("all", "attn_only"))["freed"] == 3  # combines only
    assert overlap_estimate(m, fs("all", "mlp_only"))["freed"] == 4  # dispatches only
    dense0 = ModelConfig(num_layers=4, first_k_dense=1)  # DeepSeek-V2-style: layer 0 has nothing routed
    assert overlap_estimate(dense0, fs((0,)))["freed"] == 0
    assert overlap_estimate(dense0, fs((1,)))["freed"] == 1  # d1; attention 1 never waited for a combine
    assert overlap_estimate(dense0, fs("all"))["total"] == 6


def test_default_retention_covers_every_recorded_5pct_run():
    from farskip_jax.studies.fcsd_evidence import measured_pairs

    pairs = [p for p in measured_pairs(os.path.join(ROOT, "benchmarks", "results", "fcsd")) if p["budget"] == 0.05]
    assert len(pairs) >= 10 and any(p["layers"] == "partial" for p in pairs)  # hard/auto's chosen sets count
    assert max(p["retention"] for p in pairs) <= DEFAULT_RETENTION < max(p["retention"] for p in pairs) + 0.01


# ----------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override,needle", [
    (["farskip.layers=auto"], "needs distill.auto_budget"),
    (["farskip.layers=auto", "distill.auto_budget=0"], "auto_budget must be"),
    (["farskip.layers=auto", "distill.auto_budget=1.5"], "auto_budget must be"),
    (["farskip.layers=auto", "distill.auto_budget=0.01", "distill.auto_retention=0"], "auto_retention must be"),
    (["distill.auto_budget=0.01"], "only applies to farskip.layers: auto"),
    (["distill.auto_search=greedy"], "only applies to farskip.layers: auto"),
    (["farskip.layers=auto", "distill.auto_budget=0.01", "farskip.preset=standard"], "preset is standard"),
    (["farskip.layers=auto", "distill.auto_budget=0.01", "train.mode=pretrain"], "train.mode: distill"),
    (["farskip.layers=auto", "distill.auto_budget=0.01", "distill.auto_search=greed"], "did you mean 'greedy'"),
])
def test_bad_settings_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config("configs/distill_tiny.yaml", override)


def test_unresolved_auto_never_reaches_a_model_and_the_resolved_config_is_a_list():
    cfg = load_config("configs/distill_tiny.yaml", ["farskip.layers=auto", "distill.auto_budget=0.02"])
    with pytest.raises(ConfigError, match="has not been resolved"):
        cfg.farskip.layer_inputs(0, 4)
    r = apply_choice(cfg, [3, 2])
    assert r.farskip.layers == (2, 3) and r.distill.auto_budget is None
    assert [r.farskip.layer_inputs(i, 4) for i in range(4)] == [("full", "full")] * 2 + [("partial", "outdated")] * 2


# ----------------------------------------------------------------------------------------------
# in the distillation loop
# ----------------------------------------------------------------------------------------------

TINY = ["model.d_model=32", "model.num_layers=3", "model.num_heads=2", "model.num_kv_heads=1", "model.mlp_hidden=64",
        "moe.num_experts=4", "moe.expert_hidden=32", "train.batch_size=8", "train.seq_len=32",
        "train.log_every=50", "train.tensorboard=false", "train.eval_batches=2", "mesh.data=-1"]


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    """An untrained tiny MoE (3 layers) with weights scaled up 2x: every conversion costs +0.2-0.8% in
    val loss (at 4x some convert below the teacher's loss: an untrained model's loss means little)."""
    return write_scaled_teacher(str(tmp_path_factory.mktemp("teacher")), TINY, 2.0)


def _cfg(teacher, run, *extra):
    return load_config("configs/distill_tiny.yaml", [
        *TINY, f"distill.init_from_run={teacher}", "train.steps=4", "distill.eval_every=2", "train.lr=3e-3",
        "train.warmup_steps=1", "train.log_every=1", "train.checkpoint_every=0", f"train.run_dir={run}", *extra])


def test_loop_nothing_fits_fails_before_the_run_folder(teacher_run, tmp_path):
    from farskip_jax.fcsd.distill import distill

    run = tmp_path / "none_fits"
    with pytest.raises(ConfigError, match="no candidate set fits"):
        distill(_cfg(teacher_run, str(run), "farskip.layers=auto", "distill.auto_budget=1e-6"), stream=io.StringIO())
    assert not run.exists()


def test_loop_auto_equals_the_explicit_list_and_resumes_with_its_choice(teacher_run, tmp_path):
    from farskip_jax.fcsd.planner import plan_conversion
    from farskip_jax.loading.load import read_run_config
    from farskip_jax.eval.metrics import cast_state, val_batches
    from farskip_jax.model.layers import dtype_of
    from farskip_jax.parallel.build import model_mesh
    from farskip_jax.fcsd.distill import distill, load_source
    from farskip_jax.train.logger import read_metrics

    # the sweep, then a budget (retention 1) between the candidates' gaps, and the expected choice by hand
    probe = _cfg(teacher_run, str(tmp_path / "probe"), "farskip.layers=auto", "distill.auto_budget=1.0",
                 "distill.auto_retention=1.0")
    pcfg, gd, src = load_source(probe, model_mesh(probe))
    val = val_batches(pcfg, pcfg.train.eval_batches)
    plan = plan_conversion(gd, src, pcfg, val, teacher=cast_state(src, dtype_of(pcfg.distill.teacher_dtype)),
                           stream=None)
    assert [c.name for c in plan.candidates] == ["last:1", "last:2", "last:3", "first:1", "first:2"]
    assert [c.freed for c in plan.candidates] == [2, 4, 5, 1, 3]
    gaps = sorted(c.gap for c in plan.candidates)
    assert gaps[0] > 0.001  # every conversion costs
    budget = (gaps[3] + gaps[4]) / 2  # the four cheapest sets fit, the dearest not
    fit = [c for c in plan.candidates if c.gap <= budget]
    assert len(fit) == 4
    expected = max(fit, key=lambda c: c.freed).layers
    assert len(expected) >= 2  # (last:2 here) a set of several layers, neither all nor the default
    auto = ("farskip.layers=auto", f"distill.auto_budget={budget}", "distill.auto_retention=1.0")

    straight, broken = str(tmp_path / "explicit"), str(tmp_path / "auto")
    a = distill(_cfg(teacher_run, straight, f"farskip.layers=[{','.join(map(str, expected))}]"), stream=io.StringIO())
    assert a.status == "done" and a.step == 4
    hook = SigtermAt(2)
    b = distill(_cfg(teacher_run, broken, *auto), stream=hook)
    assert hook.sent and b.status == "preempted" and b.step == 2
    text = "".join(hook.text)
    assert "[auto] last:1" in text and f"farskip.layers: auto -> {list(expected)}" in text
    with open(os.path.join(broken, "farskip_auto.json")) as f:
        stored = json.load(f)
    assert tuple(stored["layers"]) == expected and stored["request"]["auto_budget"] == budget
    assert os.path.isfile(os.path.join(broken, "farskip_auto.md"))
    assert read_run_config(broken).farskip.layers == expected  # the resolved config, what eval.py --run reads
    log = io.StringIO()
    c = distill(_cfg(teacher_run, broken, *auto), stream=log)
    assert c.status == "done" and c.step == 4
    assert "[auto]" not in log.getvalue() and "the stored choice of this run folder" in log.getvalue()
    ta, tb = ({r["step"]: r for r in read_metrics(d, "train")} for d in (straight, broken))
    for s in range(1, 5):  # auto (preempted + resumed) = the explicit list, bit for bit
        for k in ("loss", "kl", "grad_norm"):
            assert ta[s][k] == tb[s][k], (s, k)
    ea, eb = ({e["step"]: e for e in read_metrics(d, "eval")} for d in (straight, broken))
    assert sorted(ea) == sorted(eb) == [0, 2, 4]
    assert all(ea[s]["val_loss"] == eb[s]["val_loss"] for s in ea)
    chosen = next(x for x in plan.candidates if x.layers == expected)
    assert eb[0]["val_loss"] == pytest.approx(chosen.val_loss, rel=1e-6)  # the sweep row is step 0's evaluation
