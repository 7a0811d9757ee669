"""Scanned KV-cache decoding under runtime.scan_layers (serving/generate.py, the layer loop's indexed scans).

Oracles: the unrolled decode of the same weights in per-layer form (scan_layers=false, serving/generate.py)
and the one-device full forward of each row's own tokens (tests/test_generate_mesh.py row_oracle).
Ragged prompts (lengths 7, 2, 5), greedy; fp32, rtol 1e-5 (atol 1e-5 of the logits' scale). Then the
program: the decode step's jaxpr runs the stacks as scans whose operands are the whole stacked
weights, with no slice of a stack outside a loop, and the compiled entry computation hands the stacked
parameters to while loops only; both checks fail on the unrolled program of the same stacked model
(scan=False: one slice per layer). On the 8-device tp_ep mesh the scanned decode equals one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jcore

from farskip_jax.config import FarSkipConfig, MeshConfig, replace
from farskip_jax.serving.generate import generate, init_cache, make_decode_fn
from farskip_jax.loading import layer_keys
from farskip_jax.model import stacking
from farskip_jax.model.transformer import Transformer
from farskip_jax.serving.tp_ep import TpEpLayout, inference_model
from farskip_jax.parallel.mesh import make_mesh
from test_generate_mesh import NEW, PROMPTS
from test_inference_layout import assert_close, reference, tiny_cfg

# fast XLA:CPU compiles (these tests are compile-bound); the numerics are the default level's
OPTS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
MLA = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def cfg_of(scan: bool, mesh=None, **model_kw):
    """4 layers: stacks [layer 0 (dense)] + [layers 1-3 (MoE)] under scan_layers."""
    return replace(tiny_cfg(mesh, num_layers=4, **model_kw), **{"runtime.scan_layers": scan})


def stacked_model(loop, cfg):
    """The scanned model of cfg holding `loop`'s weights (model/stacking.py stack_flat)."""
    flat = {layer_keys.tuple_path_key(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(loop))}
    flat = layer_keys.stack_flat(flat, stacking.plan_segments(cfg), stack=np.stack)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    leaves = [(p, v.replace(jnp.asarray(flat[layer_keys.tuple_path_key(p)]))) for p, v in nnx.to_flat_state(abstract)]
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def decode_fn(model, fs, layout=None, scan=None):
    fn = make_decode_fn(nnx.split(model)[0], fs, layout, scan=scan, jit=False)
    opts = {**OPTS, **(layout.compiler_options() if layout is not None else {})}
    return jax.jit(fn, donate_argnums=3, compiler_options=opts)


def row_oracle(model, out, fs):
    """Per row: the full forward of its own prompt + generated tokens (right-padded, which a causal
    model cannot see) at the positions that produced each new token -> [b, NEW, V]."""
    seqs = [np.concatenate([p, out.completion(i)[:-1]]) for i, p in enumerate(PROMPTS)]
    batch = np.zeros((len(seqs), max(len(q) for q in seqs)), np.int32)
    for i, q in enumerate(seqs):
        batch[i, :len(q)] = q
    graphdef = nnx.split(model)[0]
    full = np.asarray(jax.jit(lambda st, t: nnx.merge(graphdef, st)(t, farskip=fs).logits,
                              compiler_options=OPTS)(nnx.state(model), batch))
    return np.stack([full[i, len(p) - 1:len(p) - 1 + NEW] for i, p in enumerate(PROMPTS)])


_RESULTS: dict = {}


def run_case(case):
    """(unrolled model, scanned model with its weights, scanned generation, unrolled generation); cached."""
    if case not in _RESULTS:
        model_kw, fs = CASES[case]
        loop = reference(cfg_of(False, **model_kw))
        scan = stacked_model(loop, cfg_of(True, **model_kw))
        out = generate(scan, PROMPTS, NEW, farskip=fs, decode_fn=decode_fn(scan, fs))
        unrolled = generate(loop, PROMPTS, NEW, farskip=fs, decode_fn=decode_fn(loop, fs))
        _RESULTS[case] = loop, scan, out, unrolled
    return _RESULTS[case]


