"""HF import onto a mesh places the model as the trainer does (parallel.build): a Federation of
Experts with expert parallelism lands on the FoE group x expert mesh (experts over both axes, not
replicated across groups) with the FoE exchange, and `init_from_hf` keeps the user's runtime.num_groups.
That the FoE mesh computes what one device computes is tests/test_foe_train.py's; no forward is
compiled here."""

import numpy as np
from flax import nnx

from farskip_jax.config import Config, MeshConfig, from_dict
from farskip_jax.convert import export_hf
from farskip_jax.loading.families import family_by_name
from farskip_jax.loading.load import load_hf
from farskip_jax.model import Transformer
from farskip_jax.parallel.foe import FoECompute
from farskip_jax.parallel.mesh import make_mesh


def test_load_hf_foe_config_lands_on_the_foe_mesh(tmp_path):
    hf = dict(model_type="mixtral", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    src = from_dict(Config, family_by_name("mixtral").config_tree(hf))
    model = nnx.eval_shape(lambda: Transformer(src, rngs=nnx.Rngs(0)))  # filled from numpy: nothing compiled
    rng = np.random.default_rng(0)
    for _, v in nnx.to_flat_state(nnx.state(model)):
        v.set_value(rng.standard_normal(v.get_value().shape).astype(v.get_value().dtype) * 0.1)
    export_hf(model, src, str(tmp_path / "hf"), family="mixtral")
    mesh = make_mesh(MeshConfig(data=2, expert=4))  # the plain mesh a caller may hold
    cfg, gd, st = load_hf(str(tmp_path / "hf"), mesh=mesh,
                          overrides={"runtime.num_groups": 2, "runtime.dispatch": "all_to_all", "mesh.data": 2, "mesh.expert": 4})
    assert cfg.runtime.num_groups == 2
    w = st["params"]["layers"][0]["moe"]["experts"]["w_gate"].get_value()
    assert dict(w.sharding.mesh.shape) == {"data": 2, "fsdp": 1, "group": 2, "expert": 2, "tensor": 1}
    assert w.sharding.spec[0] == ("group", "expert")
    assert {s.data.shape[0] for s in w.addressable_shards} == {1}  # 4 experts over 2 groups x 2 devices
    m = nnx.merge(gd, st["params"], st["bias"], st["rest"])
    assert isinstance(m.layers[0].moe.routed_compute, FoECompute)
    assert m.layers[0].moe.routed_compute.mesh.shape["group"] == 2

    # pretraining from the HF folder keeps the user's FoE group count (the checkpoint gives the shape)
    from farskip_jax.config import load_config
    from farskip_jax.train.trainer import shape_from_hf

    run = shape_from_hf(load_config("configs/foe_tiny.yaml", [f"init_from_hf={tmp_path / 'hf'}"]))
    assert run.runtime.num_groups == 2 and run.model.d_model == 32 and run.moe.num_experts == 4
