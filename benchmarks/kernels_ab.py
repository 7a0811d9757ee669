"""The CPU kernels on and off, side by side: the README's main job (and optionally its test command).

    python -m benchmarks.kernels_ab --rounds 3                 # main job: train.py --config configs/tiny.yaml
    python -m benchmarks.kernels_ab --rounds 1 --tests         # + the README's test command (long)
    python -m benchmarks.kernels_ab --rounds 2 --test-files tests/test_train_tiny.py ...   # + a sample of it

Runs alternate kernels on / off (FARSKIP_KERNELS=1 / 0, which sets kernels.enabled for every config
the process loads), each in a fresh process with a fresh run folder, so both see the same machine
load in turn. Prints per run: wall seconds, and for the main job the mean tokens/s and val loss of
its last line; then the median wall ratio off / on (> 1: the kernels are faster).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd: list, enabled: bool) -> tuple[float, str]:
    env = dict(os.environ, FARSKIP_KERNELS="1" if enabled else "0")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} (kernels {'on' if enabled else 'off'}) failed:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return wall, p.stdout + p.stderr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tests", action="store_true", help="also time the README's test command (pytest -n 2)")
    ap.add_argument("--test-files", nargs="*", default=None,
                    help="time only these test files (a sample of the README's test command; implies --tests)")
    ap.add_argument("overrides", nargs="*", help="extra overrides for the main job")
    a = ap.parse_args(argv)
    tests = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", *(a.test_files or [])]
    jobs = [("main job", None)] + ([("tests", tests)] if a.tests or a.test_files else [])
    walls = {(j, on): [] for j, _ in jobs for on in (True, False)}
    tmp = tempfile.mkdtemp(prefix="kernels_ab_")
    try:
        for r in range(a.rounds):
            for name, cmd in jobs:
                for on in ((True, False) if r % 2 == 0 else (False, True)):
                    if cmd is None:
                        rd = os.path.join(tmp, f"run_{r}_{int(on)}")
                        c = [sys.executable, "train.py", "--config", "configs/tiny.yaml", f"train.run_dir={rd}",
                             "train.tensorboard=false", *a.overrides]
                    else:
                        c = cmd
                    wall, out = run(c, on)
                    walls[(name, on)].append(wall)
                    last = [ln for ln in out.splitlines() if ln.startswith("done at step")]
                    speed = re.search(r"mean ([\d,]+) tokens/s", last[-1]) if last else None
                    val = re.search(r"val loss ([\d.]+)", last[-1]) if last else None
                    tail = (f", {speed.group(1)} tokens/s" if speed else "") + (f", val loss {val.group(1)}" if val else "")
                    summary = [ln for ln in out.splitlines() if re.search(r"\d+ passed", ln)]
                    tail += f" ({summary[-1].strip('= ')})" if summary and cmd is not None else ""
                    print(f"round {r + 1} {name:8s} kernels {'on ' if on else 'off'}: {wall:7.1f} s{tail}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name, _ in jobs:
        on, off = statistics.median(walls[(name, True)]), statistics.median(walls[(name, False)])
        print(f"{name}: median wall on {on:.1f} s, off {off:.1f} s, off / on = {off / on:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
