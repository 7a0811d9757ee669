"""farskip_jax/studies/compare_serving.py: the serving comparison's rows are the programs they claim (TBO: two
micro-batches and twice the all-reduces; FoE: the foe layout, no all-to-all, its cross-group sums
priced as attention / routed all-reduces), one cost model, speedups split exactly. A 2-layer tiny GQA
MoE compiled deviceless for 8 GPUs (prefill; skipped without the compile-only CUDA plugin); the
n/a reasons and verdicts on hand-made inputs."""

import os

import pytest

from deviceless_mark import gpu
from farskip_jax.studies import compare_serving
from farskip_jax.studies.harness import REPO


def _module():
    return compare_serving


def _tiny(*extra):
    from farskip_jax.config import load_config

    return load_config(None, ["model.num_layers=2", "model.first_k_dense=0", "model.d_model=128",
                              "model.num_heads=8", "model.num_kv_heads=8", "model.vocab_size=256",
                              "model.max_seq_len=256", "moe.num_experts=16", "moe.top_k=8", "moe.expert_hidden=64",
                              "moe.num_shared_experts=1", *extra])


def test_not_applicable_reasons():
    m = _module()
    cfg = _tiny()
    assert m.not_applicable("foe", cfg, 8, "prefill", 16) is None and m.foe_groups_for(cfg, 8) == (8, None)
    why = m.not_applicable("foe_farskip", cfg, 16, "prefill", 16)
    assert why.startswith("n/a: H = 16 groups") and "8 heads" in why and "top-8" in why
    assert "TBO splits the 3 requests" in m.not_applicable("standard_tbo", cfg, 8, "decode", 3)
    assert m.not_applicable("farskip_tbo", cfg, 8, "decode", 4) is None
    assert "MLA" in m.foe_groups_for(_tiny("model.attention=mla", "model.kv_lora_rank=64"), 8)[1]


def test_verdicts_name_the_winner_and_whether_they_add_up():
    m = _module()

    def row(name, ms):
        return {"row": name, "label": m.LABELS[name], "time_ms": ms}

    rows = [row("standard", 100.0), row("standard_tbo", 95.0), row("farskip", 90.0), row("farskip_tbo", 88.0),
            row("foe", 97.0), row("foe_farskip", 86.0)]
    lines = m.verdicts(rows, 0.3)
    assert lines[0].startswith("FarSkip is faster") and "1.056x" in lines[0]
    assert lines[1].startswith("adds up") and "applies here" in lines[1]
    assert lines[2].startswith("fastest row: FoE + FarSkip 86.00 ms")
    rows[3]["time_ms"] = 92.0
    assert m.verdicts(rows, 0.1)[1].startswith("does NOT add up") and "only at >= 20%" in m.verdicts(rows, 0.1)[1]