CASES = {  # model keys, connectivity
    "gqa_standard": (dict(num_kv_heads=2), FarSkipConfig()),
    # layers 2-3 converted: the MoE stack runs layer 1 (a scan of 1), then layers 2-3 (a scan of 2)
    "gqa_farskip_last2": (dict(num_kv_heads=2), FarSkipConfig(preset="farskip", layers="last:2")),
    "mla_farskip_d2": (MLA, FarSkipConfig(preset="farskip", skip_distance=2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_scanned_decode_equals_unrolled_and_full_forward(case):
    fs = CASES[case][1]
    loop, scan, out, unrolled = run_case(case)
    assert_close(out.logits, unrolled.logits)
    np.testing.assert_array_equal(out.tokens, unrolled.tokens)
    want = row_oracle(loop, out, fs)  # every prefix: prompt + each generated token, per row
    assert_close(out.logits, want)
    np.testing.assert_array_equal(np.stack([out.completion(i) for i in range(len(PROMPTS))]), want.argmax(-1))
    cache = init_cache(scan, 3, 8)  # the scanned model's cache is stacked: [stack][block] (k, v) [repeats, ...]
    assert [c[0][0].shape[0] for c in cache] == [1, 3]
    if case == "gqa_farskip_last2":  # the connectivity reached the scanned path
        assert np.abs(row_oracle(loop, out, FarSkipConfig()) - out.logits).max() > 1e-3


# --------------------------------------------------------------------------------------------------
# the program: scans over whole stacked weights, no slice of a stack outside a loop
# --------------------------------------------------------------------------------------------------

LOOPS = {"scan", "while"}
SLICING = {"slice", "dynamic_slice", "squeeze", "gather"}


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for x in v if isinstance(v, (tuple, list)) else [v]:
            if isinstance(x, jcore.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jcore.Jaxpr):
                yield x


def _walk(jaxpr, stacked: set, sliced: list, looped: set) -> None:
    """Eqns outside loops that slice a stacked weight -> sliced; stacked weights handed to a loop -> looped."""
    for e in jaxpr.eqns:
        ins = [v for v in e.invars if not isinstance(v, jcore.Literal) and v in stacked]
        if e.primitive.name in LOOPS:
            looped.update(ins)
            continue
        if ins and e.primitive.name in SLICING:
            sliced.append(e.primitive.name)
        for sub in _sub_jaxprs(e):  # jit, custom_vjp, shard_map bodies: follow the stacked operands in
            inner = {iv for ov, iv in zip(e.invars, sub.invars) if not isinstance(ov, jcore.Literal) and ov in stacked}
            if inner:
                _walk(sub, inner, sliced, looped)


def stacked_weight_use(model, fs, scan: bool, layout=None) -> tuple[int, int, int]:
    """(stacked weights of repeats > 1, slicing ops on them outside loops, how many enter a loop)
    in the decode step's jaxpr."""
    state = nnx.state(model)
    fn = make_decode_fn(nnx.split(model)[0], fs, layout, scan=scan, jit=False)
    cache = init_cache(model, 3, 8, layout)
    jx = jax.make_jaxpr(fn)(state, jnp.zeros((3, 1), jnp.int32), jnp.int32(5), cache, jnp.zeros((3,), jnp.int32))
    leaves = jax.tree_util.tree_leaves_with_path(state)
    assert len(leaves) <= len(jx.jaxpr.invars)
    stacked = {var for (path, x), var in zip(leaves, jx.jaxpr.invars)
               if "stacks" in jax.tree_util.keystr(path) and x.shape[0] > 1}
    sliced, looped = [], set()
    _walk(jx.jaxpr, stacked, sliced, looped)
    return len(stacked), len(sliced), len(looped)


def entry_users_of_stacked_params(text: str, repeats: int) -> set:
    """Opcodes (fusion: its kind and callee's name) of the entry-computation instructions that read
    a parameter with a leading dim `repeats` named state...stacks... (compiled HLO text)."""
    entry = text[text.index("\nENTRY"):].split("\n}\n")[0].splitlines()
    params = {ln.split("=")[0].strip() for ln in entry
              if " parameter(" in ln and "stacks" in ln.split("=")[0] and f"[{repeats}," in ln}
    users = set()
    for ln in entry:
        if "=" not in ln or " parameter(" in ln:
            continue
        rhs = ln.split("=", 1)[1]
        args = rhs[rhs.index("(") + 1:].split(")")[0] if "(" in rhs else ""
        if any(p in [a.strip() for a in args.split(",")] for p in params):
            users.add(rhs.split("(")[0].split()[-1])
    return users


def test_scanned_decode_step_has_no_per_layer_weight_slices():
    """Standard connectivity (the MoE stack is one scan of 3). The scanned step: every stacked weight
    enters a scan whole, none is sliced outside one, and the compiled entry hands the stacked
    parameters to a while loop only. The unrolled step of the same stacked model (scan=False: the
    former program, per-layer views) slices each weight once per layer: both checks fail there."""
    _, scan, _, _ = run_case("gqa_standard")
    fs = FarSkipConfig()
    n, sliced, looped = stacked_weight_use(scan, fs, scan=True)
    assert n >= 10 and sliced == 0 and looped == n
    n_u, sliced_u, looped_u = stacked_weight_use(scan, fs, scan=False)
    assert n_u == n and sliced_u >= 3 * n and looped_u == 0  # the check can fail

    args = lambda sc: (nnx.state(scan), jnp.zeros((3, 1), jnp.int32), jnp.int32(5),  # noqa: E731
                       init_cache(scan, 3, 8), jnp.zeros((3,), jnp.int32))
    text = decode_fn(scan, fs).lower(*args(True)).compile().as_text()
    assert " while(" in text[text.index("\nENTRY"):]
    assert entry_users_of_stacked_params(text, 3) <= {"tuple", "while"}, entry_users_of_stacked_params(text, 3)
    text_u = decode_fn(scan, fs, scan=False).lower(*args(False)).compile().as_text()
    assert " while(" not in text_u[text_u.index("\nENTRY"):]
    assert entry_users_of_stacked_params(text_u, 3) - {"tuple", "while"}  # slices (fusions) of the stacks


def test_scanned_decode_on_the_mesh_equals_one_device():
    """tp_ep layout on tensor=8 (the 2 kv heads replicated over 4 ranks each), FarSkip on the last 2
    layers (a split stack): the scanned decode on 8 devices = the scanned decode on one device, the
    stacked cache sharded (layers, data, -, tensor, -), and no stacked weight sliced outside a scan."""
    _, one, ref, _ = run_case("gqa_farskip_last2")
    fs = CASES["gqa_farskip_last2"][1]
    cfg = one.cfg
    layout = TpEpLayout(make_mesh(MeshConfig(data=1, tensor=8)))
    model = inference_model(cfg, layout.mesh, nnx.state(one))
    out = generate(model, PROMPTS, NEW, farskip=fs, layout=layout, decode_fn=decode_fn(model, fs, layout))
    assert_close(out.logits, ref.logits)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    cache = init_cache(model, 3, 8, layout)
    assert cache[1][0][0].sharding.spec == layout.stacked_cache_sharding().spec
    # 2 kv heads, each replicated on 4 of the 8 tensor ranks: one cache slot per rank
    assert cache[1][0][0].shape == (3, 3, 8, 8, cfg.model.resolved_head_dim)
    assert model.stacks[1].blocks[0].attn.o_proj.w[...].sharding.spec[:2] == (None, "tensor")
    n, sliced, looped = stacked_weight_use(model, fs, scan=True, layout=layout)
    assert n >= 10 and sliced == 0 and looped == n
