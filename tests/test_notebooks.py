"""Execute every notebook under notebooks/ with its tiny parameters and fail on any cell error.

The first code cell of each notebook reads FARSKIP_NB_TINY=1 (a few training steps, a 2-layer model,
fewer variants) and FARSKIP_NB_OUT (where runs go: a temporary folder here, so nothing under runs/ is
touched). The kernel is this interpreter (`sys.executable -m ipykernel_launcher`, through a temporary
kernelspec), so the test works in a fresh venv after `pip install -e ".[dev,hf]"`. Budget: <= 3 min on
a quiet 2-core machine for all notebooks together.
"""

from __future__ import annotations

import json
import os
import re
import sys
import pathlib

import ipykernel  # noqa: F401  (dev extra: nbclient, nbformat, ipykernel; a missing one fails loudly)
import nbclient
import nbformat
import pytest

NB_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("*.ipynb"))
KERNEL = "farskip-nbtest"


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A kernelspec running this interpreter, found through JUPYTER_PATH; the kernel's environment
    without conftest's 8 forced host devices (the notebooks train on one CPU device)."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "farskip test kernel", "language": "python"}))
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(root) + (os.pathsep + old if old else "")
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["FARSKIP_NB_TINY"] = "1"
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    yield env
    if old is None:
        os.environ.pop("JUPYTER_PATH", None)
    else:
        os.environ["JUPYTER_PATH"] = old


def test_notebooks_exist():
    names = {p.stem for p in NOTEBOOKS}
    assert {"ablation_partial_vs_outdated", "conversion_sweep", "overlap_schedule"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_tiny(path, kernel_env, tmp_path):
    nb = nbformat.read(str(path), as_version=4)
    env = dict(kernel_env, FARSKIP_NB_OUT=str(tmp_path / "runs"))
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=900,
                                     resources={"metadata": {"path": str(NB_DIR)}})
    # the kernel's own stderr goes to a file: cell output comes through the messaging protocol, and the
    # SIGINT jupyter_client sends every kernel at shutdown would otherwise print a KeyboardInterrupt
    # ("Exception ignored in: _xla_gc_callback") into the test run's output
    with open(tmp_path / "kernel_stderr.log", "w") as kernel_stderr:
        client.execute(env=env, stderr=kernel_stderr)  # raises CellExecutionError on the first failing cell
    codes = [c for c in nb.cells if c.cell_type == "code"]
    assert codes and all(c.get("execution_count") for c in codes), "not every code cell ran"
    errors = [o for c in codes for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    # every notebook shows at least one figure
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in codes for o in c.get("outputs", [])), f"{path.name}: no figure displayed"
    # the tiny flag reached the kernel (the first code cell defines TINY from the environment)
    assert "FARSKIP_NB_TINY" in codes[0].source


# ---- the notebooks' helpers (farskip_jax.experiments), fast checks ------------------------------------


def test_variants_map_to_the_intended_connectivity():
    from farskip_jax.config import load_config
    from farskip_jax.errors import ConfigError
    from farskip_jax.experiments.ablation import variants_by_name

    base = load_config(str(NB_DIR.parent / "configs" / "tiny.yaml"))
    L = base.model.num_layers
    want = {"standard": ("full", "full", 1), "farskip": ("partial", "outdated", 1),
            "all_outdated": ("outdated", "outdated", 1), "attn_only": ("partial", "full", 1),
            "mlp_only": ("full", "outdated", 1), "skip2": ("partial", "outdated", 2),
            "foe_farskip": ("partial", "outdated", 1)}
    for v in variants_by_name(list(want)):
        fs = v.apply(base).farskip
        a, m, d = want[v.name]
        assert [fs.layer_inputs(i, L) for i in range(L)] == [(a, m)] * L, v.name
        assert fs.skip_distance == d
    assert variants_by_name(["foe_farskip"])[0].apply(base).runtime.num_groups == 2
    with pytest.raises(ConfigError, match="farskp"):
        variants_by_name(["farskp"])


def test_summarize_and_table():
    import numpy as np

    from farskip_jax.experiments.ablation import RunRecord, summarize
    from farskip_jax.experiments.plots import ablation_table

    def rec(v, seed, loss):
        return RunRecord(v, seed, "", [10, 20], [loss + 1, loss], loss, loss, 1.0, "done", 1.0)

    rows = summarize([rec("farskip", 0, 2.2), rec("standard", 0, 2.0), rec("farskip", 1, 2.4), rec("standard", 1, 2.1)])
    assert [r["variant"] for r in rows] == ["farskip", "standard"]
    f, s = rows
    assert f["seeds"] == 2 and f["mean"] == pytest.approx(2.3) and f["std"] == pytest.approx(np.std([2.2, 2.4]))
    assert (f["min"], f["max"]) == (2.2, 2.4)
    assert f["vs_ref"] == pytest.approx(2.3 / 2.05 - 1) and s["vs_ref"] == pytest.approx(0.0)
    ov = {"farskip": dict(exposed_frac=0.25, hidden_frac=0.75, bound_frac=1.0, step_time_us=1500.0)}
    md = ablation_table(rows, ov).splitlines()
    assert len(md) == 4 and "25.0%" in md[2] and "+12.20%" in md[2] and "1.500 ms" in md[2]
    assert md[3].endswith("| – | – | – |")  # no overlap entry for standard


def test_variants_with_one_seed_start_from_the_same_weights():
    """The ablation's pairs: the parameters do not depend on the connectivity, so one seed gives every
    variant the same initial weights (and train.seed the same data order: data/pipeline.py)."""
    import jax
    import numpy as np
    from flax import nnx

    from farskip_jax.config import load_config
    from farskip_jax.experiments.ablation import variants_by_name
    from farskip_jax.parallel.build import create_model

    base = load_config(str(NB_DIR.parent / "configs" / "tiny.yaml"),
                       ["model.d_model=32", "model.num_layers=2", "moe.expert_hidden=32", "train.seed=3"])
    weights = [jax.tree.leaves(nnx.state(create_model(v.apply(base), None, seed=3), nnx.Param))
               for v in variants_by_name(["standard", "farskip", "attn_only", "mlp_only", "all_outdated"])]
    assert all(len(w) == len(weights[0]) and all(np.array_equal(a, b) for a, b in zip(weights[0], w)) for w in weights)
