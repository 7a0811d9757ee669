"""Every runtime key the user sets survives loading weights: `init_from_hf` (train.shape_from_hf, the
config a run saves) and `distill.init_from_run` (fcsd.source.source_shape, the config FCSD saves).
The architecture (shapes, vocabulary) comes from the checkpoint; the run's choices stay the user's."""

import dataclasses
import os
import typing

import pytest
import torch  # the hf extra: CI installs it
import transformers
import yaml

from farskip_jax.config import MOVED_KEYS, RuntimeConfig, load_config, to_dict
from farskip_jax.errors import ConfigError

# values the keys constrain one another with (hierarchical for gpus_per_node, sharded FoE tokens for local
# attention); every other runtime key gets a non-default value derived from its type
FIXED = {"dispatch": "hierarchical", "gpus_per_node": 2, "foe_tokens": "sharded", "foe_attention": "local",
         "num_groups": 2, "capacity_factor": 1.5, "micro_batches": 2}


def non_default(name):
    f = next(f for f in dataclasses.fields(RuntimeConfig) if f.name == name)
    tp, default = typing.get_type_hints(RuntimeConfig)[name], f.default
    choices = [a for a in typing.get_args(tp) if a != default and a is not type(None)]
    if typing.get_origin(tp) is typing.Literal:
        return choices[0]
    if tp is bool:
        return not default
    if tp is int:
        return default * 2 if default else 3
    if tp is float:
        return default * 2 + 0.125
    raise AssertionError(f"no non-default value for runtime.{name} ({tp})")


def runtime_values() -> dict:
    """{runtime.<key>: a non-default value} for EVERY field of RuntimeConfig."""
    return {f"runtime.{f.name}": FIXED[f.name] if f.name in FIXED else non_default(f.name)
            for f in dataclasses.fields(RuntimeConfig)}


def runtime_of(cfg) -> dict:
    return {f"runtime.{k}": v for k, v in to_dict(cfg.runtime).items()}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen3MoeConfig(vocab_size=320, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                         num_experts_per_tok=2, num_hidden_layers=2, initializer_range=0.1,
                                         max_position_embeddings=256, tie_word_embeddings=False)
    d = str(tmp_path_factory.mktemp("hf") / "hf")
    transformers.Qwen3MoeForCausalLM(hf_cfg).save_pretrained(d)
    return d


def _ov(values: dict) -> list[str]:
    return [f"{k}={'null' if v is None else v}" for k, v in values.items()]


def test_every_runtime_key_survives_init_from_hf(hf_dir):
    from farskip_jax.train.trainer import shape_from_hf

    want = runtime_values()
    cfg = load_config("configs/tiny.yaml", [f"init_from_hf={hf_dir}"] + _ov(want))
    got = shape_from_hf(cfg)
    assert got.model.d_model == 32 and got.moe.num_experts == 4  # the architecture is the checkpoint's
    lost = {k: (v, runtime_of(got)[k]) for k, v in want.items() if runtime_of(got)[k] != v}
    assert not lost, f"runtime keys lost by init_from_hf (wanted, got): {lost}"


def test_every_runtime_key_survives_init_from_run(tmp_path):
    from farskip_jax.fcsd.source import source_shape

    run = tmp_path / "teacher"
    run.mkdir()
    src = load_config(None, ["model.d_model=64", "moe.num_experts=4"])  # the source run: another shape, defaults
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(src)))
    want = runtime_values()
    cfg = load_config(None, ["train.mode=distill", f"distill.init_from_run={run}"] + _ov(want))
    got = source_shape(cfg)
    assert got.model.d_model == 64 and got.moe.num_experts == 4
    lost = {k: (v, runtime_of(got)[k]) for k, v in want.items() if runtime_of(got)[k] != v}
    assert not lost, f"runtime keys lost by distill.init_from_run (wanted, got): {lost}"


def test_saved_run_configs_keep_the_runtime_keys(hf_dir, tmp_path):
    """End to end, one tiny run per source: a run from the HF folder saves the user's runtime keys
    (not the importer's defaults), and FCSD from that run saves its own user's keys (not the source run's)."""
    from farskip_jax.fcsd.distill import distill
    from farskip_jax.train.trainer import train

    e2e = {"runtime.attention_impl": "blockwise", "runtime.attention_block": 8, "runtime.scan_layers": True,
           "runtime.remat": "dots", "runtime.gmm": "einsum", "runtime.capacity_factor": 2.0,
           "runtime.z_loss_weight": 0.002}
    short = ["train.steps=1", "train.warmup_steps=0", "train.batch_size=8", "train.seq_len=16", "train.eval_every=0",
             "train.eval_batches=1", "train.tensorboard=false", "train.peak_flops=1e9", "data.max_docs=40"]
    run = str(tmp_path / "from_hf")
    cfg = load_config("configs/tiny.yaml", [f"init_from_hf={hf_dir}", f"train.run_dir={run}"] + short + _ov(e2e))
    assert train(cfg).status == "done"
    saved = yaml.safe_load(open(os.path.join(run, "config.yaml")))
    assert saved["model"]["d_model"] == 32
    assert {k: saved[k.split(".")[0]][k.split(".")[1]] for k in e2e} == e2e

    out = str(tmp_path / "fcsd")
    cfg = load_config("configs/distill_tiny.yaml", [f"distill.init_from_run={run}", f"train.run_dir={out}",
                                                   "distill.eval_every=1", "distill.patience=1"] + short)
    distill(cfg)
    saved = yaml.safe_load(open(os.path.join(out, "config.yaml")))
    assert saved["model"]["d_model"] == 32
    default = to_dict(load_config("configs/distill_tiny.yaml"))
    assert {k: saved[k.split(".")[0]][k.split(".")[1]] for k in e2e} == {k: default[k.split(".")[0]][k.split(".")[1]]
                                                                         for k in e2e}


def test_an_old_layout_config_and_run_folder_load_at_the_new_places(tmp_path, capsys, monkeypatch):
    """A YAML file, a run folder's config.yaml and an override in the layout before the runtime section
    (runtime keys under model: / moe:) load to the same Config as the new layout, with one note; the
    same key set at both places to different values is one ConfigError naming the new key."""
    import farskip_jax.config as config
    import farskip_jax.config_yaml as config_yaml
    from farskip_jax.loading.load import read_run_config

    monkeypatch.setattr(config_yaml, "_NOTED", set())  # this process may have printed the note already
    want = runtime_values()
    new = load_config("configs/tiny.yaml", _ov(want))
    old_tree = to_dict(new)
    for old, moved in MOVED_KEYS.items():  # back to the old layout
        sec, key = old.split(".")
        old_tree[sec][key] = old_tree["runtime"].pop(key)
    assert not old_tree.pop("runtime")
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old_tree))
    assert load_config(str(tmp_path / "old.yaml")) == new
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(old_tree))
    assert read_run_config(str(run)) == new
    assert load_config("configs/tiny.yaml", [f"{old}={'null' if want[n] is None else want[n]}"
                                             for old, n in MOVED_KEYS.items()]) == new
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "model.scan_layers -> runtime.scan_layers" in err
    (tmp_path / "both.yaml").write_text("model: {scan_layers: true}\nruntime: {scan_layers: false}\n")
    with pytest.raises(ConfigError, match="keep only runtime.scan_layers"):
        load_config(str(tmp_path / "both.yaml"))
    with pytest.raises(ConfigError, match="model.remat' is runtime.remat now"):
        config.from_dict(config.ModelConfig, {"remat": "full"}, "model")
