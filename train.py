"""Pretrain a FarSkip MoE from a config file.

    python train.py --config configs/tiny.yaml [section.key=value ...]
    python train.py --config configs/tiny.yaml farskip.preset=farskip train.run_dir=runs/tiny_farskip

Re-running the same command resumes from the newest complete checkpoint in train.run_dir.
Exit codes: 0 done / preempted (SIGTERM) / time limit; 2 configuration or data error; 3 diverged.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml", help="YAML experiment file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=50 farskip.preset=farskip")
    args = p.parse_args(argv)

    from farskip_jax.config import load_config
    from farskip_jax.errors import FarSkipError

    try:
        cfg = load_config(args.config, args.overrides)
    except FarSkipError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        try:  # XLA flags must be set before JAX starts a backend
            from farskip_jax.parallel.xla_flags import apply_xla_preset
        except ImportError:  # parallel/ not installed yet: default flags
            apply_xla_preset = None
        if apply_xla_preset is not None:
            apply_xla_preset(cfg.mesh.xla_preset)
        if cfg.mesh.xla_preset in ("none", "cpu"):  # CPU runs: reuse freed buffers (farskip_jax/kernels/host_memory.py)
            from farskip_jax.kernels.host_memory import keep_freed_memory
            keep_freed_memory(cfg.kernels.host_malloc)
        if cfg.train.mode == "distill":  # FCSD self-distillation (farskip_jax/fcsd/distill.py)
            from farskip_jax.fcsd.distill import distill as train
        else:
            from farskip_jax.train.trainer import train

        result = train(cfg)
    except FarSkipError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 3 if result.status == "diverged" else 0


if __name__ == "__main__":
    sys.exit(main())
