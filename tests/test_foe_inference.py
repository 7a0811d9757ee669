"""Federation of Experts at inference (inference.layout=foe, serving/foe.py) on CPU devices.

1. H = 4 groups on 4 devices (one group per device, the FoE paper's setting): generation with the KV
   cache on the layout (cache rows of group h on device h) gives the one-device FoE model's logits
   (fp32, 1e-5) and tokens, under standard and FarSkip connectivity.
2. The compiled decode program (XLA:CPU, the layout's compiler options): no all-to-all; standard has
   ONE cross-group sum of the stream per layer (attention sum + the previous routed sum) plus the
   last routed sum; FarSkip two per MoE layer (attention, routed), not combined; besides them one
   all-reduce per layer of the shared experts / dense MLP split over the groups. Under FarSkip the
   MoE of layer k does not wait for layer k's attention sum (standard's does: the check can fail)
   and attention of layer k + 1 not for layer k's routed sum.
"""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from farskip_jax.config import FarSkipConfig, load_config
from farskip_jax.errors import ConfigError
from farskip_jax.serving.generate import generate, init_cache
from farskip_jax.serving.programs import decode_program, serving_model
from farskip_jax.model.transformer import Transformer
from farskip_jax.parallel.mesh import make_mesh
from test_parallel_overlap import entry_graph, reachable_from

H = 4
L = 3
BASE = ["model.vocab_size=64", "model.d_model=32", f"model.num_layers={L}", "model.num_heads=8", "model.num_kv_heads=4",
        "model.mlp_hidden=64", "model.first_k_dense=1", "model.max_seq_len=128", "runtime.attention_impl=naive",
        "moe.num_experts=8", "moe.top_k=4", "moe.expert_hidden=32", "moe.num_shared_experts=1",
        "runtime.capacity_factor=null", "runtime.dispatch=local", f"runtime.num_groups={H}", "inference.layout=foe",
        f"mesh.expert={H}", "mesh.data=1"]
FARSKIP = FarSkipConfig(preset="farskip")


def _cfg(*extra):
    return load_config(None, [*BASE, *extra])


@pytest.fixture(scope="module")
def reference():
    """(cfg, one-device FoE model with weights large enough that greedy paths differ, its state)."""
    cfg = _cfg()
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    nnx.update(model, jax.tree.map(lambda x: 3.0 * x, nnx.state(model, nnx.Param)))
    return cfg, model, nnx.state(model)


@pytest.mark.parametrize("fs,ep,dispatch", [(FarSkipConfig(), H, "local"), (FARSKIP, H, "local"),
                                            (FARSKIP, 2 * H, "all_to_all")],
                         ids=["standard", "farskip", "farskip_two_devices_per_group"])
def test_generation_on_the_foe_layout_equals_one_device(reference, fs, ep, dispatch):
    _, one, state = reference
    cfg = _cfg(f"mesh.expert={ep}", f"runtime.dispatch={dispatch}")
    model, layout = serving_model(cfg, None, state, make_mesh(cfg.mesh, jax.devices()[:ep]))
    assert dict(layout.mesh.shape)["group"] == H and dict(layout.mesh.shape)["expert"] == ep // H
    q = model.blocks()[1].attn.q_proj.w
    assert q.sharding.spec[1] == ("group", "tensor")  # each device holds its group's heads only
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8]]
    want = generate(one, prompts, 4, farskip=fs)
    got = generate(model, prompts, 4, farskip=fs, layout=layout)
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert len(set(want.tokens[0, 5:].tolist())) > 1  # a non-degenerate path
    k = init_cache(model, 2, 16, layout)[1][0]
    assert k.shape[0] == H * 2 and k.sharding.spec[0] == ("group", "data", "fsdp", "expert")
    assert k.addressable_shards[0].data.shape[0] == 2 // (ep // H)  # group 0's rows on its devices


def test_foe_layout_config_errors():
    with pytest.raises(ConfigError, match="runtime.num_groups"):
        load_config(None, [*BASE, "runtime.num_groups=1"])
    cfg = _cfg("mesh.expert=2")
    with pytest.raises(ConfigError, match="mesh.expert"):
        serving_model(cfg, None, {}, make_mesh(cfg.mesh, jax.devices()[:2]))
    cfg = _cfg(f"mesh.expert={2 * H}")  # two devices per group need an exchange
    with pytest.raises(ConfigError, match="runtime.dispatch=all_to_all"):
        serving_model(cfg, None, {}, make_mesh(cfg.mesh, jax.devices()[:2 * H]))


def _compiled(fs):
    cfg = _cfg()
    mesh = make_mesh(cfg.mesh, jax.devices()[:H])
    fn, args = decode_program(load_config(None, [*BASE, f"farskip.preset={fs}"]), mesh, batch=2, max_len=16)
    return fn.lower(*args).compile().as_text()


