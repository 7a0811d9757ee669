"""Memory plan (analysis/memory.py): the compiled step's memory analysis agrees with the arguments
counted from the shardings, donation aliases the whole train state, the FCSD step carries the frozen
teacher, the temporaries fit (exact at the config's depth, extrapolated from two depths with a
validation compile) and the batch search / verdict / CLI behave. Tiny model on 2 host CPU devices
(the real plans compile deviceless GPU programs for minutes each; their results are committed under
benchmarks/results/memory/)."""

import jax
import pytest

from farskip_jax.analysis import memory as mp
from farskip_jax.config import load_config
from farskip_jax.errors import ConfigError

TINY = ["model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1", "model.mlp_hidden=64", "moe.expert_hidden=32",
        "model.vocab_size=128", "moe.num_experts=4", "mesh.expert=2", "mesh.data=1", "runtime.dispatch=all_to_all",
        "runtime.capacity_factor=1.25", "model.first_k_dense=1"]
SEQ = 16


def cpu_devices(c):
    return jax.devices()[: c.mesh.fsdp * c.mesh.expert * c.mesh.tensor]


@pytest.fixture(scope="module")
def cache():
    return {}


@pytest.fixture(scope="module")
def rows(cache):
    cfg = load_config("configs/tiny.yaml", TINY + ["model.num_layers=2"])
    return mp.build_rows(cfg, ["pretrain", "fcsd"], ["full"], [1], [2], [1, 2], seq=SEQ, cache=cache,
                         devices_for=cpu_devices)


def test_compiled_arguments_match_the_shardings_and_donation_aliases_the_state(rows, cache):
    assert len(cache) == 4  # 2 modes x 2 batches at the config's depth
    for v in cache.values():
        p = mp.Point(**v)
        assert p.argument == p.analytic_argument, p.key()
        # GPU: peak = arguments + outputs + temporaries - aliased (one arena); XLA:CPU reports a tighter heap peak
        assert 0 < p.peak <= p.argument + p.output + p.temp - p.alias
        assert p.output - p.alias < 0.05 * p.argument  # the new state reuses the donated buffers
    pre, fcsd = rows
    assert pre.mode == "pretrain" and fcsd.mode == "fcsd"
    assert "teacher" in fcsd.parts and "teacher" not in pre.parts
    assert fcsd.parts["teacher"] < fcsd.parts["params"]  # bf16 teacher of fp32 master weights
    assert pre.parts["optimizer"] > pre.parts["params"] > 0  # AdamW: two fp32 moments per parameter
    for r in rows:  # the update phase is counted, not fitted: gradients + the new params and moments
        assert r.update_temp() == 2 * r.parts["params"] + r.parts["optimizer"]
        for b in (1, 2):
            p = mp.Point(**cache[mp.point_key(r.mode, "full", 1, 2, b, SEQ)])
            # XLA:GPU materialises the whole new state among the temporaries (docs/memory.md); XLA:CPU
            # updates more in place, so here the two-phase model is only an upper bound
            assert r.fit(2, b) >= 0.99 * p.temp


def test_depth_extrapolation_with_validation(cache):
    cfg = load_config("configs/tiny.yaml", TINY + ["model.num_layers=8"])
    (row,) = mp.build_rows(cfg, ["pretrain"], ["full"], [1], [1, 2], [1, 2], seq=SEQ, validate_depth=3, cache=cache,
                           devices_for=cpu_devices)
    v = row.validation
    assert v["layers"] == 3 and v["compiled_temp"] > 0 and v["phase"] in ("update", "activation"), v
    assert v["predicted_temp"] >= 0.99 * v["compiled_temp"]  # an upper bound on XLA:CPU (see above)
    assert row.layers == 8 and row.gpus == 2 and row.nodes == 1
    with pytest.raises(ConfigError, match="one depth must be the config's"):
        mp.build_rows(cfg, ["pretrain"], ["full"], [1], [2], [1, 2], seq=SEQ, cache=cache, devices_for=cpu_devices)


