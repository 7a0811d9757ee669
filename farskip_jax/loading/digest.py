"""SHA-256 digests of a checkpoint's files, written when it is saved and checked when it is read.

    d = digest_files({"state/a": "/abs/.../state/a", "data_state/process_0.json": "..."})
    write_digest(path, d); d = read_digest(path)
    bad = first_mismatch(d, {"state/a": "/abs/...", ...})   # None, or "state/a (bytes 0-67108863): ..."

Each file is hashed in blocks of BLOCK bytes, the blocks of all files at once on a thread pool
(hashlib releases the GIL while it hashes), so reading back a large checkpoint runs at the disk's
bandwidth where one core would not keep up. A digest names every file with its size and block hashes.
The processes of a multi-host run share the reading: each hashes every n-th block and they agree on
the first that differs (first_mismatch's `share` / `agree`).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
from typing import Callable, Optional

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


def _blocks(files: dict) -> list[tuple[str, str, int, int]]:
    """(name, path, start, size) of every BLOCK of `files` ({name: path}), in name order (a file of 0
    bytes is one empty block)."""
    out = []
    for name, path in sorted(files.items()):
        size = os.path.getsize(path)
        out += [(name, path, start, min(BLOCK, size - start)) for start in range(0, max(size, 1), BLOCK)]
    return out


def _hash_blocks(blocks: list) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(_workers()) as pool:
        return list(pool.map(lambda b: _hash_block(b[1], b[2], b[3]), blocks))


def digest_files(files: dict) -> dict:
    """{name: {"size": bytes, "sha256": [hex per BLOCK]}} of {name: absolute path}."""
    blocks = _blocks(files)
    out = {name: {"size": os.path.getsize(path), "sha256": []} for name, path in files.items()}
    for (name, *_), h in zip(blocks, _hash_blocks(blocks)):
        out[name]["sha256"].append(h)
    return out


def first_mismatch(expected: dict, files: dict, share: tuple[int, int] = (0, 1),
                   agree: Optional[Callable[[int], int]] = None) -> Optional[str]:
    """None when `files` ({name: path}) hash to `expected` (a digest_files result); else what differs
    first: a missing or extra file, a size, or the byte range of a block.

    Read by several processes: share=(i, n) hashes every n-th block from the i-th only, and
    `agree(k)` (k: this share's first differing block in the order of `_blocks`, -1 for none) returns
    the first over all shares, so each byte is read once between the n processes and all of them
    return the same answer."""
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
    blocks, (i, n) = _blocks(files), share
    mine = list(range(i, len(blocks), n))
    got = _hash_blocks([blocks[k] for k in mine])
    bad = next((k for k, h in zip(mine, got) if h != expected[blocks[k][0]]["sha256"][blocks[k][2] // BLOCK]), -1)
    bad = agree(bad) if agree is not None else bad
    if bad < 0:
        return None
    name, b = blocks[bad][0], blocks[bad][2] // BLOCK
    return f"{name} (bytes {b * BLOCK}-{min((b + 1) * BLOCK, expected[name]['size']) - 1}) differs from what was saved"


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
