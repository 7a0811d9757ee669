"""Mesh sizing, logical-axis rules and batch placement (no compilation of the model)."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

from farskip_jax.config import MeshConfig
from farskip_jax.errors import ConfigError
from farskip_jax.parallel import logical_to_spec, make_mesh, shard_batch, state_shardings
from farskip_jax.parallel.mesh import resolve_mesh_shape


def test_mesh_sizes_and_axis_types():
    mesh = make_mesh(MeshConfig(data=-1, fsdp=2, expert=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1}
    assert set(mesh.axis_types) == {AxisType.Auto}
    assert resolve_mesh_shape(MeshConfig(data=1, expert=-1), 8)["expert"] == 8


@pytest.mark.parametrize("mcfg,msg", [
    (MeshConfig(data=2, expert=2), "multiply to 4 but there are 8 devices"),
    (MeshConfig(data=-1, expert=3), "does not divide the 8 devices"),
])
def test_mesh_size_errors_name_the_fix(mcfg, msg):
    with pytest.raises(ConfigError, match=msg):
        make_mesh(mcfg)


def test_logical_rules():
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, expert=2, tensor=2))
    assert logical_to_spec(("expert", "embed", "mlp"), (8, 32, 64), mesh) == P("expert", "fsdp", None)
    assert logical_to_spec(("embed", "heads"), (32, 64), mesh) == P("fsdp", "tensor")
    assert logical_to_spec(("vocab", "embed"), (63, 32), mesh) == P(None, "fsdp")  # 63 % 2: replicated
    assert logical_to_spec(("embed", None), (32, 8), mesh) == P("fsdp", None)
    assert logical_to_spec(("embed", "embed"), (32, 32), mesh) == P("fsdp", None)  # an axis used once


def test_state_shardings_read_axes_metadata():
    mesh = make_mesh(MeshConfig(data=2, expert=4))

    class M(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(np.zeros((8, 4, 6), np.float32), axes=("expert", "embed", "mlp"))
            self.b = nnx.Param(np.zeros((3,), np.float32))  # no axes: replicated

    sh = state_shardings(nnx.state(M()), mesh)
    assert sh["w"].spec == P("expert", None, None) and sh["b"].spec == P()


def test_shard_batch_splits_rows_over_token_axes():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, expert=2))
    x = shard_batch({"t": np.arange(16 * 3).reshape(16, 3)}, mesh)["t"]
    assert x.sharding.spec == P(("data", "fsdp", "expert"), None)
    assert {s.data.shape for s in x.addressable_shards} == {(2, 3)}
    np.testing.assert_array_equal(np.asarray(x), np.arange(48).reshape(16, 3))


def test_auto_attention_is_the_partitionable_core_on_a_multi_device_cpu_mesh():
    """config_on: `auto` attention is the fused CPU kernel on one CPU device and the naive core on a
    mesh of several (a custom call would be gathered onto every device and run replicated); the
    experts keep their kernel (they run inside the expert-parallel shard_map)."""
    from farskip_jax.config import load_config
    from farskip_jax import kernels
    from farskip_jax.parallel.build import config_on

    if not kernels.available():
        pytest.skip("CPU kernels unavailable")
    cfg = load_config("configs/tiny.yaml", [])
    one = config_on(cfg, make_mesh(MeshConfig(data=1), devices=jax.devices()[:1]))
    many = config_on(cfg, make_mesh(MeshConfig(data=2, expert=2), devices=jax.devices()[:4]))
    assert (one.runtime.attention_impl, one.runtime.gmm) == ("fused_cpu", "blas")
    assert (many.runtime.attention_impl, many.runtime.gmm) == ("naive", "blas")
    pinned = config_on(load_config("configs/tiny.yaml", ["runtime.attention_impl=fused_cpu"]),
                       make_mesh(MeshConfig(data=2, expert=2), devices=jax.devices()[:4]))
    assert pinned.runtime.attention_impl == "fused_cpu"  # asked for by name: kept