def test_batch_search_and_verdict(rows):
    r = rows[0]
    cap = r.peak(7) + 1
    assert r.max_batch(cap) == 7 and r.max_batch(r.peak(1) - 1) == 0
    assert r.max_batch(10 * cap) >= r.max_batch(cap)
    text = mp.format_plan("tiny", rows, 0.75)
    for d in mp.DEVICE_MEMORY:
        assert f"B " + d in text
    assert "pretrain on h100_sxm: 1 node(s) of 8 (2 GPUs, fsdp 1), remat full" in text
    assert "fcsd on mi300x" in text
    # the largest buffers live at the peak of the deepest, largest-batch compile, with shapes and scopes
    s = r.peak_point.peak_buffers
    assert r.peak_point.batch == 2 and s["n"] > 0 and s["largest"] and s["other_bytes"] > 0
    assert "largest buffers live at the peak: pretrain/full/fsdp1" in text and "temporaries/outputs" in text


def test_two_phase_model_on_known_points():
    # params(L) = 1 + L, optimizer = 2 params -> update U = 4 (1 + L); activations 10 + 2 L per sequence
    parts = {L: {"params": 1.0 + L, "optimizer": 2.0 * (1 + L)} for L in (3, 5)}
    temp = lambda L, B: max(4 * (1 + L), (1 + L) + B * (10 + 2 * L))  # noqa: E731
    p = lambda L, B: mp.Point("pretrain", "full", 1, L, B, 8, 0, 0, temp(L, B), 0, 0, 0, 0.0)  # noqa: E731
    m = mp.TempModel.fit([p(3, 1), p(3, 2), p(5, 1), p(5, 2)], parts)
    assert (m.s0, m.s1, m.active) == (pytest.approx(10), pytest.approx(2), 4)
    assert m(27, 1) == pytest.approx(temp(27, 1)) and m(27, 9) == pytest.approx(temp(27, 9))
    assert m.update(27) == pytest.approx(4 * 28)
    with pytest.raises(ConfigError, match="two per-device batches"):
        mp.TempModel.fit([p(3, 1), p(5, 1)], parts)
    cfg = load_config("configs/tiny.yaml")
    with pytest.raises(ConfigError, match="runtime.remat"):
        mp.mode_config(cfg, "pretrain", "some", 1)
    assert mp.main(["--config", "configs/tiny.yaml", "--mode", "train"]) == 2


def test_in_place_update_model_fits_an_intercept_and_refuses_mixed_caches():
    # the update lands in the donated state (GPU select guard): U = gradients = params; the activation
    # phase has a batch-independent part c0 (negative: not every gradient is live at the peak)
    parts = {L: {"params": 1.0 + L, "optimizer": 2.0 * (1 + L)} for L in (3, 5)}
    temp = lambda L, B: (1 + L) - 3.0 + B * (10 + 2 * L)  # noqa: E731
    p = lambda L, B, ip=True: mp.Point("pretrain", "full", 1, L, B, 8, 0, 0, temp(L, B), 0, 0, 0, 0.0,  # noqa: E731
                                       inplace_update=ip)
    m = mp.TempModel.fit([p(3, 1), p(3, 2), p(5, 1), p(5, 2)], parts)
    assert m.inplace and m.active == 4
    assert (m.c0, m.s0, m.s1) == (pytest.approx(-3), pytest.approx(10), pytest.approx(2))
    assert m.update(27) == pytest.approx(28) and m(27, 4) == pytest.approx(temp(27, 4))
    one = mp.TempModel.fit([p(5, 1), p(5, 2)], {5: parts[5]})  # one depth: exact in the batch
    assert one(5, 7) == pytest.approx(temp(5, 7)) and one.s1 == 0
    with pytest.raises(ConfigError, match="mix an in-place update"):
        mp.TempModel.fit([p(3, 1), p(3, 2, ip=None)], parts)


def test_default_depth_is_the_configs_own_when_layers_are_scanned():
    assert mp.default_depths(load_config("configs/deepseek_v2_lite.yaml")) == [27]
    assert mp.default_depths(load_config("configs/tiny.yaml", ["runtime.scan_layers=false", "model.num_layers=8"])) == [2, 3]
    assert mp.default_depths(load_config("configs/tiny.yaml", ["runtime.scan_layers=true", "model.num_layers=8"])) == [8]
