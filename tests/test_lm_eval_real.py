"""The lm-eval adapter against the real lm-eval-harness (0.4.13, the `lmeval` extra), offline.

Local task YAMLs over JSONL files (dataset_path: json; no hub) are run by lm_eval.simple_evaluate
through eval/lm_eval_adapter.py. Oracles: the project's own multiple-choice scorer
(eval/tasks.py: LoglikScorer / score_task) on the same records — same per-choice log-likelihoods
(1e-5), hence the same per-record choice, acc and acc_norm — and a per-example full forward of the
model for the rolling log-likelihood; generate_until equals the adapter's direct generation.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")  # CI installs the lmeval extra, so this runs there

from farskip_jax.config import FarSkipConfig  # noqa: E402
from farskip_jax.data.tokenizer import ByteTokenizer  # noqa: E402
from farskip_jax.errors import ConfigError, DataError  # noqa: E402
from farskip_jax.eval.lm_eval_adapter import FarSkipLM, lm_eval_class, run_lm_eval  # noqa: E402
from farskip_jax.eval.tasks import LoglikScorer, load_task, score_task  # noqa: E402
from farskip_jax.loading.train_state import split_model  # noqa: E402

FS = FarSkipConfig(preset="farskip")
RECORDS = [
    {"context": "def f(x):\n    return", "choices": [" x", " x + 1", "!!"], "label": 0},
    {"context": "import ", "choices": ["os", "sys\n", "numpy as np"], "label": 2},
    {"context": "The cat sat on the", "choices": [" mat", " moon", " dog"], "label": 0},
    {"context": "1 + 1 =", "choices": [" 2", " 3"], "label": 0},
    {"context": "for i in range(", "choices": ["10):", "x]", "'a')"], "label": 0},
    {"context": "Paris is the capital of", "choices": [" France", " Spain", " the moon", " cheese"], "label": 0},
]
TEXTS = [{"text": "for i in range(3):\n    print(i)\n"}, {"text": "hello world, " * 9}]  # the second > max_len
PROMPTS = [{"prompt": "def ", "answer": "x"}, {"prompt": "import ", "answer": "os"}]


@pytest.fixture(scope="module")
def offline():
    """No hub: offline switches on (datasets reads them when lm-eval first imports it)."""
    with pytest.MonkeyPatch.context() as mp:
        for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
            mp.setenv(v, "1")
        yield


def _write_jsonl(path, recs):
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def local_tasks(tmp_path_factory):
    """Three task YAMLs (multiple_choice, loglikelihood_rolling, generate_until) over local JSONL files."""
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    cache = str(d / "hf_datasets_cache")  # datasets writes its Arrow cache here, not under ~/.cache

    def yaml_file(name, data, body):
        p = d / f"{name}.yaml"
        p.write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                     f"  cache_dir: {cache}\ntest_split: test\n{body}")
        return str(p)

    mc = _write_jsonl(d / "mc.jsonl", RECORDS)
    return dict(
        mc_jsonl=mc,
        mc=yaml_file("farskip_local_mc", mc, 'output_type: multiple_choice\ndoc_to_text: "{{context}}"\n'
                     'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\ntarget_delimiter: ""\n'
                     "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"),
        rolling=yaml_file("farskip_local_rolling", _write_jsonl(d / "text.jsonl", TEXTS),
                          'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                          "metric_list:\n  - metric: word_perplexity\n"),
        gen=yaml_file("farskip_local_gen", _write_jsonl(d / "gen.jsonl", PROMPTS),
                      'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\n'
                      'target_delimiter: ""\ngeneration_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\n'
                      "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"),
    )


def _full_forward_rolling(model, text: str) -> float:
    """Summed log-prob of every token after BOS, one forward per window of <= max_len targets."""
    tok = ByteTokenizer()
    ids = [tok.bos_id] + list(tok.encode(text))
    win, total = model.cfg.model.max_seq_len, 0.0
    for t0 in range(1, len(ids), win):
        t1 = min(t0 + win, len(ids))
        ctx = ids[max(0, t1 - 1 - win):t1]
        logits = np.asarray(model(jax.numpy.asarray([ctx[:-1]]), farskip=FS).logits[0], np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        k = t1 - t0
        total += float(sum(logp[i, ctx[i + 1]] for i in range(len(ctx) - 1 - k, len(ctx) - 1)))
    return total


def test_real_lm_eval_matches_project_scorer(offline, tiny, local_tasks):
    cfg, model, graphdef, st = tiny
    core = FarSkipLM(graphdef, st, ByteTokenizer(), farskip=FS, max_len=cfg.model.max_seq_len)
    res = run_lm_eval(core, [local_tasks["mc"], local_tasks["rolling"], local_tasks["gen"]], log_samples=True,
                      bootstrap_iters=0, offline=True)
    # multiple choice: per-choice log-likelihoods, per-record choice, acc / acc_norm
    scorer = LoglikScorer(graphdef, st, ByteTokenizer(), farskip=FS, batch_size=4, max_len=cfg.model.max_seq_len)
    samples = sorted(res["samples"]["farskip_local_mc"], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(len(RECORDS)))
    recs = load_task(local_tasks["mc_jsonl"])
    for s, r in zip(samples, recs):
        ours = [ll for ll, _ in scorer.loglikelihood([(r["context"], c) for c in r["choices"]])]
        theirs = [float(x[0]) for x in s["filtered_resps"]]
        np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5)
        assert s["acc"] == float(np.argmax(ours) == r["label"])
    mine = score_task(scorer, local_tasks["mc_jsonl"])
    got = res["results"]["farskip_local_mc"]
    assert got["acc,none"] == pytest.approx(mine["acc"]) and got["acc_norm,none"] == pytest.approx(mine["acc_norm"])
    assert 0 < mine["acc"] < 1  # the records separate right from wrong choices, not all one way
    # rolling log-likelihood (the second text spans two windows of max_len)
    rolled = sorted(res["samples"]["farskip_local_rolling"], key=lambda s: s["doc_id"])
    for s, t in zip(rolled, TEXTS):
        lp = float(np.ravel(s["filtered_resps"])[0])
        np.testing.assert_allclose(lp, _full_forward_rolling(model, t["text"]), rtol=1e-5)
    # generate_until: lm-eval's requests give the adapter's own greedy completions
    gen = sorted(res["samples"]["farskip_local_gen"], key=lambda s: s["doc_id"])
    direct = core.generate_until([(p["prompt"], {"until": ["\n"], "max_gen_toks": 6, "do_sample": False})
                                  for p in PROMPTS])
    assert [s["filtered_resps"][0] for s in gen] == direct
    assert all("\n" not in t for t in direct)


def test_registered_model_over_an_exported_farskip_folder(offline, tiny, local_tasks, tmp_path):
    """simple_evaluate(model="farskip_jax", model_args="hf=...") imports the exported connectivity."""
    import torch  # the hf extra
    import transformers

    from farskip_jax.convert import export_hf, import_hf

    torch.manual_seed(0)
    hcfg = transformers.Qwen2MoeConfig(vocab_size=320, hidden_size=32, num_attention_heads=4, intermediate_size=48,
                                       initializer_range=0.2, num_hidden_layers=2, num_key_value_heads=2,
                                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=24, max_position_embeddings=128)
    transformers.AutoModelForCausalLM.from_config(hcfg).eval().save_pretrained(tmp_path / "hf")
    cfg, model = import_hf(str(tmp_path / "hf"), overrides=["farskip.preset=farskip"])
    out = export_hf(model, cfg, str(tmp_path / "student"))
    lm_eval_class()  # registers "farskip_jax"
    res = lm_eval.simple_evaluate(model="farskip_jax", model_args=f"hf={out},tokenizer=byte", tasks=[local_tasks["mc"]],
                                  task_manager=lm_eval.tasks.TaskManager(include_defaults=False), log_samples=True,
                                  bootstrap_iters=0)
    graphdef, params, bias, rest = split_model(model)
    scorer = LoglikScorer(graphdef, dict(params=params, bias=bias, rest=rest), ByteTokenizer(), farskip=cfg.farskip,
                          max_len=cfg.model.max_seq_len)
    standard = LoglikScorer(graphdef, dict(params=params, bias=bias, rest=rest), ByteTokenizer(),
                            farskip=FarSkipConfig(), max_len=cfg.model.max_seq_len)
    s = min(res["samples"]["farskip_local_mc"], key=lambda s: s["doc_id"])
    pairs = [(RECORDS[0]["context"], c) for c in RECORDS[0]["choices"]]
    theirs = [float(x[0]) for x in s["filtered_resps"]]
    np.testing.assert_allclose(theirs, [ll for ll, _ in scorer.loglikelihood(pairs)], rtol=1e-5, atol=1e-5)
    assert np.abs(np.array(theirs) - [ll for ll, _ in standard.loglikelihood(pairs)]).max() > 1e-3
    # the same through the command line: eval.py --hf EXPORT --mode lm_eval --lm-eval-tasks TASK.yaml
    import eval as eval_entry

    assert eval_entry.main(["--hf", out, "--tokenizer", "byte", "--mode", "lm_eval", "--lm-eval-tasks",
                            local_tasks["mc"], "--out", str(tmp_path / "ev")]) == 0
    with open(tmp_path / "ev" / "results.json") as f:
        cli = json.load(f)
    assert cli["farskip"]["preset"] == "farskip"
    assert cli["lm_eval"]["farskip_local_mc"]["acc,none"] == pytest.approx(res["results"]["farskip_local_mc"]["acc,none"])


def test_lm_eval_task_errors_name_the_task(offline, tiny, tmp_path):
    cfg, model, graphdef, st = tiny
    core = FarSkipLM(graphdef, st, ByteTokenizer(), max_len=64)
    with pytest.raises(DataError, match="no_such.yaml"):
        run_lm_eval(core, [str(tmp_path / "no_such.yaml")])
    with pytest.raises(ConfigError, match="farskip_no_such_task"):
        run_lm_eval(core, ["farskip_no_such_task"], include_path=str(tmp_path))
