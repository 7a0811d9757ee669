"""Let lm-eval-harness (`lm_eval`, installed separately: pip install lm-eval) drive a farskip_jax model.

    core = FarSkipLM(graphdef, st, tokenizer, farskip=cfg.farskip, max_len=cfg.model.max_seq_len)
    results = run_lm_eval(core, ["hellaswag"], num_fewshot=0, limit=100)

`FarSkipLM` implements the three request types of lm_eval's LM interface with plain Python objects
(no lm_eval import): loglikelihood (context, continuation) -> (logprob, is_greedy),
loglikelihood_rolling (text,) -> logprob, generate_until (context, {"until", "max_gen_toks",
"do_sample", "temperature", "top_p"}) -> text (KV-cache generation under the model's connectivity).
`as_lm_eval_model(core)` wraps it in an `lm_eval.api.model.LM` subclass when lm_eval is importable.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from flax import nnx

from farskip_jax.config import FarSkipConfig
from farskip_jax.errors import FarSkipError
from farskip_jax.eval.generate import generate, make_decode_fn
from farskip_jax.eval.tasks import LoglikScorer


def _args(req):
    return tuple(req.args) if hasattr(req, "args") else tuple(req)


class FarSkipLM:
    def __init__(self, graphdef, st: dict, tokenizer, *, farskip: Optional[FarSkipConfig] = None,
                 max_len: Optional[int] = None, batch_size: int = 8, mesh=None):
        self.tok = tokenizer
        self.scorer = LoglikScorer(graphdef, st, tokenizer, farskip=farskip, batch_size=batch_size, max_len=max_len,
                                   mesh=mesh)
        self.model = nnx.merge(graphdef, st["params"], st["bias"], st["rest"])
        self.farskip = farskip if farskip is not None else self.model.cfg.farskip
        self.max_len = max_len
        self._decode = make_decode_fn(nnx.split(self.model)[0], self.farskip)

    def loglikelihood(self, requests: Sequence) -> list[tuple[float, bool]]:
        return self.scorer.loglikelihood([_args(r)[:2] for r in requests])

    def loglikelihood_rolling(self, requests: Sequence) -> list[float]:
        return [self.scorer.rolling_loglikelihood(_args(r)[0]) for r in requests]

    def generate_until(self, requests: Sequence) -> list[str]:
        out = []
        for r in requests:
            context, kw = _args(r)[:2]
            kw = dict(kw or {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            head = [self.tok.bos_id] if getattr(self.tok, "bos_id", None) is not None else []
            ids = head + [int(t) for t in self.tok.encode(context)]
            n_new = int(kw.get("max_gen_toks", 64))
            if self.max_len:
                ids = ids[-max(1, self.max_len - n_new):]
            sample = bool(kw.get("do_sample", False)) and float(kw.get("temperature", 1.0)) > 0
            g = generate(self.model, np.asarray([ids], np.int32), n_new, farskip=self.farskip,
                         temperature=float(kw.get("temperature", 1.0)) if sample else 0.0,
                         top_p=float(kw.get("top_p", 1.0)), eos_id=getattr(self.tok, "eos_id", None),
                         decode_fn=self._decode)
            new = [int(t) for t in g.tokens[0, len(ids):] if int(t) != getattr(self.tok, "eos_id", None)]
            text = self.tok.decode(new)
            cut = min([text.find(u) for u in until if u and u in text], default=-1)
            out.append(text[:cut] if cut >= 0 else text)
        return out


def as_lm_eval_model(core: FarSkipLM):
    """An `lm_eval.api.model.LM` instance backed by `core` (needs lm_eval installed)."""
    try:
        from lm_eval.api.model import LM
    except ImportError as e:
        raise FarSkipError("lm-eval-harness is not installed: pip install lm-eval (or score local JSONL tasks "
                           "with `python eval.py --mode tasks --tasks file.jsonl`)") from e

    class _FarSkipLMEval(LM):
        def __init__(self):
            super().__init__()

        def loglikelihood(self, requests):
            return core.loglikelihood(requests)

        def loglikelihood_rolling(self, requests):
            return core.loglikelihood_rolling(requests)

        def generate_until(self, requests):
            return core.generate_until(requests)

    return _FarSkipLMEval()


def run_lm_eval(core: FarSkipLM, tasks: Sequence[str], *, num_fewshot: Optional[int] = None,
                limit: Optional[int] = None) -> dict:
    """lm_eval.simple_evaluate over `tasks` with our model; returns its results dict."""
    lm = as_lm_eval_model(core)
    import lm_eval

    return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit)
