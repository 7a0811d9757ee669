"""What verifying a checkpoint's digest costs, beside what restoring it costs, on one checkpoint.

    python -m benchmarks.checkpoint_digest --gb 16 [--dir /fast/disk/tmp] [--arrays 64]

Writes --gb GB of incompressible values (random bits, as trained weights are to orbax's zstd) with
orbax alone and with train/checkpoint.Checkpointer (its digest written at save), then measures, on
the same step: hashing its files from the page cache (the hash alone), from disk (each file's cached
pages dropped first: posix_fadvise DONTNEED), and orbax's own restore from disk, and prints each in
seconds and GB/s with the save and verify / restore ratios, and SHA-256's rate on one core (what a
host with more cores multiplies until the disk is the limit). The folder is deleted unless --keep.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time



def _drop_cache(files) -> None:
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=4.0, help="checkpoint size in GB (10^9 bytes)")
    ap.add_argument("--arrays", type=int, default=32, help="number of arrays it is split into")
    ap.add_argument("--dir", default=None, help="where to write it (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint folder")
    a = ap.parse_args(argv)

    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from farskip_jax.loading.checkpoint import Checkpointer
    from farskip_jax.loading.digest import digest_files, first_mismatch, read_digest

    root = tempfile.mkdtemp(prefix="digest-bench-", dir=a.dir)
    try:
        per = int(a.gb * 1e9 / a.arrays) // 4
        keys = jax.random.split(jax.random.key(0), a.arrays)  # made on the device: no host copy to hold
        state = {f"w{i:03d}": jax.random.bits(k, (per,), np.uint32) for i, k in enumerate(keys)}
        plain = ocp.CheckpointManager(os.path.join(root, "plain"), item_handlers={"state": ocp.StandardCheckpointHandler()})
        plain.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": jax.numpy.zeros(8)})))  # warm-up
        plain.wait_until_finished()
        t0 = time.perf_counter()
        plain.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
        plain.wait_until_finished()
        plain_s = time.perf_counter() - t0
        plain.close()
        shutil.rmtree(os.path.join(root, "plain"))
        ck = Checkpointer(os.path.join(root, "run"), keep=2, async_save=False)
        t0 = time.perf_counter()
        ck.save(1, state, {"pos": 1})
        save_s = time.perf_counter() - t0
        files = ck._files(1, os.path.join(ck.dir, "1"))  # noqa: SLF001 -- the files the digest covers
        nbytes = sum(os.path.getsize(p) for p in files.values())
        t0 = time.perf_counter()
        digest_files(files)
        warm_s = time.perf_counter() - t0
        _drop_cache(files.values())
        t0 = time.perf_counter()
        assert first_mismatch(read_digest(ck._digest_path(1)), files) is None  # noqa: SLF001
        cold_s = time.perf_counter() - t0
        _drop_cache(files.values())
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}
        del state
        t0 = time.perf_counter()
        out = ck.mngr.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        jax.block_until_ready(dict(out["state"]))
        restore_s = time.perf_counter() - t0
        ck.close()
        gb = nbytes / 1e9
        buf = os.urandom(256 << 20)
        t0 = time.perf_counter()
        hashlib.sha256(buf).digest()
        one_core = len(buf) / (time.perf_counter() - t0) / 1e9
        print(f"checkpoint: {gb:.2f} GB in {len(files)} files, {os.cpu_count()} cores; sha256 on one core "
              f"{one_core:.2f} GB/s")
        for what, s in (("orbax save", plain_s), ("save with digest (Checkpointer)", save_s),
                        ("hash, files in page cache", warm_s), ("verify from disk (digest check)", cold_s),
                        ("orbax restore from disk", restore_s)):
            print(f"  {what:<34} {s:8.2f} s  {gb / s:6.2f} GB/s")
        print(f"  save with digest / orbax save: {save_s / plain_s:.2f}x; verify / restore: {cold_s / restore_s:.2f}x "
              "(a resume reads the step twice: once to verify, once to restore)")
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