def _collectives(text):
    out = []
    for line in text.splitlines():
        m = re.search(r"\s(all-reduce|all-to-all|all-gather|reduce-scatter)(-start)?\(", line)
        if m and "ENTRY" not in line:
            name = re.search(r'op_name="([^"]+)"', line)
            out.append((m.group(1), name.group(1) if name else ""))
    return out


@pytest.fixture(scope="module")
def decode_hlo():
    return {fs: _compiled(fs) for fs in ("standard", "farskip")}


def test_one_cross_group_sum_per_layer_and_no_all_to_all(decode_hlo):
    std = _collectives(decode_hlo["standard"])
    fsk = _collectives(decode_hlo["farskip"])
    for ops in (std, fsk):
        assert not [o for o in ops if o[0] in ("all-to-all", "reduce-scatter")]
    sums = lambda ops, scope: sorted(n for k, n in ops if k == "all-reduce" and scope.search(n))  # noqa: E731
    attn, routed = re.compile(r"layer_\d+/group_sum"), re.compile(r"layer_\d+/moe/group_sum")
    # standard: layer k's sum carries layer k-1's routed outputs; only the last layer's routed sum is alone
    assert len(sums(std, attn)) == L and len(sums(std, routed)) == 1
    # FarSkip: layer 0 (dense) one sum; every MoE layer an attention sum and a routed sum, not combined
    assert len(sums(fsk, attn)) == L and len(sums(fsk, routed)) == L - 1
    assert not [n for k, n in fsk if k == "all-reduce" and n.count("group_sum") > 1]
    for ops in (std, fsk):  # the split shared experts (MoE layers) and dense MLP (layer 0): one sum each
        assert len([n for k, n in ops if k == "all-reduce" and "shared_experts" in n]) == L - 1
        assert len([n for k, n in ops if k == "all-reduce" and "dense_mlp" in n]) == 1


def _ops(graph, scope, all_reduce=False):
    users, op_name, opcode = graph
    return {i for i, n in op_name.items() if scope in (n or "") and (not all_reduce or opcode[i].startswith("all-reduce"))}


@pytest.mark.parametrize("fs", ["standard", "farskip"])
def test_farskip_sub_blocks_do_not_wait_for_the_cross_group_sums(decode_hlo, fs):
    graph = entry_graph(decode_hlo[fs])
    users = graph[0]
    k = 1
    attn_sum = {i for i in _ops(graph, f"layer_{k}/group_sum", True) if "moe/group_sum" not in graph[1][i]}
    router = _ops(graph, f"layer_{k}/moe/router")
    assert attn_sum and router
    # standard: the MoE of layer k reads P_k, the cross-group sum; FarSkip: R_{k-1}, which it does not wait for
    assert bool(router & reachable_from(users, attn_sum)) == (fs == "standard")
    if fs == "farskip":  # attention of layer k+1 reads N_k: not the routed sum of layer k
        routed_sum = _ops(graph, f"layer_{k}/moe/group_sum", True)
        attn_next = _ops(graph, f"layer_{k + 1}/attention")
        assert routed_sum and attn_next and not attn_next & reachable_from(users, routed_sum)


def test_eval_generate_on_the_foe_layout_from_an_hf_folder(tmp_path, capsys):
    """eval.py --hf DIR --mode generate with inference.layout=foe (4 groups, one per device, 2 data
    replicas on the 8 devices) = one-device generation of the same folder imported as a 4-group FoE."""
    import json

    import eval as eval_entry
    from farskip_jax.convert import export_hf, import_hf
    from farskip_jax.data.tokenizer import ByteTokenizer
    from test_inference_layout import reference as random_model

    cfg = load_config(None, ["model.vocab_size=320", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
                             "model.num_kv_heads=4", "model.mlp_hidden=64", "model.first_k_dense=0",
                             "moe.num_experts=8", "moe.top_k=4", "moe.expert_hidden=16", "moe.num_shared_experts=0",
                             "farskip.preset=farskip"])
    with pytest.warns(UserWarning, match="standard connectivity"):  # Mixtral itself has no FarSkip
        out = export_hf(random_model(cfg), cfg, str(tmp_path / "hf"), family="mixtral")
    prompts = ["def main(", "import os"]
    foe = ["runtime.num_groups=4", "runtime.scan_layers=false"]
    argv = ["--hf", out, "--tokenizer", "byte", "--mode", "generate", "--prompt", prompts[0], "--prompt", prompts[1],
            "eval.max_new_tokens=3", "inference.layout=foe", "mesh.data=2", "mesh.expert=4", "runtime.dispatch=local", *foe]
    assert eval_entry.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    tok = ByteTokenizer()
    ids = [[tok.bos_id] + list(tok.encode(p)) for p in prompts]
    icfg, imported = import_hf(out, overrides=foe)
    g = generate(imported, ids, 3, farskip=icfg.farskip, eos_id=tok.eos_id)
    assert res["layout"] == "foe" and res["farskip"]["preset"] == "farskip"
    assert res["completions"] == [tok.decode(g.completion(i)) for i in range(2)]
