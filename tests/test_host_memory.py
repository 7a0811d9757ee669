"""farskip_jax/kernels/host_memory.py: with the settings applied, a freed 256 MiB block is reused (no fresh
page faults when it is allocated and written again); without them glibc maps it afresh. Each case runs
in a fresh process (malloc settings are per process)."""

import json
import os
import subprocess
import sys

import pytest

_PROBE = r"""
import json, resource, numpy as np
from numpy._core.multiarray import _set_madvise_hugepage
_set_madvise_hugepage(False)  # 4 KiB pages, so the fault count measures pages mapped afresh
import sys
from farskip_jax.kernels.host_memory import keep_freed_memory
applied = keep_freed_memory(sys.argv[1] if len(sys.argv) > 1 else None)  # kernels.host_malloc
def faults_of_fresh_block():
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.ones(64 * 2 ** 20, np.float32)  # 256 MiB: above glibc's mmap threshold
    r1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    del a
    return r1 - r0
faults_of_fresh_block()
print(json.dumps({"applied": applied, "faults": faults_of_fresh_block()}))
"""


def _probe(mode: str | None, env_mode: str | None = None) -> dict:
    """mode: kernels.host_malloc passed in; env_mode: its environment override FARSKIP_HOST_MALLOC."""
    env = dict(os.environ)
    env.pop("FARSKIP_HOST_MALLOC", None)
    if env_mode is not None:
        env["FARSKIP_HOST_MALLOC"] = env_mode
    out = subprocess.run([sys.executable, "-c", _PROBE, *([mode] if mode else [])], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_freed_block_is_reused_only_when_resident():
    resident = _probe(None)  # the default is resident
    default = _probe("default")  # kernels.host_malloc: default
    assert _probe(None, env_mode="default")["applied"] is False  # the environment override
    if not resident["applied"]:
        pytest.skip("not glibc: keep_freed_memory is a no-op here")
    pages = 256 * 2 ** 20 // 4096
    assert default["applied"] is False and default["faults"] > pages // 2  # mapped afresh: ~1 fault per page
    assert resident["faults"] < pages // 50  # the freed block came back from the heap, already mapped


def test_bad_mode_is_one_clear_error():
    env = dict(os.environ, FARSKIP_HOST_MALLOC="huge")
    code = ("from farskip_jax.kernels.host_memory import keep_freed_memory\n"
            "from farskip_jax.errors import ConfigError\n"
            "try:\n    keep_freed_memory()\nexcept ConfigError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "ERR FARSKIP_HOST_MALLOC='huge'" in out.stdout and "'resident'" in out.stdout and "'default'" in out.stdout