@gpu
def test_rows_are_the_programs_they_claim(tmp_path):
    m = _module()
    cfg = _tiny()
    log = lambda s: None  # noqa: E731
    compiled = {v: m.compile_point(cfg, "tiny", 8, "prefill", 4, 128, 128, v, str(tmp_path), log)
                for v in ("standard", "standard_tbo", "farskip", "foe", "foe_farskip")}
    timed = {v: m.time_point(c, "prefill", "h200", None) for v, c in compiled.items()}
    rows = m.rows_of(timed, {"farskip_tbo": "n/a: w"})
    by = {r["row"]: r for r in rows}
    assert [r["row"] for r in rows] == list(m.ROWS) and by["farskip_tbo"]["na"] == "n/a: w"
    # what each row was compiled as
    assert by["standard_tbo"]["micro_batches"] == 2 and by["standard"]["micro_batches"] == 1
    assert {by[v]["layout"] for v in ("standard", "standard_tbo", "farskip")} == {"tp_ep"}
    assert by["foe"]["layout"] == by["foe_farskip"]["layout"] == "foe" and by["foe"]["num_groups"] == 8
    assert by["foe_farskip"]["preset"] == "farskip" and by["foe"]["preset"] == "standard"
    # TBO: every layer all-reduce twice (one per micro-batch)
    role = lambda v, r: timed[v]["by_role"][r]["count"]  # noqa: E731
    for r in ("attention", "routed"):
        assert role("standard_tbo", r) == 2 * role("standard", r) > 0
    # FoE: no all-to-all; standard one cross-group sum per layer (+ the last routed one, synchronous or
    # not), FarSkip an attention and a routed sum per layer; shared experts summed beside them
    for v in ("foe", "foe_farskip"):
        assert not [p for p in compiled[v]["schedule"].pairs if p.collective == "all-to-all"]
        assert role(v, "attention") == 2 and role(v, "shared") == 2
    # (the last layer's attention and routed sums are read only by the final norm: XLA's all-reduce
    # reassociation adds them first and sums once)
    assert role("foe_farskip", "routed") == 1 and role("foe", "routed") <= 1
    # FoE attention is priced as the tp_ep one (flash kernel scopes present in the cached attention)
    assert timed["foe"]["compute_by_scope"].get("attention_core", 0) > 0
    # one cost model, exact split, no-overlap = standard re-timed with synchronous all-reduces
    assert len({(t["nodes"], t["time_us"] > 0) for t in timed.values()}) == 1
    assert by["no_overlap"]["time_ms"] >= by["standard"]["time_ms"]
    assert by["no_overlap"]["compute_ms"] == pytest.approx(by["standard"]["compute_ms"], rel=1e-9)
    for r in rows:
        if "time_ms" in r:
            assert r["speedup"] == pytest.approx(r["hiding"] * r["compute"], rel=1e-9)
            assert r["speedup"] == pytest.approx(by["standard"]["time_ms"] / r["time_ms"], rel=1e-9)


def test_serving_programs_compile_a_servers_kernels():
    """A training config's memory choices (runtime.gmm=tiled, blockwise attention) do not reach the serving
    analysis: it prices the grouped GEMM (balanced proxy) and the platform's attention core."""
    from farskip_jax.analysis.inference_report import serving_config
    from farskip_jax.config import load_config

    base = load_config(os.path.join(REPO, "configs", "deepseek_v2_lite.yaml"),
                       ["runtime.gmm=tiled", "runtime.attention_impl=blockwise"])  # what the shipped config picks
    for kw in ({}, {"micro_batches": 2}):
        cfg = serving_config(base, "farskip", 8, **kw)
        assert cfg.runtime.gmm == "auto" and cfg.runtime.attention_impl == "auto" and cfg.inference.layout == "tp_ep"
    foe = serving_config(_tiny(), "standard", 8, foe_groups=8)
    assert foe.inference.layout == "foe" and foe.runtime.gmm == "auto" and foe.runtime.dispatch == "local"


def test_speedup_ranges_over_the_constants_spread_by_hand():
    """add_ranges: a row's range holds its central speedup and every re-timing's, and names the
    constant whose two ends move it most (hand-made timings)."""
    m = _module()
    rows = [{"row": "standard", "speedup": 1.0}, {"row": "no_overlap", "speedup": 0.9},
            {"row": "farskip", "speedup": 1.25}, {"row": "standard_tbo", "na": "n/a: x"}]
    spread = {"standard": {"contention:low": {"time_us": 100.0, "serial_us": 110.0},
                           "contention:high": {"time_us": 90.0, "serial_us": 110.0},
                           "matmul_eff:low": {"time_us": 120.0, "serial_us": 130.0}},
              "farskip": {"contention:low": {"time_us": 80.0}, "contention:high": {"time_us": 60.0},
                          "matmul_eff:low": {"time_us": 100.0}}}
    m.add_ranges(rows, {}, spread)
    fs, no = rows[2], rows[1]
    assert fs["range"] == [pytest.approx(1.2), pytest.approx(1.5)] and fs["dominant"] == "contention"
    assert no["range"] == [pytest.approx(90 / 110), pytest.approx(120 / 130)]
    assert "range" not in rows[3]
