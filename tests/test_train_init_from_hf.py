"""Pretraining can start from an HF checkpoint folder (`init_from_hf`): shape and weights come from it."""


import jax
import numpy as np

import torch  # the hf extra: CI installs it, these tests never skip
import transformers

from farskip_jax.config import load_config  # noqa: E402
from farskip_jax.convert import import_hf  # noqa: E402
from farskip_jax.loading.load import load_run  # noqa: E402
from farskip_jax.train.trainer import train  # noqa: E402


def test_pretrain_from_hf_folder_starts_from_its_weights(tmp_path):
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen3MoeConfig(vocab_size=320, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                         num_experts_per_tok=2, num_hidden_layers=2, initializer_range=0.1,
                                         max_position_embeddings=128, tie_word_embeddings=False)
    hf_dir = str(tmp_path / "hf")
    transformers.Qwen3MoeForCausalLM(hf_cfg).save_pretrained(hf_dir)
    run_dir = str(tmp_path / "run")
    # one step with a negligible learning rate and no weight decay: the saved parameters are the imported ones
    cfg = load_config("configs/tiny.yaml", [f"init_from_hf={hf_dir}", f"train.run_dir={run_dir}", "train.steps=1", "train.warmup_steps=0", "train.lr=1e-9", "train.weight_decay=0",
                                            "train.batch_size=8", "train.seq_len=16", "train.eval_every=0",
                                            "train.tensorboard=false", "train.peak_flops=1e9"])
    assert cfg.model.d_model == 128  # the user's config says tiny; the checkpoint decides the shape
    res = train(cfg)
    assert res.status == "done"
    run_cfg, _, st = load_run(run_dir, "latest")
    assert run_cfg.model.d_model == 32 and run_cfg.moe.num_experts == 4 and run_cfg.model.num_layers == 2
    _, ref = import_hf(hf_dir)
    from flax import nnx
    ref_params = nnx.to_pure_dict(nnx.state(ref, nnx.Param))
    got = nnx.to_pure_dict(st["params"]) if not isinstance(st["params"], dict) else st["params"]
    flat_ref = dict(jax.tree_util.tree_flatten_with_path(ref_params)[0])
    flat_got = dict(jax.tree_util.tree_flatten_with_path(got)[0])
    assert len(flat_ref) == len(flat_got) > 10
    for k, v in flat_ref.items():
        np.testing.assert_allclose(np.asarray(flat_got[k]), np.asarray(v), rtol=0, atol=1e-7, err_msg=str(k))
