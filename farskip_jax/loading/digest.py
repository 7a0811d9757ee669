"""SHA-256 digests of a checkpoint's files, written when it is saved and checked when it is read.

    d = digest_files({"state/a": "/abs/.../state/a", "data_state/process_0.json": "..."})
    write_digest(path, d); d = read_digest(path)
    bad = first_mismatch(d, {"state/a": "/abs/...", ...})   # None, or "state/a (bytes 0-67108863): ..."

Each file is hashed in blocks of BLOCK bytes, the blocks of all files at once on a thread pool
(hashlib releases the GIL while it hashes), so reading back a large checkpoint runs at the disk's
bandwidth where one core would not keep up. A digest names every file with its size and block hashes.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
from typing import Optional

BLOCK = 64 << 20
FORMAT = "farskip_jax checkpoint digest 1: sha256 of each 64 MiB block"


def _workers() -> int:
    return max(4, min(32, 2 * (os.cpu_count() or 1)))


def _hash_block(path: str, start: int, size: int) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < size:
            chunk = os.pread(fd, min(8 << 20, size - done), start + done)
            if not chunk:
                break
            h.update(chunk)
            done += len(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def digest_files(files: dict) -> dict:
    """{name: {"size": bytes, "sha256": [hex per BLOCK]}} of {name: absolute path}."""
    jobs = []
    sizes = {}
    for name, path in files.items():
        sizes[name] = size = os.path.getsize(path)
        jobs += [(name, path, start, min(BLOCK, size - start)) for start in range(0, max(size, 1), BLOCK)]
    with concurrent.futures.ThreadPoolExecutor(_workers()) as pool:
        hashes = list(pool.map(lambda j: _hash_block(j[1], j[2], j[3]), jobs))
    out = {name: {"size": sizes[name], "sha256": []} for name in files}
    for (name, _, _, _), h in zip(jobs, hashes):
        out[name]["sha256"].append(h)
    return out


def first_mismatch(expected: dict, files: dict) -> Optional[str]:
    """None when `files` ({name: path}) hash to `expected` (a digest_files result); else what differs
    first: a missing or extra file, a size, or the byte range of a block."""
    missing = sorted(set(expected) - set(files))
    if missing:
        return f"{missing[0]} is missing"
    extra = sorted(set(files) - set(expected))
    if extra:
        return f"{extra[0]} was not part of the checkpoint when it was saved"
    for name, path in sorted(files.items()):
        size = os.path.getsize(path)
        if size != expected[name]["size"]:
            return f"{name} has {size} bytes, {expected[name]['size']} when saved"
    got = digest_files(files)
    for name in sorted(files):
        for i, (a, b) in enumerate(zip(got[name]["sha256"], expected[name]["sha256"])):
            if a != b:
                end = min((i + 1) * BLOCK, expected[name]["size"]) - 1
                return f"{name} (bytes {i * BLOCK}-{end}) differs from what was saved"
    return None


def write_digest(path: str, digest: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "files": digest}, f)
    os.replace(tmp, path)


def read_digest(path: str) -> Optional[dict]:
    """The files dict of the digest at `path`; None when there is none. A digest that does not parse
    reads as {} (every file then mismatches: the step is reported, never trusted)."""
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    files = d.get("files") if isinstance(d, dict) else None
    return files if isinstance(files, dict) else {}
