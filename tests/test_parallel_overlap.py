"""No false dependency under FarSkip, read off the compiled (fused, scheduled) HLO of the EP model.

FarSkip (docs/design.md section 1) promises two independences in layer k:
  1. attention of layer k does not wait for the combine all-to-all of layer k-1;
  2. the dispatch all-to-all of layer k does not wait for attention of layer k.
Both are checked as graph reachability in the compiled ENTRY computation (operands and control
predecessors), so a dependency introduced by XLA itself (e.g. fusing a stream add into the attention
input) would fail the test too. Standard connectivity is the positive control: there both
dependencies exist, so the check is known to be able to fail.
"""

import re
from collections import defaultdict

import jax
import pytest
from flax import nnx

import multihost_worker as mw
from farskip_jax.config import FarSkipConfig
from farskip_jax.parallel import create_model, make_mesh, shard_batch

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.*)$")
_REF = re.compile(r"%[\w.\-]+")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def entry_graph(hlo_text: str):
    """ENTRY instructions -> (users: name -> set of names, op_name: name -> str, opcode: name -> str)."""
    lines = hlo_text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("ENTRY"))
    users, op_name, opcode = defaultdict(set), {}, {}
    body = []
    for line in lines[start + 1:]:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if m:
            body.append((m.group(1), m.group(2)))
    names = {n for n, _ in body}
    for name, rest in body:
        meta = _OP_NAME.search(rest)
        op_name[name] = meta.group(1) if meta else ""
        code = re.search(r"\s([a-z][\w\-]*)\(", rest)
        opcode[name] = code.group(1) if code else ""
        for ref in set(_REF.findall(rest.split("metadata=")[0])):
            if ref in names and ref != name:
                users[ref].add(name)
    return users, op_name, opcode


def reachable_from(users, roots):
    seen, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        for u in users.get(n, ()):
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


@pytest.fixture(scope="module")
def compiled_forward():
    cfg = mw.tiny_config(ep=4)
    mesh = make_mesh(cfg.mesh)
    graphdef, state = nnx.split(create_model(cfg, mesh))
    toks = shard_batch(mw.tokens(), mesh)

    def hlo(preset):
        fs = FarSkipConfig(preset=preset)
        f = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t, farskip=fs).logits)
        return f.lower(state, toks).compile().as_text()

    return {p: entry_graph(hlo(p)) for p in ("standard", "farskip")}


def _ops(op_name, opcode, scope, kind=None):
    return {n for n, o in op_name.items() if scope in o and (kind is None or opcode[n] == kind)}


@pytest.mark.parametrize("preset,independent", [("farskip", True), ("standard", False)])
def test_attention_does_not_wait_for_previous_combine(compiled_forward, preset, independent):
    users, op_name, opcode = compiled_forward[preset]
    combine_0 = _ops(op_name, opcode, "layer_0/moe/shard_map/combine", "all-to-all")
    attention_1 = _ops(op_name, opcode, "layer_1/attention")
    assert combine_0 and attention_1
    waiting = attention_1 & reachable_from(users, combine_0)
    assert (not waiting) == independent, sorted(op_name[n] for n in waiting)[:5]


@pytest.mark.parametrize("preset,independent", [("farskip", True), ("standard", False)])
def test_dispatch_does_not_wait_for_attention(compiled_forward, preset, independent):
    users, op_name, opcode = compiled_forward[preset]
    attention_1 = _ops(op_name, opcode, "layer_1/attention")
    dispatch_1 = _ops(op_name, opcode, "layer_1/moe/shard_map/dispatch", "all-to-all")
    assert dispatch_1
    waiting = dispatch_1 & reachable_from(users, attention_1)
    assert (not waiting) == independent


def test_dispatch_and_combine_are_separate_collectives(compiled_forward):
    _, op_name, opcode = compiled_forward["farskip"]
    for layer in (0, 1):
        assert _ops(op_name, opcode, f"layer_{layer}/moe/shard_map/dispatch", "all-to-all")
        assert _ops(op_name, opcode, f"layer_{layer}/moe/shard_map/combine", "all-to-all")


def test_token_chunks_equal_one_exchange_and_split_the_collectives():
    """AllToAllCompute(chunks=2): dropless, each device's tokens in two chunks with their own
    dispatch / experts / combine; same values as one exchange (and as the single-device path), and
    the compiled program has twice the token all-to-alls."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from farskip_jax.config import MeshConfig, RuntimeConfig
    from farskip_jax.model.experts import ExpertWeights, local_routed_compute
    from farskip_jax.model.router import RouteResult
    from farskip_jax.parallel.ep import AllToAllCompute
    from farskip_jax.parallel.mesh import BATCH_AXES

    e, k, d, h, t = 8, 2, 16, 32, 64
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(t, 1, d)).astype(np.float32)
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(t)])[:, None].astype(np.int32)
    w = rng.random((t, 1, k)).astype(np.float32)
    ew = [rng.normal(size=s).astype(np.float32) * 0.1 for s in ((e, d, h), (e, d, h), (e, h, d))]
    cfg = RuntimeConfig(capacity_factor=None, gmm="einsum")
    tok, wsh = NamedSharding(mesh, P(BATCH_AXES, None, None)), NamedSharding(mesh, P("expert", None, None))
    args = (jax.device_put(x, tok), jax.device_put(idx, tok), jax.device_put(w, tok),
            *(jax.device_put(a, wsh) for a in ew))

    def run(backend):
        def f(x, idx, w, wg, wu, wd):
            out = backend(x, RouteResult(idx, w, None, None, None), ExpertWeights(wg, wu, wd), cfg)
            return out.y, out.dropped

        fn = jax.jit(f)
        return fn(*args), fn.lower(*args).compile().as_text()

    (y1, d1), _ = run(AllToAllCompute(mesh))
    (y2, d2), text = run(AllToAllCompute(mesh, chunks=2))
    ref = local_routed_compute(jnp.asarray(x)[None, :, 0], RouteResult(jnp.asarray(idx)[None, :, 0],
                               jnp.asarray(w)[None, :, 0], None, None, None), ExpertWeights(*map(jnp.asarray, ew)), cfg)
    assert int(d1) == int(d2) == 0
    np.testing.assert_allclose(np.asarray(y2), np.asarray(y1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y2)[:, 0], np.asarray(ref.y)[0], rtol=1e-4, atol=1e-5)
    big = [l for l in text.splitlines() if " all-to-all(" in l and f",{d}]" in l.split("all-to-all(")[0]]
    assert len(big) == 4  # dispatch + combine per chunk
