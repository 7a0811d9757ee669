"""The studies' harness (farskip_jax/studies/harness.py) on hand-made inputs, and the shape of the
two kinds: no sys.path insertions anywhere, no code under benchmarks/results/, tests import the
package rather than loading scripts by path, only studies/ imports studies/, and every command and
results path the README and docs name exists."""

import ast
import glob
import os
import re

import pytest

from farskip_jax.studies import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def test_the_dp_ep_study_compiles_each_point_once_through_the_harness_cache(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from farskip_jax.studies import compare_dp_ep

    made = []

    def fake_compile(cfg, program, rows, tokens, context):
        made.append((cfg.runtime.micro_batches, cfg.farskip.preset, cfg.model.num_layers, program, rows, tokens, context))
        return SimpleNamespace(compile_s=0.0, what=made[-1])

    monkeypatch.setattr(compare_dp_ep, "compile_dp_ep", fake_compile)
    base = compare_dp_ep.load_config(harness.model_config_path("dsv3_6l"))
    cache = harness.CompileCache(str(tmp_path))
    for _ in range(2):
        c = compare_dp_ep.compile_point(base, cache, "decode", 72, 32, 1, 28, "farskip_tbo", 3)
    assert made == [(2, "farskip", 3, "decode", 32, 1, 28)] and c.what == made[0]
    assert os.listdir(tmp_path) == ["decode_ep72_r32_t1_farskip_tbo_l3.pkl.gz"]


def test_compile_cache_keeps_each_key_once(tmp_path):
    cache = harness.CompileCache(str(tmp_path / "cache"))
    calls = []

    def compile_fn():
        calls.append(1)
        return {"schedule": [1, 2, 3]}

    key = "dsv3_6l|ep8|b1|train|standard|runtime.gmm=tiled"
    assert cache.get(key) is None
    assert cache.get_or_compile(key, compile_fn) == {"schedule": [1, 2, 3]}
    assert cache.get_or_compile(key, compile_fn) == {"schedule": [1, 2, 3]} and len(calls) == 1
    assert os.path.basename(cache.path(key)) == "dsv3_6l_ep8_b1_train_standard_runtime.gmm-tiled.pkl.gz"
    assert harness.CompileCache(str(tmp_path / "cache")).get(key) == {"schedule": [1, 2, 3]}  # from disk
    assert cache.get(key + "|other") is None


def test_result_store_reads_back_what_it_saved(tmp_path):
    path = str(tmp_path / "out" / "results.json")
    store = harness.ResultStore(path)
    assert store == {}
    store["b"], store["a"] = {"step_us": 2.5}, {"step_us": 1.0}
    store.save()
    assert harness.ResultStore(path) == {"a": {"step_us": 1.0}, "b": {"step_us": 2.5}}
    with open(path) as f:
        text = f.read()
    assert text.index('"a"') < text.index('"b"')  # keys sorted: a re-run's diff is the entries that changed


def test_grid_varies_the_last_axis_fastest():
    assert list(harness.grid(b=[1, 2], ep=[8, 16])) == [
        {"b": 1, "ep": 8}, {"b": 1, "ep": 16}, {"b": 2, "ep": 8}, {"b": 2, "ep": 16}]
    assert list(harness.grid(b=[1], ep=[])) == []


def test_markdown_rows():
    assert harness.md_header(["row", "ms"]) == ["| row | ms |", "|---|---|"]
    assert harness.md_row(["FoE", "n/a: why", "", ""]) == "| FoE | n/a: why | | |"
    assert harness.md_row([1, 2.5]) == "| 1 | 2.5 |"


def test_spread_range_holds_the_central_speedup_and_names_the_widest_constant():
    ref = {"contention:low": 10.0, "contention:high": 10.0, "a2a_bw:low": 10.0, "a2a_bw:high": 10.0}
    var = {"contention:low": 8.0, "contention:high": 9.5, "a2a_bw:low": 9.0, "a2a_bw:high": 9.1}
    r = harness.spread_range(ref, var, central=1.1)
    assert r["range"] == pytest.approx([10 / 9.5, 10 / 8.0])
    assert r["dominant"] == "contention"
    wide = harness.spread_range(ref, var, central=1.5)  # the central value widens the range
    assert wide["range"][1] == 1.5
    assert harness.spread_range({}, var, 1.0) == {} and harness.spread_range(ref, {}, 1.0) == {}


def test_tbo_verdicts():
    v = harness.tbo_verdicts(90.0, 100.0, 95.0, 0.3, "communication {pct} of the no-overlap step")
    assert v[0] == "FarSkip is faster: FarSkip 90.00 ms vs standard + TBO 100.00 ms (1.111x FarSkip over TBO)"
    assert v[1].startswith("does NOT add up: FarSkip + TBO 95.00 ms vs the better alone 90.00 ms")
    assert "(communication 30.0% of the no-overlap step; the goal applies here)" in v[1]
    v = harness.tbo_verdicts(110.0, 100.0, 99.0, 0.1, "all-reduces {pct} of the no-overlap time")
    assert v[0].startswith("TBO is faster") and v[1].startswith("adds up") and "only at >= 20%" in v[1]
    assert harness.tbo_verdicts(90.0, None, None, 0.3, "{pct}") == []


def test_figure_saves_and_closes(tmp_path):
    import matplotlib.pyplot as plt

    path = str(tmp_path / "f.png")
    before = len(plt.get_fignums())
    with harness.figure(path, 1, 2, figsize=(4, 2)) as (fig, axes):
        axes[0].plot([1, 2], [3, 4])
    assert os.path.getsize(path) > 0 and len(plt.get_fignums()) == before


def test_contention_is_checked():
    assert harness.contention_error(None) is None and harness.contention_error(1.0) is None
    assert "(0, 1]" in harness.contention_error(0.0) and "(0, 1]" in harness.contention_error(1.5)


def _python_files(*folders):
    for folder in folders:
        for d, _, files in os.walk(os.path.join(ROOT, folder)):
            yield from (os.path.join(d, f) for f in files if f.endswith(".py"))


def test_no_sys_path_insertions():
    bad = []
    for path in _python_files("farskip_jax", "benchmarks"):
        with open(path) as f:
            text = f.read()
        for n in ast.walk(ast.parse(text, path)):
            if (isinstance(n, ast.Attribute) and n.attr in ("insert", "append", "extend")
                    and isinstance(n.value, ast.Attribute) and n.value.attr == "path"):
                bad.append(f"{os.path.relpath(path, ROOT)}:{n.lineno}")
        if "sys.path.insert" in text:  # in code strings run by a child interpreter too
            bad.append(os.path.relpath(path, ROOT))
    assert bad == []


def test_no_code_under_results():
    results = os.path.join(ROOT, "benchmarks", "results")
    code = [os.path.relpath(os.path.join(d, f), ROOT) for d, _, files in os.walk(results) for f in files
            if f.endswith((".py", ".sh", ".ipynb"))]
    assert code == []


def test_tests_import_the_package_not_scripts():
    bad = []
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "*.py"))):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr == "spec_from_file_location":
                bad.append(f"{os.path.basename(path)}:{n.lineno}: spec_from_file_location")
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
                bad += [f"{os.path.basename(path)}:{n.lineno}: import {m}" for m in names
                        if m == "benchmarks" or m.startswith("benchmarks.")]
    assert bad == []


