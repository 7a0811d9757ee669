"""Config system: YAML inheritance, dotted overrides, type checks, and the invalid combinations."""

import dataclasses

import pytest
import yaml

from farskip_jax.config import Config, FarSkipConfig, config_from_dict, dump_config, load_config, replace
from farskip_jax.connectivity.layer_sets import parse_layer_spec
from farskip_jax.errors import ConfigError


def _write(tmp_path, name, data):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return str(p)


def test_base_inheritance_and_overrides(tmp_path):
    _write(tmp_path, "base.yaml", {"model": {"num_layers": 6, "d_model": 64, "num_heads": 4}, "train": {"lr": 1e-3}})
    child = _write(tmp_path, "child.yaml", {"base": "base.yaml", "model": {"num_layers": 3}, "farskip": {"preset": "farskip"}})
    cfg = load_config(child, ["model.num_layers=4", "farskip.preset=attn_only", "farskip.layers=[0, 2]", "train.lr=3e-4"])
    assert cfg.model.num_layers == 4  # override beats child beats base
    assert cfg.model.d_model == 64  # inherited from base
    assert cfg.farskip.preset == "attn_only"
    assert cfg.farskip.layers == (0, 2)
    assert cfg.train.lr == pytest.approx(3e-4)
    assert dataclasses.is_dataclass(cfg) and isinstance(cfg, Config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.num_layers = 2


def test_resolved_config_round_trips():
    cfg = load_config(None, ["model.num_layers=2", "farskip.preset=farskip", "farskip.layers=last:1"])
    again = config_from_dict(yaml.safe_load(dump_config(cfg)))
    assert again == cfg


def test_unknown_key_suggests_nearest():
    with pytest.raises(ConfigError, match=r"unknown config key 'model.num_layer'.*'num_layers'"):
        load_config(None, ["model.num_layer=4"])
    with pytest.raises(ConfigError, match=r"unknown config key 'modle'.*'model'"):
        load_config(None, ["modle.num_layers=4"])


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"model.num_layers='four' must be an integer"):
        load_config(None, ["model.num_layers=four"])
    with pytest.raises(ConfigError, match=r"model.tie_embeddings.*true or false"):
        load_config(None, ["model.tie_embeddings=3"])


@pytest.mark.parametrize("overrides, message", [
    (["model.num_heads=6", "model.num_kv_heads=4"], r"num_kv_heads=4 must divide model.num_heads=6"),
    (["moe.num_experts=4", "moe.top_k=5"], r"top_k=5 must be between 1 and moe.num_experts=4"),
    (["moe.num_experts=6", "mesh.expert=4", "runtime.dispatch=all_to_all"], r"num_experts=6 is not divisible by the expert-parallel size mesh.expert=4"),
    (["farskip.preset=farskipp"], r"preset='farskipp' is unknown.*did you mean 'farskip'"),
    (["farskip.layers=middle:3"], r"farskip.layers='middle:3' is not a layer set"),
    (["farskip.layers=[0, 9]", "model.num_layers=4"], r"farskip.layers lists layers outside \[0, 4\): \[9\]"),
    (["runtime.dispatch=sideways"], r"runtime.dispatch='sideways' is not allowed"),
])
def test_invalid_combinations(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_layer_specs():
    assert parse_layer_spec("all", 4) == {0, 1, 2, 3}
    assert parse_layer_spec("none", 4) == set()
    assert parse_layer_spec("first:2", 4) == {0, 1}
    assert parse_layer_spec("last:1", 4) == {3}
    assert parse_layer_spec("range:1:3", 4) == {1, 2}
    fs = FarSkipConfig(preset="farskip", layers="last:2")
    assert [fs.layer_inputs(i, 4) for i in range(4)] == [("full", "full")] * 2 + [("partial", "outdated")] * 2
    fs = FarSkipConfig(preset="farskip", attn_input="outdated")
    assert fs.layer_inputs(0, 2) == ("outdated", "outdated")


def test_missing_file_and_base_cycle(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.yaml"))
    _write(tmp_path, "a.yaml", {"base": "b.yaml"})
    _write(tmp_path, "b.yaml", {"base": "a.yaml"})
    with pytest.raises(ConfigError, match="inheritance cycle"):
        load_config(str(tmp_path / "a.yaml"))


def test_replace_dotted():
    cfg = replace(Config(), **{"model.num_layers": 2, "farskip.preset": "mlp_only"})
    assert cfg.model.num_layers == 2 and cfg.farskip.preset == "mlp_only"
    with pytest.raises(ConfigError):
        replace(cfg, **{"moe.top_k": 100})


def test_yaml_on_off_strings():
    cfg = load_config(None, ["mesh.distributed=on"])
    assert cfg.mesh.distributed == "on"
    assert load_config(None, ["mesh.distributed=off"]).mesh.distributed == "off"


@pytest.mark.parametrize("key", ["distill.anneal=linear", "distill.progressive=true", "distill.local_weight=1",
                                 "train.inject_nan_at=[2]"])
def test_a_removed_key_says_it_was_removed_and_why(key):
    with pytest.raises(ConfigError, match=rf"config key '{key.split('=')[0]}' was removed: .*drop the key"):
        load_config(None, [key])


def test_the_auto_keys_moved_to_distill():
    with pytest.raises(ConfigError, match=r"'farskip.auto_budget' was removed: it is distill.auto_budget now"):
        load_config(None, ["farskip.auto_budget=0.01"])
