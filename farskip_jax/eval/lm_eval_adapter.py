"""Let lm-eval-harness (lm-eval 0.4.13: `pip install -e ".[lmeval]"`) drive a farskip_jax model.

    core = FarSkipLM(graphdef, st, tokenizer, farskip=cfg.farskip, max_len=cfg.model.max_seq_len)
    results = run_lm_eval(core, ["path/to/my_task.yaml"], limit=100)       # a local task, no hub
    results = run_lm_eval(core, ["hellaswag"], num_fewshot=0)              # a built-in task (needs its dataset)

`FarSkipLM` implements the three request types of lm_eval's LM interface with plain Python objects
(no lm_eval import): loglikelihood (context, continuation) -> (logprob, is_greedy),
loglikelihood_rolling (text,) -> logprob, generate_until (context, {"until", "max_gen_toks",
"do_sample", "temperature", "top_p"}) -> text (KV-cache generation under the model's connectivity).
`lm_eval_class()` is its `lm_eval.api.model.LM` subclass, registered in lm_eval's model registry as
"farskip_jax" (so `simple_evaluate(model="farskip_jax", model_args="hf=DIR,tokenizer=DIR,farskip.preset=farskip")`
works once this module has run `lm_eval_class()`); it feeds lm_eval's request cache (`use_cache`).

Tasks are lm-eval task names or paths of task YAML files. A local task needs no network: a YAML with
`dataset_path: json` and `dataset_kwargs: {data_files: {test: /abs/path/records.jsonl}}` (docs/fcsd.md
shows one); it loads with or without network. `run_lm_eval(..., offline=True)` sets HF_DATASETS_OFFLINE /
HF_HUB_OFFLINE for the call (unless the user set them), so a hub task whose dataset is not cached fails
at once instead of after retries; either way that failure is one DataError. When every task is a YAML
file (or `include_path` holds them), lm-eval's built-in task configs are not indexed.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import numpy as np
from flax import nnx

from farskip_jax.config import FarSkipConfig
from farskip_jax.errors import ConfigError, DataError, FarSkipError
from farskip_jax.serving.generate import generate, make_decode_fn
from farskip_jax.eval.tasks import LoglikScorer
from farskip_jax.data.tokenizer import load_tokenizer
from farskip_jax.loading.load import load_hf, load_run

MODEL_NAME = "farskip_jax"
OFFLINE_VARS = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
_CLASS: list = []  # the LM subclass, built once (lm_eval's registry refuses a second class of one name)


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


def _need_lm_eval():
    try:
        # deferred: optional dependency (lm-eval: pip install .[lmeval])
        import lm_eval  # noqa: F401
        # deferred: optional dependency (lm-eval: pip install .[lmeval])
        from lm_eval.api.model import LM
    except ImportError as e:
        raise FarSkipError('lm-eval-harness is not installed: pip install -e ".[lmeval]" (lm-eval==0.4.13), or score '
                           "local JSONL tasks with `python eval.py --mode tasks --tasks file.jsonl`") from e
    return LM


def load_core(run: Optional[str] = None, hf: Optional[str] = None, which: str = "latest",
              tokenizer: Optional[str] = None, batch_size: int = 8, **overrides) -> FarSkipLM:
    """FarSkipLM of a run folder (`run`, checkpoint `which`) or an HF folder (`hf`, imported with its
    exported connectivity); dotted `overrides` ("farskip.preset": "farskip") change the config."""
    if bool(run) == bool(hf):
        raise ConfigError(f"lm_eval model_args for {MODEL_NAME!r} need exactly one of run=RUN_DIR or hf=HF_FOLDER")
    if run:
        cfg, graphdef, st = load_run(run, int(which) if str(which).isdigit() else which, config_overrides=overrides or None)
    else:
        cfg, graphdef, st = load_hf(hf, overrides=overrides or None)
    tok = load_tokenizer(tokenizer or (hf if hf and os.path.isfile(os.path.join(hf, "tokenizer.json"))
                                       else cfg.data.tokenizer))
    return FarSkipLM(graphdef, st, tok, farskip=cfg.farskip, max_len=cfg.model.max_seq_len, batch_size=int(batch_size))


def lm_eval_class():
    """The `lm_eval.api.model.LM` subclass over a FarSkipLM, registered as "farskip_jax"."""
    if _CLASS:
        return _CLASS[0]
    LM = _need_lm_eval()
    # deferred: optional dependency (lm-eval: pip install .[lmeval])
    from lm_eval.api.registry import register_model

    @register_model(MODEL_NAME)
    class FarSkipLMEval(LM):
        """lm_eval model backed by a FarSkipLM (`core`); model_args: see load_core."""

        def __init__(self, core: Optional[FarSkipLM] = None, **model_args):
            super().__init__()
            self.core = core if core is not None else load_core(**model_args)

        @classmethod
        def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None):
            extra = {k: v for k, v in (additional_config or {}).items() if k == "batch_size" and v not in (None, "auto")}
            return cls(**dict(arg_dict), **extra)

        @classmethod
        def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None):
            # deferred: optional dependency (lm-eval: pip install .[lmeval])
            from lm_eval.utils import simple_parse_args_string

            return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

        @property
        def tokenizer_name(self) -> str:
            return type(self.core.tok).__name__

        def _answer(self, kind: str, requests, results):
            for req, res in zip(requests, results):
                self.cache_hook.add_partial(kind, _args(req), res)
            return results

        def loglikelihood(self, requests):
            return self._answer("loglikelihood", requests, self.core.loglikelihood(requests))

        def loglikelihood_rolling(self, requests):
            return self._answer("loglikelihood_rolling", requests, self.core.loglikelihood_rolling(requests))

        def generate_until(self, requests):
            return self._answer("generate_until", requests, self.core.generate_until(requests))

    _CLASS.append(FarSkipLMEval)
    return FarSkipLMEval


def as_lm_eval_model(core: FarSkipLM):
    """An `lm_eval.api.model.LM` instance backed by `core` (needs lm_eval installed)."""
    return lm_eval_class()(core)


def _is_yaml(spec) -> bool:
    return isinstance(spec, str) and spec.endswith((".yaml", ".yml"))


def task_manager(tasks: Sequence[str], include_path: Union[None, str, Sequence[str]] = None):
    """lm_eval TaskManager for `tasks`: without lm-eval's built-in index when every task is a YAML
    path or a task of `include_path`; ConfigError naming a task that is neither."""
    # deferred: optional dependency (lm-eval: pip install .[lmeval])
    from lm_eval.tasks import TaskManager

    for t in tasks:
        if _is_yaml(t) and not os.path.isfile(t):
            raise DataError(f"lm-eval task file {t!r} does not exist")
    names = [t for t in tasks if not _is_yaml(t)]
    tm = TaskManager(include_path=include_path, include_defaults=False) if (include_path or not names) else None
    if tm is not None and all(n in tm.task_index for n in names):
        return tm
    tm = TaskManager(include_path=include_path)
    unknown = [n for n in names if n not in tm.task_index]
    if unknown:
        raise ConfigError(f"lm-eval task(s) {unknown} are neither lm-eval task/group/tag names nor task YAML files; "
                          "pass a YAML path (dataset_path: json, dataset_kwargs: {data_files: ...} for a local file) "
                          "or an include_path that holds the task")
    return tm


def run_lm_eval(core: FarSkipLM, tasks: Sequence[str], *, num_fewshot: Optional[int] = None,
                limit: Optional[int] = None, include_path: Union[None, str, Sequence[str]] = None,
                offline: bool = False, log_samples: bool = False, bootstrap_iters: int = 100000) -> dict:
    """lm_eval.simple_evaluate over `tasks` (names or task YAML paths) with our model; returns its
    results dict ("results", and "samples" with log_samples). offline=True: HF_DATASETS_OFFLINE and
    HF_HUB_OFFLINE default to 1 for this call (a user's own setting is kept; they act when lm-eval
    imports `datasets`, i.e. on the first call in a process)."""
    if not tasks:
        raise ConfigError("lm_eval needs at least one task: a task name or a task YAML path (--lm-eval-tasks ...)")
    saved = {v: os.environ.get(v) for v in OFFLINE_VARS}
    if offline:
        for v in OFFLINE_VARS:
            os.environ.setdefault(v, "1")
    try:
        lm = as_lm_eval_model(core)
        # deferred: optional dependency (lm-eval: pip install .[lmeval])
        import lm_eval

        tm = task_manager(list(tasks), include_path)
        try:
            return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                           task_manager=tm, log_samples=log_samples, bootstrap_iters=bootstrap_iters)
        except ConnectionError as e:  # a hub dataset that is neither cached nor reachable
            raise DataError(f"lm-eval could not load a task's dataset ({type(e).__name__}: {e}); with no network, "
                            "use a task YAML over a local file (dataset_path: json, dataset_kwargs: {data_files: "
                            "...}) or a dataset already in the HF datasets cache") from None
    finally:
        for v, old in saved.items():
            if old is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = old
