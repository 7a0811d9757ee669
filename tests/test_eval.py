"""eval/: JSONL task scoring vs a per-example full-forward oracle, lm-eval adapter, conversion sweep CSV + PNG."""

import csv
import json

import jax.numpy as jnp
import numpy as np
import pytest

from farskip_jax.config import FarSkipConfig
from farskip_jax.data.tokenizer import ByteTokenizer
from farskip_jax.errors import DataError
from farskip_jax.eval.lm_eval_adapter import FarSkipLM
from farskip_jax.eval.sweep import conversion_sweep, plot_sweep, write_csv
from farskip_jax.eval.tasks import LoglikScorer, load_task, score_task


def oracle_loglik(model, fs, ctx: str, cont: str) -> float:
    tok = ByteTokenizer()
    ids = [tok.bos_id] + list(tok.encode(ctx)) + list(tok.encode(cont))
    logits = np.asarray(model(jnp.asarray([ids[:-1]], jnp.int32), farskip=fs).logits[0], np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    k = len(tok.encode(cont))
    return float(sum(logp[i, ids[i + 1]] for i in range(len(ids) - 1 - k, len(ids) - 1)))


def test_task_scoring_matches_full_forward_oracle(tiny, tmp_path):
    cfg, model, graphdef, st = tiny
    fs = FarSkipConfig(preset="farskip")
    recs = [{"context": "def f(x):\n    return", "choices": [" x", " x + 1", "!!"], "label": 0},
            {"query": "import ", "endings": ["os", "sys\n", "numpy as np"], "gold": 2},
            ]
    path = tmp_path / "task.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    scorer = LoglikScorer(graphdef, st, ByteTokenizer(), farskip=fs, batch_size=4)
    data = load_task(str(path))
    pairs = [(r["context"], c) for r in data for c in r["choices"]]
    got = [x[0] for x in scorer.loglikelihood(pairs)]
    want = [oracle_loglik(model, fs, c, x) for c, x in pairs]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    res = score_task(scorer, str(path))
    acc = np.mean([int(np.argmax([want[j] for j in range(i0, i0 + len(r["choices"]))]) == r["label"])
                   for r, i0 in zip(data, np.cumsum([0] + [len(r["choices"]) for r in data])[:-1])])
    assert res["n"] == 2 and res["acc"] == pytest.approx(acc)
    # rolling log-likelihood of a text = the same oracle with an empty context
    text = "for i in range(3):\n    print(i)\n"
    full = scorer.rolling_loglikelihood(text)
    np.testing.assert_allclose(full, oracle_loglik(model, fs, "", text), rtol=1e-5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "x", "choices": ["a"], "label": 3}\n')
    with pytest.raises(DataError, match="label 3"):
        load_task(str(bad))


class _NoBosTokenizer(ByteTokenizer):
    """Bytes + EOS, no BOS (as Qwen's tokenizer): scored texts start after EOS, as in lm-eval."""
    bos_id = None


def test_scoring_without_bos_conditions_on_eos(tiny):
    cfg, model, graphdef, st = tiny
    fs = FarSkipConfig(preset="farskip")
    nobos = LoglikScorer(graphdef, st, _NoBosTokenizer(), farskip=fs, batch_size=4)
    (lp, _), = nobos.loglikelihood([("", "import os")])
    ids = [ByteTokenizer.eos_id] + list(ByteTokenizer().encode("import os"))
    logits = np.asarray(model(jnp.asarray([ids[:-1]], jnp.int32), farskip=fs).logits[0], np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    want = float(sum(logp[i, ids[i + 1]] for i in range(len(ids) - 1)))  # every continuation token is scored
    np.testing.assert_allclose(lp, want, rtol=1e-5)
    np.testing.assert_allclose(nobos.rolling_loglikelihood("import os"), want, rtol=1e-5)
    from farskip_jax.data.tokenizer import RawByteTokenizer

    with pytest.raises(DataError, match="empty context .* no BOS/EOS"):
        LoglikScorer(graphdef, st, RawByteTokenizer(), farskip=fs).loglikelihood([("", "x")])


def test_lm_eval_adapter_core(tiny):
    cfg, model, graphdef, st = tiny
    lm = FarSkipLM(graphdef, st, ByteTokenizer(), max_len=64)
    (lp, greedy), = lm.loglikelihood([("x = ", "1")])
    np.testing.assert_allclose(lp, oracle_loglik(model, cfg.farskip, "x = ", "1"), rtol=1e-5)
    text, = lm.generate_until([("def ", {"until": ["\n"], "max_gen_toks": 6})])
    assert isinstance(text, str) and "\n" not in text and 0 < len(text) <= 6  # <= 6 byte tokens


def test_sweep_writes_csv_and_png(tiny, tmp_path):
    cfg, model, graphdef, st = tiny
    rng = np.random.default_rng(0)
    tok = jnp.asarray(rng.integers(0, 256, size=(2, 17)), jnp.int32)
    batch = dict(tokens=tok[:, :-1], targets=tok[:, 1:], positions=jnp.broadcast_to(jnp.arange(16), (2, 16)),
                 segment_ids=jnp.ones((2, 16), jnp.int32), loss_mask=jnp.ones((2, 16), jnp.float32))
    rows = conversion_sweep(graphdef, st, cfg, [batch], stream=None)
    assert [(r["direction"], r["layers"]) for r in rows] == [("first", 0), ("first", 1), ("first", 2),
                                                            ("last", 0), ("last", 1), ("last", 2)]
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6) and rows[0]["top1"] == 1.0
    assert rows[1]["kl"] > 1e-4  # converting layer 0 changes predictions
    assert rows[2]["kl"] == pytest.approx(rows[5]["kl"], rel=1e-6)  # all layers either way
    p_csv = write_csv(rows, str(tmp_path / "s" / "sweep.csv"))
    p_png = plot_sweep(rows, str(tmp_path / "s" / "sweep.png"))
    with open(p_csv) as f:
        back = list(csv.DictReader(f))
    assert len(back) == 6 and float(back[4]["kl"]) == pytest.approx(rows[4]["kl"])
    with open(p_png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
