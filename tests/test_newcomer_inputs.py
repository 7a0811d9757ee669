"""Bad input a newcomer gives, one clear error each: YAML files that set a key twice or nothing, the
train / eval ranges, HF config.json fields, eval.py's arguments, the analysis tools' arguments (checked
before anything compiles), the notebooks' library calls. Also: the overlap verdicts of a program
without all-to-alls, the memory plan's largest batch, the CPU matmul peak kept per machine, and the
paired differences of the ablation notebook against a hand computation."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import yaml

import eval as eval_entry
import train as train_entry
from cli_helpers import FAST, qwen3_hf, refused
from farskip_jax.config import config_from_dict, dump_config, load_config
from farskip_jax.errors import CheckpointError, ConfigError


def _one_error(capsys, main, argv, match, *watched) -> str:
    """main(argv) returns 2 and prints one `error:` line matching `match`; `watched` paths are unchanged."""
    before = {w: (os.path.exists(w), sorted(os.listdir(w)) if os.path.isdir(w) else None) for w in watched}
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[overlap]")]
    assert rc == 2, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert re.search(match, lines[0]), lines[0]
    assert before == {w: (os.path.exists(w), sorted(os.listdir(w)) if os.path.isdir(w) else None) for w in watched}
    return lines[0]


# ------------------------------------------------------------------------------------------------ YAML


def test_a_key_or_section_set_twice_in_one_file_is_named_with_its_lines(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("train:\n  steps: 100\n  lr: 1.0e-3\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\ntrain:\n  steps: 50\nmodel:\n  d_model: 64\ntrain:\n  run_dir: runs/x\n")
    with pytest.raises(ConfigError, match=r"child\.yaml: key 'train' is set twice \(lines 2 and 6\)"):
        load_config(str(child))
    child.write_text("base: base.yaml\ntrain:\n  steps: 50\n  lr: 3.0e-3\n  steps: 60\n")
    with pytest.raises(ConfigError, match=r"key 'train\.steps' is set twice \(lines 3 and 5\)"):
        load_config(str(child))
    # overriding through base: and the command line stays legitimate
    child.write_text("base: base.yaml\ntrain:\n  steps: 50\n")
    cfg = load_config(str(child), ["train.steps=70"])
    assert (cfg.train.steps, cfg.train.lr) == (70, pytest.approx(1e-3))


def test_empty_folder_and_base_mistakes(tmp_path):
    (tmp_path / "empty.yaml").write_text("# only a comment\n")
    with pytest.raises(ConfigError, match=r"empty\.yaml holds no settings"):
        load_config(str(tmp_path / "empty.yaml"))
    with pytest.raises(ConfigError, match=r"is a folder; pass a YAML file"):
        load_config(str(tmp_path))
    (tmp_path / "b3.yaml").write_text("base: 3\n")
    with pytest.raises(ConfigError, match=r"b3\.yaml: base=3 must name a YAML file"):
        load_config(str(tmp_path / "b3.yaml"))
    (tmp_path / "gone.yaml").write_text("base: nothere.yaml\n")
    with pytest.raises(ConfigError, match=r"gone\.yaml: base: nothere\.yaml does not exist"):
        load_config(str(tmp_path / "gone.yaml"))


def test_a_warmup_longer_than_the_run_is_refused_but_saved_runs_still_load():
    with pytest.raises(ConfigError, match=r"train\.warmup_steps=30 is longer than the run \(train\.steps=10\)"):
        load_config("configs/tiny.yaml", ["train.steps=10"])
    assert load_config("configs/tiny.yaml", ["train.steps=10", "train.warmup_steps=10"]).train.warmup_steps == 10
    # a run folder's config.yaml written before the check reads back (eval.py, resume)
    tree = yaml.safe_load(dump_config(load_config("configs/tiny.yaml", ["train.steps=40"])))
    tree["train"]["steps"] = 2
    assert config_from_dict(tree).train.steps == 2


@pytest.mark.parametrize("override, match", [
    ("train.min_lr_ratio=2", r"min_lr_ratio must be in \[0, 1\]"),
    ("train.b2=1.5", r"train\.b2 must be in \[0, 1\) \(AdamW moment decay\), got 1\.5"),
    ("train.warmup_steps=-5", r"warmup_steps must be >= 0"),
    ("train.eval_every=-1", r"eval_every must be >= 0"),
    ("train.checkpoint_every=-5", r"train\.checkpoint_every must be >= 0 \(the steps between checkpoints"),
    ("train.weight_decay=-1", r"weight_decay must be >= 0"),
    ("train.grad_clip=-1", r"grad_clip must be >= 0"),
    ("train.time_limit_s=0", r"time_limit_s must be > 0"),
    ("train.peak_flops=-1", r"peak_flops must be > 0"),
    ("train.seed=-1", r"train\.seed must be in \[0, 4294967296\)"),
    ("model.d_model=0", r"model\.d_model must be >= 1"),
    ("moe.expert_hidden=0", r"moe\.expert_hidden must be >= 1"),
    ("moe.num_shared_experts=-1", r"moe\.num_shared_experts must be >= 0"),
    ("data.max_docs=0", r"data\.max_docs must be >= 1 or null"),
    ("eval.top_p=0", r"eval\.top_p must be in \(0, 1\] .*, got 0\.0"),
    ("eval.top_p=1.5", r"eval\.top_p must be in \(0, 1\] .*, got 1\.5"),
    ("eval.temperature=-1", r"eval\.temperature must be >= 0 .*, got -1\.0"),
    ("eval.max_new_tokens=-5", r"eval\.max_new_tokens must be >= 1"),
    ("eval.batches=0", r"eval\.batches must be >= 1"),
])
def test_out_of_range_train_and_eval_values(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config("configs/tiny.yaml", [override])


def test_generate_refuses_what_cannot_be_sampled(tiny):
    from farskip_jax.serving.generate import generate

    _, model, _, _ = tiny
    for kw, match in ((dict(max_new_tokens=-1), "max_new_tokens=-1"), (dict(top_p=0.0, temperature=1.0), "top_p=0.0"),
                      (dict(top_p=1.5, temperature=1.0), "top_p=1.5"), (dict(temperature=-1.0), "temperature=-1.0")):
        with pytest.raises(ConfigError, match=match):
            generate(model, [[1, 2, 3]], **{"max_new_tokens": 2, **kw})


# ------------------------------------------------------------------------------------------------ HF config.json


def _hf_dicts() -> dict:
    import transformers

    small = dict(vocab_size=320, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=256)
    return {
        "qwen3_moe": transformers.Qwen3MoeConfig(**small, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                                                 moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
        "deepseek_v2": transformers.DeepseekV2Config(**small, num_key_value_heads=4, intermediate_size=48,
                                                     moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
                                                     num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
                                                     q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                                     v_head_dim=8),
        "mixtral": transformers.MixtralConfig(**small, num_key_value_heads=2, intermediate_size=48, num_local_experts=4,
                                              num_experts_per_tok=2),
    }


@pytest.mark.parametrize("family, change, match", [
    ("qwen3_moe", {"num_experts_per_tok": None}, r"has null for 'num_experts_per_tok'"),
    ("qwen3_moe", {"-num_experts_per_tok": 0}, r"lacks 'num_experts_per_tok', which a qwen3_moe config\.json must give"),
    ("qwen3_moe", {"-moe_intermediate_size": 0}, r"lacks 'moe_intermediate_size'"),
    ("qwen3_moe", {"-num_hidden_layers": 0}, r"lacks 'num_hidden_layers'"),
    ("qwen3_moe", {"num_hidden_layers": "3"}, r"'num_hidden_layers' is '3' \(a JSON string\), not an integer: write "
                                              r"it as the JSON number 3"),
    ("qwen3_moe", {"-num_experts": 0, "-num_local_experts": 0}, r"gives no routed-expert count"),
    ("deepseek_v2", {"-kv_lora_rank": 0}, r"lacks 'kv_lora_rank', which a deepseek_v2 config\.json must give"),
    ("mixtral", {"-num_local_experts": 0}, r"gives no routed-expert count"),
    ("mixtral", {"rms_norm_eps": "small"}, r"'rms_norm_eps' is 'small' \(a JSON string\), not a number"),
    ("mixtral", {"hidden_size": 0}, r"'hidden_size' is 0, must be >= 1"),
])
def test_hf_config_json_fields_are_named(family, change, match):
    from farskip_jax.loading.hf_folder import import_config

    hf = _hf_dicts()[family].to_dict()
    assert import_config(dict(hf))[0].moe.num_experts == 4  # the intact config reads
    for k, v in change.items():
        if k.startswith("-"):
            hf.pop(k[1:], None)
        else:
            hf[k] = v
    with pytest.raises(CheckpointError, match=match):
        import_config(hf, source="/models/x")


def test_a_broken_config_json_is_one_error_for_import_eval_and_init_from_hf(tmp_path, capsys):
    hf = qwen3_hf(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    del cfg["num_experts_per_tok"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    want = r"config\.json lacks 'num_experts_per_tok'"
    refused(["-m", "farskip_jax.convert", "import", hf, str(tmp_path / "imp")], want, str(tmp_path / "imp"))
    _one_error(capsys, eval_entry.main, ["--hf", hf, "--mode", "loss"], want)
    run = str(tmp_path / "run")
    _one_error(capsys, train_entry.main, ["--config", "configs/tiny.yaml", f"init_from_hf={hf}", f"train.run_dir={run}",
                                          *FAST], want, run)


# ------------------------------------------------------------------------------------------------ eval.py


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two run folders of the tiny config (2 and 3 layers) holding only their config.yaml: every check
    below must refuse before any checkpoint is looked for (reaching one would say "no checkpoints")."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for layers in (2, 3):
        out[layers] = str(root / f"l{layers}")
        os.makedirs(out[layers])
        cfg = load_config("configs/tiny.yaml", [*FAST, f"model.num_layers={layers}", f"train.run_dir={out[layers]}"])
        with open(os.path.join(out[layers], "config.yaml"), "w") as f:
            f.write(dump_config(cfg))
    return out


@pytest.mark.parametrize("extra, match", [
    (["--mode", "generate", "--prompt", "x", "eval.max_new_tokens=-5"], r"eval\.max_new_tokens must be >= 1"),
    (["--mode", "generate", "--prompt", "x", "eval.temperature=1", "eval.top_p=0"], r"eval\.top_p must be in \(0, 1\] .*got 0\.0"),
    (["--mode", "generate", "--prompt", "x", "eval.top_p=["], r"eval\.top_p='\[' must be a number"),
    (["--mode", "loss", "--batches", "-3"], r"--batches -3 must be >= 1"),
    (["--mode", "loss", "--which", "bestt"], r"--which 'bestt': use latest, best .* or a step number"),
    (["--mode", "loss", "--prompt", "hi"], r"--prompt is read by --mode generate only"),
    (["--mode", "loss", "--teacher-run", "RUN3"], r"--teacher-run is read by --mode compare only"),
    (["--mode", "compare", "--teacher-run", "RUN3"], r"holds another architecture .* model\.num_layers 2 vs 3"),
    (["--mode", "loss", "--out", "FILE"], r"--out .* is a file; name a folder"),
])
def test_eval_arguments_are_checked_before_anything_runs(runs, tmp_path, capsys, extra, match):
    f = tmp_path / "a_file"
    f.write_text("mine")
    extra = [{"RUN3": runs[3], "FILE": str(f)}.get(x, x) for x in extra]
    _one_error(capsys, eval_entry.main, ["--run", runs[2], *extra], match, runs[2], str(tmp_path))
    assert f.read_text() == "mine"


def test_fcsd_without_weights_names_the_weights_first(tmp_path, capsys):
    run = str(tmp_path / "d")
    _one_error(capsys, train_entry.main, ["--config", "configs/distill_tiny.yaml", "distill.init_from_run=null",
                                          "distill.export_hf=hf", f"train.run_dir={run}", *FAST],
               r"train\.mode=distill needs the weights to convert: set init_from_hf", run)


# ------------------------------------------------------------------------------------------------ analysis tools


@pytest.mark.parametrize("args, match", [
    (["--seq", "-5"], r"--seq -5 must be >= 1"),
    (["--batch", "0"], r"--batch 0 must be >= 1"),
    (["--sweep-bw", "abc"], r"--sweep-bw: 'abc' is not a number"),
    (["--out", "FILE"], r"--out .* is a file, not a folder"),
    (["--presets", "standard,farskp"], r"--presets: unknown \['farskp'\]"),
    (["--xla", "foo"], r"--xla 'foo' must look like FLAG=VALUE"),
    (["--presets", "farskip", "--sweep-bw", "50"], r"--sweep-bw compares farskip with standard"),
])
def test_overlap_arguments_fail_before_any_compile(tmp_path, capsys, args, match):
    from farskip_jax.analysis import overlap

    f = tmp_path / "report"
    f.write_text("mine")
    args = [str(f) if a == "FILE" else a for a in args]
    _one_error(capsys, overlap.main, ["--config", "configs/tiny.yaml", "--programs", "forward", *args], match,
               str(tmp_path))
    assert f.read_text() == "mine"


def test_overlap_verdicts_without_all_to_alls_are_not_applicable():
    from farskip_jax.analysis.hlo import HloOp, Schedule
    from farskip_jax.analysis.overlap import target_lines
    from farskip_jax.analysis.report import analyze

    def compute_only(t):
        op = HloOp(id=1, name="x", opcode="fusion", op_name="jit(f)/layer_0/attention/dot", operands=(), kind="compute",
                   collective=None, in_bytes=1000, out_bytes=1000, flops=0.0, start=0.0, end=t, index=0)
        return analyze(Schedule(ops=[op], by_id={1: op}, pairs=[]), durations=[], label="x")

    lines = target_lines({"standard": compute_only(13.0), "farskip": compute_only(10.0)})
    assert len(lines) == 1 and lines[0].startswith("N/A farskip: the program holds no all-to-all"), lines
    assert "1.300x" in lines[0] and "mesh.expert=8" in lines[0]
    assert not any(ln.startswith(("PASS", "FAIL")) for ln in lines)


@pytest.mark.parametrize("args, match", [
    (["--usable", "2"], r"--usable 2\.0 must be a fraction of device memory in \(0, 1\]"),
    (["--batches", "1,x"], r"--batches '1,x': 'x' is not an integer"),
    (["--batches", "1"], r"--batches '1' must name two different per-device batches"),
    (["--top", "-1"], r"--top -1 must be >= 0"),
    (["--out", "DIR"], r"--out .* is a folder; name the JSON file"),
    (["--cache", "FILE"], r"--cache .* is not a cache of compiled points"),
    (["--read-cache", "MISSING"], r"--read-cache .* does not exist"),
])
def test_memory_plan_arguments_fail_before_any_compile(tmp_path, capsys, args, match):
    from farskip_jax.analysis import memory

    f = tmp_path / "notes.txt"
    f.write_text("mine")
    args = [{"DIR": str(tmp_path), "FILE": str(f), "MISSING": str(tmp_path / "no.json")}.get(a, a) for a in args]
    _one_error(capsys, memory.main, ["--config", "configs/tiny.yaml", "--mode", "pretrain", *args], match, str(tmp_path))
    assert f.read_text() == "mine"


def test_largest_batch_that_fits_is_not_capped():
    from farskip_jax.analysis.memory import Row, TempModel

    fit = TempModel(p0=0.0, p1=0.0, o0=0.0, o1=0.0, s0=1000.0, s1=0.0, active=2, inplace=True)
    row = Row("pretrain", "none", 1, {"params": 1e6, "optimizer": 2e6, "batch": 24.0}, fit, 0, 2, 16, 8)
    cap = 10e6
    b = row.max_batch(cap)
    assert b > 4096 and row.peak(b) <= cap < row.peak(b + 1)


# ------------------------------------------------------------------------------------------------ MFU peak, notebooks


def test_the_cpu_matmul_peak_is_measured_once_per_machine(tmp_path, monkeypatch):
    import jax.numpy as jnp

    from farskip_jax.train import flops

    calls = []
    monkeypatch.setattr(flops, "measure_matmul_peak", lambda dtype, seconds: calls.append(seconds) or 5e10)
    peak, where = flops.cpu_matmul_peak(jnp.float32, str(tmp_path))
    assert (peak, calls) == (5e10, [2.0]) and "measured now and kept" in where
    again, where = flops.cpu_matmul_peak(jnp.float32, str(tmp_path))
    assert again == 5e10 and calls == [2.0] and "measured once on this machine" in where
    table = json.loads((tmp_path / "matmul_peak.json").read_text())
    assert list(table) == [flops.machine_key(jnp.float32)]
    (tmp_path / "matmul_peak.json").write_text("not json")  # not ours to overwrite
    flops.cpu_matmul_peak(jnp.float32, str(tmp_path))
    assert (tmp_path / "matmul_peak.json").read_text() == "not json" and len(calls) == 2


def _record(variant, seed, loss, steps=(10, 20)):
    from farskip_jax.experiments.ablation import RunRecord

    return RunRecord(variant, seed, "", list(steps), [loss + 1.0, loss], loss, loss, 1.0, "done", 1.0)


def test_paired_differences_against_a_hand_computation():
    from farskip_jax.experiments.ablation import paired_differences

    std = {0: 3.0, 1: 3.5, 2: 2.5, 3: 3.1}
    recs = [_record("standard", s, v) for s, v in std.items()]
    recs += [_record("farskip", s, std[s] + d) for s, d in zip((0, 1, 2), (0.1, 0.2, 0.3))]  # seed 3: unpaired
    (p,) = paired_differences(recs)
    assert p.seeds == (0, 1, 2) and p.diffs == pytest.approx((0.1, 0.2, 0.3))
    assert p.mean == pytest.approx(0.2, rel=1e-12) and p.sd == pytest.approx(0.1, rel=1e-12)
    # t quantiles with 2 degrees of freedom: 0.975 -> 4.302653, 0.8 -> 1.060660
    half = 4.302652729749464 * 0.1 / math.sqrt(3)
    assert p.ci == pytest.approx((0.2 - half, 0.2 + half), rel=1e-9)
    assert p.detectable == pytest.approx((4.302652729749464 + 1.0606601717798212) * 0.1 / math.sqrt(3), rel=1e-9)
    assert p.rel_mean == pytest.approx(0.2 / 3.0) and not p.resolved
    with pytest.raises(ConfigError, match="no run of the reference variant 'standard'"):
        paired_differences([r for r in recs if r.variant != "standard"])
    with pytest.raises(ConfigError, match="no pair"):
        paired_differences(recs[:2] + [_record("farskip", 7, 3.0)])


def test_ablation_and_overlap_helpers_refuse_what_they_cannot_run(tmp_path):
    from farskip_jax.analysis.overlap import run_overlap
    from farskip_jax.experiments.ablation import run_ablation, variants_by_name

    base = load_config("configs/tiny.yaml", ["train.steps=1", "train.warmup_steps=0"])
    with pytest.raises(ConfigError, match=r"seed\(s\) \[0\] given twice"):
        run_ablation(base, variants_by_name(["standard"]), [0, 0], str(tmp_path / "abl"))
    with pytest.raises(ConfigError, match=r"variant\(s\) \['farskip'\] given twice"):
        run_ablation(base, variants_by_name(["farskip", "farskip"]), [0], str(tmp_path / "abl"))
    assert not (tmp_path / "abl").exists()
    with pytest.raises(ConfigError, match=r"programs \['backward'\] are unknown"):
        run_overlap(base, ("standard",), ("backward",))


def test_zoom_shows_the_last_part_of_training_on_both_axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from farskip_jax.experiments.plots import plot_val_curves, zoom_last

    recs = [_record("standard", 0, 3.0, steps=(100, 200, 300, 400))]
    recs[0].val_loss = [6.0, 4.0, 3.2, 3.0]
    fig, ax = plt.subplots()
    plot_val_curves(recs, ax=ax)
    zoom_last(ax, recs, frac=0.5, pad=0.0)
    assert ax.get_xlim() == pytest.approx((200.0, 400.0)) and ax.get_ylim() == pytest.approx((3.0, 4.0))
    plt.close(fig)
