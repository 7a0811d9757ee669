"""The package's import graph, read from the source (every import, those inside functions too).

- no cycles between modules;
- train/ does not import eval/ or fcsd/ (FCSD builds on training, not the reverse), eval/ does not
  import fcsd/, losses/ and model/ import nothing of train/, eval/, fcsd/, analysis/;
- no library string names a path under benchmarks/ or docs/ (nothing reads them at run time).
"""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "farskip_jax")


def _modules() -> dict:
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


MODULES = _modules()


def _targets(node) -> set:
    """Modules of the package an import statement loads: `from pkg import sub` loads pkg.sub (and pkg's
    __init__ only when a name is not a submodule)."""
    out = set()
    if isinstance(node, ast.Import):
        out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        for a in node.names:
            sub = f"{node.module}.{a.name}"
            out.add(sub if sub in MODULES else node.module)
    return {m for m in out if m in MODULES}


def graph() -> dict:
    g = {}
    for name, path in MODULES.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        g[name] = {t for n in ast.walk(tree) for t in _targets(n)} - {name}
    return g


def cycles(g: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


FORBIDDEN = {
    "farskip_jax.train": ("farskip_jax.eval", "farskip_jax.fcsd", "farskip_jax.experiments"),
    "farskip_jax.eval": ("farskip_jax.fcsd", "farskip_jax.experiments"),
    "farskip_jax.losses": ("farskip_jax.train", "farskip_jax.eval", "farskip_jax.fcsd", "farskip_jax.analysis",
                           "farskip_jax.experiments"),
    "farskip_jax.model": ("farskip_jax.train", "farskip_jax.eval", "farskip_jax.fcsd", "farskip_jax.analysis",
                          "farskip_jax.experiments", "farskip_jax.convert"),
}


def test_layer_boundaries():
    bad = [(m, t) for m, ts in graph().items() for layer, banned in FORBIDDEN.items()
           if m == layer or m.startswith(layer + ".") for t in ts if t.startswith(banned)]
    assert bad == []


def test_no_library_string_names_a_benchmarks_or_docs_path():
    bad = []
    for name, path in MODULES.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for n in ast.walk(tree):
            if (isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
                    and re.match(r"^(\./)?(benchmarks|docs)/", n.value)):
                bad.append(f"{name}:{n.lineno}: {n.value!r}")
    assert bad == []


def test_no_module_imports_another_modules_private_names():
    bad = []
    for name, path in MODULES.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").startswith("farskip_jax"):
                bad += [f"{name}: from {n.module} import {a.name}" for a in n.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == []
