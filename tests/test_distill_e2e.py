"""A tiny FCSD run end to end: pretrain a teacher (trainer), distill to FarSkip via train.py, check
the KL goes down, the best checkpoint is kept and loads, and (when the exporter exists) export."""

import json
import os

import numpy as np
import pytest
from run_helpers import SigtermAt

TINY = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1", "model.mlp_hidden=64",
        "moe.num_experts=4", "moe.expert_hidden=32", "moe.shared_gate=true", "train.batch_size=8", "train.seq_len=32", "train.log_every=50",
        "train.tensorboard=false", "train.eval_batches=2", "mesh.data=-1"]


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    import train as train_entry

    d = str(tmp_path_factory.mktemp("teacher"))
    rc = train_entry.main(["--config", "configs/tiny.yaml", *TINY, "train.steps=30", "train.eval_every=0", "train.lr=1e-2", "train.warmup_steps=3",
                           "train.checkpoint_every=0", f"train.run_dir={d}"])
    assert rc == 0
    return d


def test_distill_end_to_end(teacher_run, tmp_path):
    import train as train_entry
    from farskip_jax.loading.load import load_run
    from farskip_jax.train.logger import read_metrics

    run = str(tmp_path / "fcsd")
    export = str(tmp_path / "hf")
    rc = train_entry.main(["--config", "configs/distill_tiny.yaml", *TINY, f"distill.init_from_run={teacher_run}",
                           "train.steps=16", "distill.eval_every=8", "train.lr=3e-3", "train.warmup_steps=2",
                           f"train.run_dir={run}", f"distill.export_hf={export}", "distill.export_family=qwen2_moe"])
    assert rc == 0
    evals = read_metrics(run, "eval")
    assert [e["step"] for e in evals] == [0, 8, 16]
    assert evals[-1]["kl"] < 0.7 * evals[0]["kl"], evals  # distillation closes the gap
    assert evals[0]["kl"] > 1e-4  # converting changed the model
    np.testing.assert_allclose([e["teacher_loss"] for e in evals], evals[0]["teacher_loss"], rtol=1e-6)  # frozen
    assert evals[1]["kl"] < evals[0]["kl"] and evals[-1]["val_loss"] < evals[0]["val_loss"]  # on fixed val batches
    assert len(read_metrics(run, "train")) == 16
    with open(os.path.join(run, "early_stopping.json")) as f:
        es = json.load(f)
    best_step = es["best_step"]
    assert es["best"] == min(e["kl"] for e in evals)
    cfg, graphdef, st = load_run(run, "best")
    assert cfg.farskip.preset == "farskip" and cfg.model.d_model == 32
    # the restored best student reproduces the KL logged at its step
    from farskip_jax.eval.metrics import evaluate_pair, make_compare_fn, val_batches

    _, _, teacher = load_run(teacher_run, "latest")
    r = evaluate_pair(make_compare_fn(graphdef, cfg.farskip), st, teacher, val_batches(cfg, 2))
    logged = next(e for e in evals if e["step"] == best_step)
    np.testing.assert_allclose(r.kl, logged["kl"], rtol=1e-4)
    # the same through the eval.py command line
    import eval as eval_entry

    rc = eval_entry.main(["--run", run, "--which", "best", "--mode", "compare", "--teacher-run", teacher_run,
                          "--batches", "2", "--out", str(tmp_path / "ev")])
    assert rc == 0
    with open(tmp_path / "ev" / "results.json") as f:
        np.testing.assert_allclose(json.load(f)["kl"], logged["kl"], rtol=1e-4)
    with open(os.path.join(export, "config.json")) as f:
        hf = json.load(f)
    assert hf["model_type"] == "qwen2_moe" and hf["farskip_jax"]["preset"] == "farskip"
    from farskip_jax.loading.load import load_hf

    _, gd2, st2 = load_hf(export)  # the exported student re-imports to the same predictions
    from farskip_jax.eval.metrics import forward

    b = val_batches(cfg, 1)[0]
    np.testing.assert_allclose(forward(gd2, st2, b, cfg.farskip).logits, forward(graphdef, st, b, cfg.farskip).logits,
                               rtol=1e-5, atol=1e-5)


def _train_by_step(run):
    from farskip_jax.train.logger import read_metrics

    return {r["step"]: r for r in read_metrics(run, "train")}  # a resumed run's records of a step: the last


def test_distill_sigterm_checkpoints_and_resumes_exactly(teacher_run, tmp_path):
    """SIGTERM mid-run (grad_accum=2): status 'preempted', a checkpoint at that step; re-running resumes
    and ends with the straight run's per-step losses and student parameters, bit for bit (CPU)."""
    import io

    from farskip_jax.config import load_config
    from farskip_jax.loading.checkpoint import Checkpointer
    from farskip_jax.fcsd.distill import distill

    def cfg(run):
        return load_config("configs/distill_tiny.yaml", [*TINY, f"distill.init_from_run={teacher_run}",
                                                         "train.steps=6", "distill.eval_every=3", "train.lr=3e-3",
                                                         "train.warmup_steps=1", "train.grad_accum=2", "train.log_every=1",
                                                         "train.checkpoint_every=0", f"train.run_dir={run}"])

    straight, broken = str(tmp_path / "straight"), str(tmp_path / "broken")
    a = distill(cfg(straight), stream=io.StringIO())
    assert a.status == "done" and a.step == 6
    hook = SigtermAt(2)
    b = distill(cfg(broken), stream=hook)
    assert hook.sent and b.status == "preempted" and b.step == 2, (b.status, b.step)
    assert any("signal" in s and "saving checkpoint at step 2" in s for s in hook.text)
    ck = Checkpointer(broken, keep=5)
    assert ck.latest_step() == 2
    ck.close()
    log = io.StringIO()
    c = distill(cfg(broken), stream=log)
    assert "resumed from checkpoint step 2" in log.getvalue()
    assert c.status == "done" and c.step == 6
    ta, tb = _train_by_step(straight), _train_by_step(broken)
    assert sorted(ta) == sorted(tb) == list(range(1, 7))
    for s in ta:
        for k in ("loss", "kl", "grad_norm"):
            assert ta[s][k] == tb[s][k], (s, k, ta[s][k], tb[s][k])
    ea = {e["step"]: e["kl"] for e in a.evals}
    eb = {e["step"]: e["kl"] for e in c.evals}
    assert ea[3] == eb[3] and ea[6] == eb[6]
    import jax

    from farskip_jax.loading.load import load_run

    _, _, sa = load_run(straight, "latest")
    _, _, sb = load_run(broken, "latest")
    for x, y in zip(jax.tree.leaves(sa["params"]), jax.tree.leaves(sb["params"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_distill_from_hf_folder_end_to_end(tmp_path):
    """init_from_hf: a tiny random Qwen2-MoE (shared expert, gate) saved with save_pretrained is the
    teacher; its validation loss at step 0 equals HF's own (PyTorch) loss on the same packed batches;
    FCSD lowers the KL; the best student exports as an HF folder (qwen2_moe + FarSkip settings) that
    re-imports to the student's logits under FarSkip connectivity."""
    import torch
    import transformers

    import train as train_entry
    from farskip_jax.config import load_config
    from farskip_jax.eval.metrics import val_batches
    from farskip_jax.train.logger import read_metrics

    torch.manual_seed(0)
    hf_cfg = transformers.Qwen2MoeConfig(vocab_size=320, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                         intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, initializer_range=0.2,
                                         max_position_embeddings=128, tie_word_embeddings=False)
    hf = transformers.Qwen2MoeForCausalLM(hf_cfg).eval()
    hf_dir = str(tmp_path / "hf")
    hf.save_pretrained(hf_dir)
    run, export = str(tmp_path / "fcsd"), str(tmp_path / "export")
    over = [f"init_from_hf={hf_dir}", "distill.init_from_run=null", "train.steps=10", "distill.eval_every=5", "train.lr=1e-2", "train.warmup_steps=1",
            "train.batch_size=8", "train.seq_len=32", "train.eval_batches=2", "train.tensorboard=false",
            "mesh.data=-1", f"train.run_dir={run}", f"distill.export_hf={export}"]
    rc = train_entry.main(["--config", "configs/distill_tiny.yaml", *over])
    assert rc == 0
    evals = read_metrics(run, "eval")
    assert [e["step"] for e in evals] == [0, 5, 10]
    assert evals[0]["kl"] > 1e-3 and min(e["kl"] for e in evals[1:]) < 0.8 * evals[0]["kl"], evals

    # oracle: HF's loss on the same validation batches (each packed document piece run on its own)
    cfg = load_config("configs/distill_tiny.yaml", over)
    nll, n = 0.0, 0.0
    for b in val_batches(cfg, 2):
        tok, tgt, pos, seg, m = (np.asarray(b[k]) for k in ("tokens", "targets", "positions", "segment_ids", "loss_mask"))
        for r in range(tok.shape[0]):
            for sid in np.unique(seg[r][seg[r] > 0]):
                idx = np.nonzero(seg[r] == sid)[0]
                with torch.no_grad():
                    lg = hf(input_ids=torch.tensor(tok[r, idx][None]).long(),
                            position_ids=torch.tensor(pos[r, idx][None]).long()).logits[0].double()
                lp = torch.log_softmax(lg, -1).numpy()
                nll -= float((lp[np.arange(len(idx)), tgt[r, idx]] * m[r, idx]).sum())
                n += float(m[r, idx].sum())
    np.testing.assert_allclose(evals[0]["teacher_loss"], nll / n, rtol=2e-5)

    with open(os.path.join(export, "config.json")) as f:
        exported = json.load(f)
    assert exported["model_type"] == "qwen2_moe" and exported["farskip_jax"]["preset"] == "farskip"
    from farskip_jax.loading.load import load_hf, load_run
    from farskip_jax.eval.metrics import forward

    run_cfg, gd, st = load_run(run, "best")
    _, gd2, st2 = load_hf(export)
    b = val_batches(run_cfg, 1)[0]
    np.testing.assert_allclose(forward(gd2, st2, b, run_cfg.farskip).logits, forward(gd, st, b, run_cfg.farskip).logits,
                               rtol=1e-5, atol=1e-5)


def test_resume_step_drops_a_best_student_of_the_discarded_steps(teacher_run, tmp_path):
    """train.resume_step=2 after a run whose best student is of step 6: best/ then holds the student of
    the best evaluation up to step 2 (replayed by early stopping), never the discarded step 6's."""
    import io

    from farskip_jax.config import load_config
    from farskip_jax.fcsd.distill import distill
    from farskip_jax.loading.checkpoint import Checkpointer

    run = str(tmp_path / "run")

    def cfg(*extra):
        return load_config("configs/distill_tiny.yaml", [*TINY, f"distill.init_from_run={teacher_run}", "train.steps=6",
                                                         "distill.eval_every=2", "train.lr=3e-3", "train.warmup_steps=1",
                                                         "train.log_every=1", "train.checkpoint_every=2",
                                                         "train.keep_checkpoints=5", f"train.run_dir={run}", *extra])

    a = distill(cfg(), stream=io.StringIO())
    assert a.status == "done" and a.best_step == 6, (a.status, a.best_step, a.evals)  # the KL falls at every evaluation
    hook = SigtermAt(3)  # stop right after the resumed run's first step, before it evaluates again
    b = distill(cfg("train.resume_step=2"), stream=hook)
    assert hook.sent and b.status == "preempted", b.status
    with open(os.path.join(run, "early_stopping.json")) as f:
        es = json.load(f)
    best = Checkpointer(os.path.join(run, "best"), keep=1)
    assert es["best_step"] == 2 and best.latest_step() == 2, (es, best.latest_step())
    best.close()
    text = "".join(hook.text)
    assert "best/ held the student of step 6, which train.resume_step=2 discards: dropped" in text, text[-2000:]
    import jax

    from farskip_jax.loading.load import load_run

    _, _, kept = load_run(run, "best")  # the best student is the run's checkpoint of step 2, bit for bit
    _, _, at2 = load_run(run, 2)
    for x, y in zip(jax.tree.leaves(kept["params"]), jax.tree.leaves(at2["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
