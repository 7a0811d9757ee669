"""python -m farskip_jax.convert: import an HF folder, or export a farskip_jax folder as an HF folder.

    python -m farskip_jax.convert import HF_DIR OUT_DIR [--dtype bfloat16] [--overwrite] [key=value ...]
        HF folder -> our folder (config.yaml, params.safetensors, hf_config.json, tokenizer files),
        streamed tensor by tensor; key=value overrides the imported config (farskip.preset=farskip).
        The connectivity is the one an export saved in config.json ("farskip_jax"), else the family's
        (standard; FarSkip-native keys), overrides win; one line names it and its source.
    python -m farskip_jax.convert export SRC_DIR HF_DIR [--which best|latest|STEP] [--dtype bfloat16]
                                        [--family MODEL_TYPE] [--max-shard-size 5GB] [--overwrite]
        our import folder, or a run folder, -> an HF folder that transformers loads, with our FarSkip
        settings in config.json and what it holds (source, checkpoint, step) in farskip_export.json.
        --which (run folders): default best for an FCSD run (it keeps best/), latest otherwise.
        --family: the HF model_type to write (default: the source's); refused when it cannot hold
        the model (naming what does not fit and the families that can); instella_moe writes the
        FarSkip-native layout of a DeepSeek-V3-family model. A warning names connectivity the
        target's readers will not run.

--overwrite replaces an existing output folder only when farskip_jax wrote it as the same kind (an
import folder for import, an export for export); a training run folder, the files a run writes and
any other folder are never replaced. Errors of the project (bad folder, missing tensor, shape
mismatch, ...) print one `error:` line and exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

from flax import nnx

from farskip_jax.errors import CheckpointError, FarSkipError
from farskip_jax.convert.export import export_hf, export_target
from farskip_jax.convert.native import write_native_from_hf
from farskip_jax.folders import check_output
from farskip_jax.loading.import_folder import is_native
from farskip_jax.loading.load import checkpoint_step, default_which, load_run, read_run_config
from farskip_jax.loading.native import load_native, native_config
from farskip_jax.loading.reader import read_json


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            return int(float(t[: -len(u)]) * units[u])
    return int(t)


def _load_ckpt(path: str, which: Optional[str], family: Optional[str]):
    """(cfg, model, source config.json or None, farskip_export.json source dict) of a folder to export;
    the export target (family) is checked against the folder's config before any weights are read."""
    path = os.path.abspath(path)
    if is_native(path):
        if which is not None:
            raise CheckpointError(f"{path} is an import folder: it holds one set of weights; drop --which {which}")
        export_target(native_config(path), read_json(os.path.join(path, "hf_config.json")), family)  # before the weights
        cfg, model, hf = load_native(path)
        return cfg, model, hf, {"import": path}

    which = which or default_which(path)
    sel = int(which) if which.isdigit() else which
    if sel not in ("best", "latest") and not isinstance(sel, int):
        raise CheckpointError(f"--which {which!r}: choose best, latest or a step number")
    export_target(read_run_config(path), None, family)  # a family that cannot hold the model: before the weights
    cfg, graphdef, st = load_run(path, sel, None)
    step = checkpoint_step(path, sel)
    return cfg, nnx.merge(graphdef, st["params"], st["bias"], st["rest"]), None, {"run": path, "checkpoint": which,
                                                                                    "step": step}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m farskip_jax.convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{import,export}")
    pi = sub.add_parser("import", help="HF folder -> farskip_jax import folder",
                        description="Import an HF checkpoint folder into a farskip_jax import folder.")
    pi.add_argument("hf_dir", metavar="HF_DIR", help="HF checkpoint folder (config.json + *.safetensors)")
    pi.add_argument("out_dir", metavar="OUT_DIR", help="the import folder to write (a new folder)")
    pi.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="parameter dtype (default: the source's)")
    pi.add_argument("--overwrite", action="store_true",
                    help="replace OUT_DIR when it is an import folder farskip_jax wrote (never anything else)")
    pi.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. farskip.preset=farskip")
    pe = sub.add_parser("export", help="farskip_jax import folder or run folder -> HF folder",
                        description="Export a farskip_jax import folder or a checkpoint of a run folder as an HF folder.")
    pe.add_argument("ckpt_dir", metavar="SRC_DIR", help="an import folder or a run folder (train.run_dir)")
    pe.add_argument("hf_dir", metavar="HF_DIR", help="the HF folder to write (a new folder)")
    pe.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="tensor dtype (default float32)")
    pe.add_argument("--which", default=None,
                    help="run folders: best | latest | a step number (default: best for an FCSD run, which keeps "
                         "best/; latest otherwise)")
    pe.add_argument("--family", default=None,
                    help="HF model_type to write (default: the source's config.json); instella_moe: the FarSkip-native "
                         "layout of a DeepSeek-V3-family model")
    pe.add_argument("--max-shard-size", type=_size, default=None, metavar="SIZE",
                    help="split the weights into shards of at most SIZE (e.g. 5GB; default: one file)")
    pe.add_argument("--overwrite", action="store_true",
                    help="replace HF_DIR when it is an export farskip_jax wrote (never a run folder or anything else)")
    a = ap.parse_args(argv)
    t0 = time.time()
    try:
        if a.cmd == "import":
            def show(i, n, spec):
                print(f"[{i + 1}/{n}] {'.'.join(map(str, spec.path))} <- {spec.hf[0]}{' ...' if len(spec.hf) > 1 else ''} "
                      f"{tuple(spec.shape)} ({time.time() - t0:.1f}s)", flush=True)

            cfg = write_native_from_hf(a.hf_dir, a.out_dir, a.overrides, dtype=a.dtype, overwrite=a.overwrite, progress=show,
                                       report=lambda line: print(line, flush=True))
            print(f"imported {a.hf_dir} -> {a.out_dir} (layers {cfg.model.num_layers}, experts {cfg.moe.num_experts}, "
                  f"farskip preset {cfg.farskip.preset}) in {time.time() - t0:.1f}s")
        else:
            check_output(a.hf_dir, "export", overwrite=a.overwrite, what="the export folder")  # before any reading
            cfg, model, hf, source = _load_ckpt(a.ckpt_dir, a.which, a.family)
            what = (f"checkpoint {source['checkpoint']} (step {source['step']}) of the run" if "run" in source
                    else "the import folder")
            print(f"exporting {what} {a.ckpt_dir}", flush=True)
            n = {"i": 0}

            def show(name):
                n["i"] += 1
                print(f"[{n['i']}] {name} ({time.time() - t0:.1f}s)", flush=True)

            tok = a.ckpt_dir if os.path.isfile(os.path.join(a.ckpt_dir, "tokenizer.json")) else None
            export_hf(model, cfg, a.hf_dir, base_config=hf, family=a.family, dtype=a.dtype, tokenizer_dir=tok,
                      max_shard_bytes=a.max_shard_size, overwrite=a.overwrite, progress=show, source=source,
                      report=lambda line: print(f"warning: {line}", file=sys.stderr, flush=True))
            print(f"exported {a.ckpt_dir} -> {a.hf_dir} in {time.time() - t0:.1f}s")
    except FarSkipError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