def test_only_studies_import_studies():
    bad = []
    for path in _python_files("farskip_jax"):
        rel = os.path.relpath(path, ROOT)
        if rel.startswith(os.path.join("farskip_jax", "studies")):
            continue
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for n in ast.walk(tree):
            mods = ([a.name for a in n.names] if isinstance(n, ast.Import)
                    else [n.module or ""] if isinstance(n, ast.ImportFrom) else [])
            bad += [f"{rel}:{n.lineno}: {m}" for m in mods if m.startswith("farskip_jax.studies")]
    assert bad == []


def _doc_text() -> str:
    return "\n".join(open(p).read() for p in DOCS)


def test_every_command_the_docs_give_names_an_existing_module():
    text = _doc_text()
    studies = set(re.findall(r"python3? -m farskip_jax\.studies\.([a-z_]+)\b", text))
    micro = set(re.findall(r"python3? -m benchmarks\.([a-z_]+)\b", text))
    scripts = set(re.findall(r"python3? (benchmarks/[\w/]+\.py)", text))
    assert {"compare_overlap", "compare_serving", "multinode_scaling"} <= studies and "vs_hf" in micro
    missing = [f"farskip_jax/studies/{s}.py" for s in sorted(studies)
               if not os.path.exists(os.path.join(ROOT, "farskip_jax", "studies", s + ".py"))]
    missing += [f"benchmarks/{m}.py" for m in sorted(micro) if not os.path.exists(os.path.join(ROOT, "benchmarks", m + ".py"))]
    assert missing == [] and sorted(scripts) == []  # scripts run as modules, never by path


# what a study writes when run on hardware this repository has no run of yet (docs/device_check.md)
NOT_RUN_YET = {"benchmarks/results/device_check/device_check.json"}


def test_every_results_path_the_docs_name_exists():
    text = _doc_text()
    # concrete paths only (not a pattern such as table_<model>.md or {a,b}.md)
    paths = {p.rstrip(".,:;") for p in re.findall(r"benchmarks/results/[\w./-]++(?![{<*|])", text)}
    assert len(paths) > 20
    assert sorted(p for p in paths - NOT_RUN_YET if not os.path.exists(os.path.join(ROOT, p))) == []
