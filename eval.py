"""Evaluate a farskip_jax model: loss/perplexity, KL + top-1 agreement to a teacher, JSONL tasks,
generation, the first-N/last-N conversion sweep, or lm-eval-harness tasks.

    python eval.py --run runs/tiny --mode loss                                   # val loss / ppl
    python eval.py --run runs/tiny --mode compare farskip.preset=farskip         # converted vs standard
    python eval.py --run runs/distill_tiny --which best --mode compare --teacher-run runs/tiny
    python eval.py --run runs/distill_tiny --which best --mode tasks --tasks data/task.jsonl
    python eval.py --run runs/tiny --mode generate --prompt "def main(" eval.max_new_tokens=64
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python eval.py --run runs/tiny --mode generate --prompt "def main(" --prompt "import " \
        inference.layout=tp_ep mesh.data=1 mesh.expert=2 mesh.tensor=4     # TP attention, EP 8 MoE: 8 devices
                                                                           # (the flag makes 8 on one CPU)
    python eval.py --run runs/tiny --mode sweep --out runs/tiny/sweep              # CSV + PNG
    python eval.py --hf path/to/hf_folder --mode lm_eval --lm-eval-tasks hellaswag --limit 100

Source: --run (a pretraining or distillation run folder; --which latest|best|STEP) or --hf (an HF
folder, imported, or an import folder of `python -m farskip_jax.convert import`). Dotted overrides
change the loaded config (farskip.*, data.*, eval.*, train.*). Validation batches (loss, compare,
sweep): --batches N, else an eval.batches override, else a run's own train.eval_batches (the val loss
training printed), else eval.batches; the result names the count and its source. Generation refuses
a prompt + eval.max_new_tokens longer than model.max_seq_len.
Prints one JSON object with the results (also written to --out/results.json when --out is given).
Exit codes: 0 ok, 2 configuration / data / checkpoint error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MODES = ("loss", "compare", "tasks", "generate", "sweep", "lm_eval")


# options read by one mode only -> that mode (given with another mode they would be ignored silently)
MODE_OPTIONS = {"teacher_run": "compare", "tasks": "tasks", "prompt": "generate", "lm_eval_tasks": "lm_eval",
                "num_fewshot": "lm_eval", "limit": "lm_eval"}


def _overrides(items) -> dict:
    import yaml

    from farskip_jax.errors import ConfigError

    out = {}
    for it in items:
        if "=" not in it:
            raise ConfigError(f"override {it!r} must look like section.key=value")
        k, _, v = it.partition("=")
        try:
            out[k.strip()] = yaml.safe_load(v) if v != "" else ""
        except yaml.YAMLError:  # as load_config reads it: the text as it is
            out[k.strip()] = v
    return out


def check_args(a) -> None:
    """ConfigError for arguments that cannot mean what they say, before any weights are read: exactly one
    source, --which latest|best|STEP, counts >= 1, options of another mode, an --out that is a file."""
    from farskip_jax.errors import ConfigError

    if bool(a.run) == bool(a.hf):
        raise ConfigError("pass exactly one of --run RUN_DIR or --hf HF_FOLDER")
    if a.hf and os.path.isfile(os.path.join(a.hf, "config.yaml")) and os.path.isdir(os.path.join(a.hf, "checkpoints")):
        raise ConfigError(f"--hf {a.hf} is a farskip_jax run folder (config.yaml, checkpoints/): pass it as --run {a.hf}")
    if a.run and os.path.isfile(os.path.join(a.run, "config.json")) and not os.path.isfile(os.path.join(a.run,
                                                                                                       "config.yaml")):
        raise ConfigError(f"--run {a.run} is an HF checkpoint folder (config.json): pass it as --hf {a.run}")
    if a.which not in ("latest", "best") and not a.which.isdigit():
        raise ConfigError(f"--which {a.which!r}: use latest, best (a distillation run's best checkpoint) or a step "
                          "number")
    if a.hf and a.which != "latest":
        raise ConfigError(f"--which {a.which} picks a checkpoint of a run folder; an HF or import folder (--hf) holds "
                          "one set of weights: drop --which")
    for name, flag in (("batches", "--batches"), ("limit", "--limit")):
        v = getattr(a, name)
        if v is not None and v < 1:
            raise ConfigError(f"{flag} {v} must be >= 1" + (" (validation batches; leave it out for the run's own "
                                                            "train.eval_batches)" if name == "batches" else ""))
    if a.num_fewshot is not None and a.num_fewshot < 0:
        raise ConfigError(f"--num-fewshot {a.num_fewshot} must be >= 0")
    for name, mode in MODE_OPTIONS.items():
        if getattr(a, name) not in (None, []) and a.mode != mode:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} is read by --mode {mode} only (this is --mode {a.mode}); add --mode {mode} or "
                              f"drop {flag}")
    if a.out and os.path.exists(a.out) and not os.path.isdir(a.out):
        raise ConfigError(f"--out {a.out} is a file; name a folder (results.json goes inside it)")


def check_teacher_shape(cfg, teacher_run: str) -> None:
    """ConfigError when the run of --teacher-run holds another architecture than the model evaluated (the
    weights could not be compared token by token); the architecture is the model and moe sections, the
    runtime section (dtype, remat, dispatch, ...) may differ."""
    from farskip_jax.config import to_dict
    from farskip_jax.errors import ConfigError
    from farskip_jax.loading.load import read_run_config

    teacher = read_run_config(os.path.abspath(teacher_run))
    diff = []
    for section in ("model", "moe"):
        mine, theirs = to_dict(getattr(cfg, section)), to_dict(getattr(teacher, section))
        diff += [f"{section}.{k} {mine[k]!r} vs {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]
    if diff:
        raise ConfigError(f"--teacher-run {teacher_run} holds another architecture than the model evaluated (evaluated "
                          f"vs teacher: {'; '.join(diff[:6])}{' ...' if len(diff) > 6 else ''}); compare weights of "
                          "one architecture: the teacher a student was distilled from, or leave --teacher-run out "
                          "(the same weights under standard connectivity)")


def val_batch_count(a, ov: dict, cfg) -> tuple[int, str]:
    """(validation batches, where the count comes from): --batches, an eval.batches override, the run's
    train.eval_batches (what its training evaluated), else eval.batches."""
    if a.batches is not None:
        return a.batches, "--batches"
    if "eval.batches" in ov:
        return cfg.eval.batches, "eval.batches override"
    if a.run:
        return cfg.train.eval_batches, "the run's train.eval_batches (as its training evaluated)"
    return cfg.eval.batches, "eval.batches"


def check_positions(prompt_len: int, new_tokens: int, max_seq_len: int) -> None:
    """ConfigError when the longest prompt plus eval.max_new_tokens does not fit model.max_seq_len."""
    from farskip_jax.errors import ConfigError

    if prompt_len + new_tokens > max_seq_len:
        room = max_seq_len - prompt_len
        raise ConfigError(
            f"eval.max_new_tokens={new_tokens} after a {prompt_len}-token prompt needs {prompt_len + new_tokens} "
            f"positions, but the model has model.max_seq_len={max_seq_len}: "
            + (f"set eval.max_new_tokens <= {room}" if room > 0 else "shorten the prompt")
            + " (or raise model.max_seq_len only for a model trained or scaled for longer contexts)")


def run(a) -> dict:
    import dataclasses

    from farskip_jax.data.tokenizer import check_vocab, load_tokenizer
    from farskip_jax.loading.import_folder import is_native
    from farskip_jax.errors import ConfigError
    from farskip_jax.loading.load import load_hf, load_import, load_run
    from farskip_jax.eval.metrics import (STANDARD, evaluate_loss, evaluate_pair, make_compare_fn, make_loss_fn,
                                          val_batches)

    check_args(a)
    ov = _overrides(a.overrides)  # generate honours runtime.scan_layers (stacked layers decode as a scan)
    if a.run and a.teacher_run:  # both configs, before any weights are read
        from farskip_jax.config import replace
        from farskip_jax.loading.load import read_run_config

        check_teacher_shape(replace(read_run_config(os.path.abspath(a.run)), **ov), a.teacher_run)
    if a.run:
        which = int(a.which) if a.which.isdigit() else a.which
        # the serving layouts restore replicated, then serving/programs.py reshards onto their mesh
        mesh = None
        if a.mode == "generate" and ov.get("inference.layout", "") in ("tp_ep", "dp_ep", "foe"):
            from farskip_jax.serving.programs import restore_mesh

            mesh = restore_mesh()
        cfg, graphdef, st = load_run(a.run, which, mesh=mesh, config_overrides=ov or None)
    elif is_native(a.hf):  # an import folder: its config.yaml and params.safetensors
        cfg, graphdef, st = load_import(a.hf, overrides=ov or None)
    else:
        cfg, graphdef, st = load_hf(a.hf, overrides=ov or None)  # an exported connectivity, then the overrides
    tok = load_tokenizer(a.tokenizer or cfg.data.tokenizer)
    check_vocab(tok, cfg.model.vocab_size, f"the model of {a.run or a.hf}")
    if a.teacher_run and not a.run:  # an HF or import folder's architecture is known once it is read
        check_teacher_shape(cfg, a.teacher_run)
    res: dict = {"mode": a.mode, "source": a.run or a.hf, "farskip": dataclasses.asdict(cfg.farskip)}
    n_batches, batches_from = val_batch_count(a, ov, cfg)
    if a.mode in ("loss", "compare", "sweep"):
        res.update(val_batches=n_batches, val_batches_from=batches_from)
    if a.mode == "loss":
        r = evaluate_loss(make_loss_fn(graphdef, cfg.farskip), st, val_batches(cfg, n_batches, tokenizer=tok))
        import math

        res.update(val_loss=r, ppl=math.exp(min(r, 700.0)))
    elif a.mode == "compare":
        teacher = st
        if a.teacher_run:
            _, _, teacher = load_run(a.teacher_run, "latest")
        r = evaluate_pair(make_compare_fn(graphdef, cfg.farskip, STANDARD), st, teacher,
                          val_batches(cfg, n_batches, tokenizer=tok))
        res.update(dataclasses.asdict(r))
    elif a.mode == "tasks":
        from farskip_jax.eval.tasks import score_tasks

        paths = a.tasks or list(cfg.eval.tasks)
        if not paths:
            raise ConfigError("--mode tasks needs --tasks file.jsonl ... (or eval.tasks in the config)")
        res["tasks"] = score_tasks(graphdef, st, paths, tok, cfg.farskip, max_len=cfg.model.max_seq_len)
    elif a.mode == "generate":
        from farskip_jax.serving.generate import generate
        from farskip_jax.serving.programs import serving_model

        model, layout = serving_model(cfg, graphdef, st)  # inference.layout=tp_ep / foe: their meshes
        head = [tok.bos_id] if getattr(tok, "bos_id", None) is not None else []
        prompts = a.prompt or [""]
        ids = [head + [int(t) for t in tok.encode(p)] for p in prompts]  # ragged: left-padded by generate
        check_positions(max(len(i) for i in ids), cfg.eval.max_new_tokens, cfg.model.max_seq_len)
        g = generate(model, ids, cfg.eval.max_new_tokens, farskip=cfg.farskip, temperature=cfg.eval.temperature,
                     top_p=cfg.eval.top_p, seed=a.seed, eos_id=getattr(tok, "eos_id", None), layout=layout)
        done = [tok.decode(g.completion(i)) for i in range(len(ids))]
        res.update(prompt=prompts[0], completion=done[0], layout=cfg.inference.layout)
        if len(prompts) > 1:
            res.update(prompts=prompts, completions=done)
    elif a.mode == "sweep":
        from farskip_jax.eval.sweep import conversion_sweep, plot_sweep, write_csv

        out = a.out or os.path.join(a.run or ".", "sweep")
        rows = conversion_sweep(graphdef, st, cfg, val_batches(cfg, n_batches, tokenizer=tok), stream=sys.stderr)
        res.update(rows=rows, csv=write_csv(rows, os.path.join(out, "sweep.csv")),
                   png=plot_sweep(rows, os.path.join(out, "sweep.png")))
    elif a.mode == "lm_eval":
        from farskip_jax.eval.lm_eval_adapter import FarSkipLM, run_lm_eval

        core = FarSkipLM(graphdef, st, tok, farskip=cfg.farskip, max_len=cfg.model.max_seq_len)
        r = run_lm_eval(core, a.lm_eval_tasks, num_fewshot=a.num_fewshot, limit=a.limit)
        res["lm_eval"] = r.get("results", r)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", help="run folder (train.run_dir of a pretraining or distillation run)")
    p.add_argument("--hf", help="HF checkpoint folder (imported with convert.import_hf) or an import folder")
    p.add_argument("--which", default="latest", help="latest | best (distillation runs) | a step number")
    p.add_argument("--mode", choices=MODES, default="loss")
    p.add_argument("--teacher-run", help="compare: teacher weights from this run (default: the same weights)")
    p.add_argument("--tasks", nargs="*", help="tasks: JSONL files {context, choices, label}")
    p.add_argument("--prompt", action="append", help="generate: a prompt (repeat for a batch of requests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batches", type=int, default=None,
                   help="validation batches (default: a run's train.eval_batches, else eval.batches)")
    p.add_argument("--tokenizer", help="tokenizer (default data.tokenizer of the config)")
    p.add_argument("--out", help="folder for results.json (and the sweep's CSV/PNG)")
    p.add_argument("--lm-eval-tasks", nargs="*", default=[], help="lm_eval: task names")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. farskip.preset=farskip data.source=text")
    a = p.parse_args(argv)
    from farskip_jax.errors import FarSkipError
    from farskip_jax.kernels.host_memory import keep_freed_memory

    try:
        keep_freed_memory()  # before JAX starts: reuse freed host buffers (kernels/host_memory.py; FARSKIP_HOST_MALLOC)
        res = run(a)
    except FarSkipError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
