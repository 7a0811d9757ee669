"""farskip_jax/studies/device_check.py in its --smoke mode (tiny shapes on the CPU): every part runs the code
path the GPU run uses, the JSON has the documented schema, the table names every part, the fitted
cost-model constants come out under the cost model's names, and the CLI refuses a full run without a
GPU. The real measurements need one CUDA/ROCm GPU (docs/device_check.md)."""

import json

import pytest


@pytest.fixture(scope="module")
def dc():
    from farskip_jax.studies import device_check

    return device_check


@pytest.fixture(scope="module")
def result(dc):
    return dc.run(dc.PARTS, smoke=True, variants=["farskip"])


def test_smoke_schema(dc, result):
    assert result["schema_version"] == dc.SCHEMA_VERSION and result["mode"] == "smoke"
    assert not result["errors"], result["errors"]
    env = result["environment"]
    assert env["backend"] == "cpu" and env["peak_flops"] > 0 and env["hbm_bw"] > 0
    a = result["parts"]["a"]["farskip"]
    for k in ("step_ms", "tokens_per_s", "mfu", "compile_s", "flops_per_token", "speedup_vs_standard"):
        assert a[k] > 0, k
    b = result["parts"]["b"]
    assert {r["impl"] for r in b} == {"ragged_dot", "tiled", "dense_reference"}
    assert all(r["fwd_us"] > 0 and r["fwdbwd_us"] > 0 for r in b)
    c = result["parts"]["c"]
    ops = {o["op"]: o for o in c["ops"]}
    assert set(ops) == {"dense_gemm", "grouped_gemm", "attention_naive", "attention_fused", "rmsnorm", "kernel_launch",
                        "all_to_all"}
    assert ops["all_to_all"]["measured_us"] is None and ops["all_to_all"]["predicted_us"] > 0
    assert all(o["predicted_us"] > 0 for o in c["ops"])
    from farskip_jax.analysis.cost_model import Hardware

    fields = set(Hardware.__dataclass_fields__)
    for name in ("matmul_eff", "mem_eff", "attn_eff", "launch_us"):
        assert name in fields and c["fitted_constants"][name] >= 0
    d = result["parts"]["d"]
    assert {r["impl"] for r in d} >= {"naive", "blockwise", "sdpa_xla"}
    for r in d:
        assert "error" not in r, r
        assert r["max_abs_diff_vs_naive"] < 0.1  # every implementation computes the same causal attention
    json.dumps(result)  # serialisable as written


def test_table_names_every_part(dc, result):
    text = dc.format_report(result)
    for head in ("(a) train step", "(b) grouped GEMM", "(c) op classes", "(d) attention", "fitted constants"):
        assert head in text
    assert "not measurable on one GPU" in text


def test_cli_refuses_full_mode_without_gpu_and_bad_parts(dc, capsys):
    assert dc.main(["--parts", "a"]) == 2
    assert "no GPU here" in capsys.readouterr().err
    assert dc.main(["--smoke", "--parts", "x"]) == 2
