"""Multiple-choice task scoring by log-likelihood from local JSONL files (lm-eval-harness style).

One record per line: {"context": str, "choices": [str, ...], "label": int} ("query"/"question" and
"endings" and "gold"/"answer" are accepted aliases). Each choice is scored by the summed log-prob of
its tokens after the context; `acc` picks the largest sum, `acc_norm` the largest sum per byte of
the choice text (lm-eval's acc_norm).

    scorer = LoglikScorer(graphdef, st, tokenizer, farskip=cfg.farskip)
    scorer.loglikelihood([(context, continuation), ...])  -> [(logprob, is_greedy), ...]
    score_task(scorer, "task.jsonl")                       -> {"acc", "acc_norm", "n"}
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from farskip_jax.config import FarSkipConfig
from farskip_jax.errors import DataError
from farskip_jax.eval.metrics import forward
from farskip_jax.parallel.sharding import shard_batch

BUCKET = 32  # padded lengths are multiples of this (few compilations)


def _first(rec: dict, keys: Sequence[str], path: str, i: int):
    for k in keys:
        if k in rec:
            return rec[k]
    raise DataError(f"{path}:{i + 1}: record lacks any of {list(keys)}; expected "
                    '{"context": str, "choices": [str, ...], "label": int}')


def load_task(path: str) -> list[dict]:
    """Records {context, choices, label} of a JSONL task file."""
    if not os.path.isfile(path):
        raise DataError(f"task file {path!r} does not exist")
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i + 1}: not valid JSON ({e})") from None
            ctx = _first(rec, ("context", "query", "question"), path, i)
            choices = list(_first(rec, ("choices", "endings"), path, i))
            label = int(_first(rec, ("label", "gold", "answer"), path, i))
            if not 0 <= label < len(choices):
                raise DataError(f"{path}:{i + 1}: label {label} outside the {len(choices)} choices")
            out.append(dict(context=ctx, choices=choices, label=label))
    if not out:
        raise DataError(f"task file {path!r} holds no records")
    return out


def prefix_ids(tok) -> list[int]:
    """The token a scored text starts after: BOS, else EOS (as lm-eval's HF models do: a tokenizer
    without BOS, e.g. Qwen's, still conditions the first token on a document boundary), else none."""
    for name in ("bos_id", "eos_id"):
        i = getattr(tok, name, None)
        if i is not None:
            return [int(i)]
    return []


class LoglikScorer:
    """Log-likelihoods of continuations under one model state and connectivity."""

    def __init__(self, graphdef, st: dict, tokenizer, *, farskip: Optional[FarSkipConfig] = None,
                 batch_size: int = 8, max_len: Optional[int] = None, mesh=None):
        self.tok, self.batch_size, self.mesh = tokenizer, batch_size, mesh
        self.graphdef, self.st, self.farskip = graphdef, st, farskip
        self.max_len = max_len

        def fn(st, tokens, positions, segment_ids, targets):
            out = forward(graphdef, st, dict(tokens=tokens, positions=positions, segment_ids=segment_ids), farskip)
            logp = jax.nn.log_softmax(out.logits, axis=-1)
            lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
            return lp, jnp.argmax(out.logits, -1) == targets

        self._fn = jax.jit(fn)

    def _encode(self, context: str, continuation: str) -> tuple[list[int], int]:
        ctx = prefix_ids(self.tok) + [int(t) for t in self.tok.encode(context)]
        cont = [int(t) for t in self.tok.encode(continuation)]
        if not cont:
            raise DataError(f"empty continuation after context {context[-40:]!r}")
        if not ctx:
            raise DataError(f"empty context before continuation {continuation[:40]!r}, and the tokenizer "
                            f"({getattr(self.tok, 'name', self.tok)!r}) has no BOS/EOS token to condition the first "
                            "token on: give a non-empty context")
        ids = ctx + cont
        if self.max_len and len(ids) - 1 > self.max_len:
            ids = ids[-(self.max_len + 1):]  # keep the end: the continuation and the nearest context
        return ids, len(cont)

    def loglikelihood(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        """[(sum log p(continuation | context), continuation is the greedy decode)] per pair."""
        enc = [self._encode(c, x) for c, x in pairs]
        out: list = [None] * len(enc)
        order = sorted(range(len(enc)), key=lambda i: -len(enc[i][0]))
        for s in range(0, len(order), self.batch_size):
            idx = order[s:s + self.batch_size]
            n = max(len(enc[i][0]) - 1 for i in idx)
            n = -(-n // BUCKET) * BUCKET
            b = self.batch_size
            tok = np.zeros((b, n), np.int32)
            tgt = np.zeros((b, n), np.int32)
            seg = np.zeros((b, n), np.int32)
            for r, i in enumerate(idx):
                ids = enc[i][0]
                tok[r, :len(ids) - 1], tgt[r, :len(ids) - 1], seg[r, :len(ids) - 1] = ids[:-1], ids[1:], 1
            pos = np.broadcast_to(np.arange(n, dtype=np.int32), (b, n))
            batch = [tok, pos, seg, tgt]
            if self.mesh is not None:
                batch = shard_batch(batch, self.mesh)
            lp, greedy = jax.device_get(self._fn(self.st, *batch))
            for r, i in enumerate(idx):
                ids, k = enc[i]
                end = len(ids) - 1
                out[i] = (float(np.sum(lp[r, end - k:end])), bool(np.all(greedy[r, end - k:end])))
        return out

    def rolling_loglikelihood(self, text: str) -> float:
        """Summed log-prob of a whole text after its prefix token (prefix_ids); windows of max_len targets,
        each window seeing up to max_len earlier tokens (lm-eval's rolling loglikelihood). With neither
        BOS nor EOS in the tokenizer (raw_bytes) the first token has nothing to be conditioned on and is
        not scored."""
        ids = prefix_ids(self.tok) + [int(t) for t in self.tok.encode(text)]
        n = len(ids)
        win = self.max_len or n
        total = 0.0
        for t0 in range(1, n, win):
            t1 = min(t0 + win, n)
            total += self._score_ids(ids[max(0, t1 - 1 - win):t1], t1 - t0)
        return total

    def _score_ids(self, ids: list[int], k: int) -> float:
        """Summed log-prob of the last k tokens of ids given the ones before."""
        n = -(-(len(ids) - 1) // BUCKET) * BUCKET
        b = self.batch_size
        tok, tgt, seg = (np.zeros((b, n), np.int32) for _ in range(3))
        tok[0, :len(ids) - 1], tgt[0, :len(ids) - 1], seg[0, :len(ids) - 1] = ids[:-1], ids[1:], 1
        pos = np.broadcast_to(np.arange(n, dtype=np.int32), (b, n))
        lp, _ = jax.device_get(self._fn(self.st, tok, pos, seg, tgt))
        return float(np.sum(lp[0, len(ids) - 1 - k:len(ids) - 1]))


def score_task(scorer: LoglikScorer, path: str, limit: Optional[int] = None) -> dict:
    """{"acc", "acc_norm", "n"} of a JSONL multiple-choice task."""
    recs = load_task(path)[:limit]
    pairs = [(r["context"], c) for r in recs for c in r["choices"]]
    lls = scorer.loglikelihood(pairs)
    acc = acc_norm = 0
    j = 0
    for r in recs:
        k = len(r["choices"])
        ll = np.array([x[0] for x in lls[j:j + k]])
        nb = np.array([max(len(c.encode("utf-8")), 1) for c in r["choices"]])
        acc += int(np.argmax(ll) == r["label"])
        acc_norm += int(np.argmax(ll / nb) == r["label"])
        j += k
    return dict(acc=acc / len(recs), acc_norm=acc_norm / len(recs), n=len(recs))


def score_tasks(graphdef, st: dict, paths: Sequence[str], tokenizer, farskip: Optional[FarSkipConfig] = None,
                **kw) -> dict:
    """{task name: score_task(...)} for several JSONL files (name = file name without extension)."""
    scorer = LoglikScorer(graphdef, st, tokenizer, farskip=farskip, **kw)
    return {os.path.splitext(os.path.basename(p))[0]: score_task(scorer, p) for p in paths}
