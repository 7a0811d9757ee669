"""CLI: python -m farskip_jax.convert import HF_DIR OUT_DIR | export CKPT_DIR HF_DIR (progress per tensor).

    import HF_DIR OUT_DIR [--dtype bfloat16] [--overwrite] [key=value ...]
        HF folder -> our folder (config.yaml, params.safetensors, hf_config.json, tokenizer files),
        streamed tensor by tensor; key=value overrides the imported config (farskip.preset=farskip).
        The connectivity is the one an export saved in config.json ("farskip_jax"), else the family's
        (standard; FarSkip-native keys), overrides win; one line names it and its source.
    export CKPT_DIR HF_DIR [--dtype bfloat16] [--family MODEL_TYPE] [--max-shard-size 5GB] [--overwrite]
        our import folder, or a training run folder (its latest checkpoint), -> an HF folder that
        transformers loads, with our FarSkip settings in config.json.
Errors of the project (bad folder, missing tensor, shape mismatch, ...) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from farskip_jax.errors import FarSkipError


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            return int(float(t[: -len(u)]) * units[u])
    return int(t)


def _load_ckpt(path: str):
    from farskip_jax.convert.native import is_native, load_native

    if is_native(path):
        return load_native(path)
    from flax import nnx

    from farskip_jax.eval.loading import load_run

    cfg, graphdef, st = load_run(path, "latest", None)
    return cfg, nnx.merge(graphdef, st["params"], st["bias"], st["rest"]), None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m farskip_jax.convert", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("import", help="HF folder -> farskip_jax folder")
    pi.add_argument("hf_dir")
    pi.add_argument("out_dir")
    pi.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    pi.add_argument("--overwrite", action="store_true")
    pi.add_argument("overrides", nargs="*", help="config overrides key=value")
    pe = sub.add_parser("export", help="farskip_jax folder or run folder -> HF folder")
    pe.add_argument("ckpt_dir")
    pe.add_argument("hf_dir")
    pe.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    pe.add_argument("--family", default=None, help="HF model_type when the checkpoint has no source config.json")
    pe.add_argument("--max-shard-size", type=_size, default=None)
    pe.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.time()
    try:
        if a.cmd == "import":
            from farskip_jax.convert.native import write_native_from_hf

            def show(i, n, spec):
                print(f"[{i + 1}/{n}] {'.'.join(map(str, spec.path))} <- {spec.hf[0]}{' ...' if len(spec.hf) > 1 else ''} "
                      f"{tuple(spec.shape)} ({time.time() - t0:.1f}s)", flush=True)

            cfg = write_native_from_hf(a.hf_dir, a.out_dir, a.overrides, dtype=a.dtype, overwrite=a.overwrite, progress=show,
                                       report=lambda line: print(line, flush=True))
            print(f"imported {a.hf_dir} -> {a.out_dir} (layers {cfg.model.num_layers}, experts {cfg.moe.num_experts}, "
                  f"farskip preset {cfg.farskip.preset}) in {time.time() - t0:.1f}s")
        else:
            from farskip_jax.convert.export import export_hf

            cfg, model, hf = _load_ckpt(a.ckpt_dir)
            n = {"i": 0}

            def show(name):
                n["i"] += 1
                print(f"[{n['i']}] {name} ({time.time() - t0:.1f}s)", flush=True)

            tok = a.ckpt_dir if os.path.isfile(os.path.join(a.ckpt_dir, "tokenizer.json")) else None
            export_hf(model, cfg, a.hf_dir, base_config=hf, family=a.family, dtype=a.dtype, tokenizer_dir=tok,
                      max_shard_bytes=a.max_shard_size, overwrite=a.overwrite, progress=show)
            print(f"exported {a.ckpt_dir} -> {a.hf_dir} in {time.time() - t0:.1f}s")
    except FarSkipError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
