"""The package's import graph, read from the source (every import, those inside functions too).

- no cycles between modules, and none between packages (farskip_jax/<package>/ or a top-level module);
- the layer order of docs/design.md section 3: a package imports only its own layer and those below
  (LAYERS), and within the train / eval / convert / fcsd / serving layer only what WITHIN allows;
- every import inside a function says why on its line (`# deferred: <reason>`);
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


def _targets(node, importer: str = "") -> set:
    """Modules of the package an import statement loads: `from pkg import sub` loads pkg.sub (and pkg's
    __init__ only when a name is not a submodule); a relative import is resolved against `importer`."""
    out = set()
    if isinstance(node, ast.Import):
        out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
        module = node.module
        if node.level:
            is_pkg = MODULES.get(importer, "").endswith("__init__.py")
            base = importer.split(".")[: len(importer.split(".")) - node.level + is_pkg]
            module = ".".join(base + ([node.module] if node.module else []))
        if module:
            for a in node.names:
                sub = f"{module}.{a.name}"
                out.add(sub if sub in MODULES else module)
    return {m for m in out if m in MODULES}


def graph() -> dict:
    g = {}
    for name, path in MODULES.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        g[name] = {t for n in ast.walk(tree) for t in _targets(n, name)} - {name}
    return g


def package_of(module: str) -> str:
    """farskip_jax.<package>.x -> <package>; a top-level module is its own package; the root is "farskip_jax"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(g: dict) -> dict:
    """{package: packages it imports} from a module graph."""
    out = {package_of(m): set() for m in g}
    for m, ts in g.items():
        out[package_of(m)] |= {package_of(t) for t in ts} - {package_of(m)}
    return out


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


def test_no_package_cycles():
    assert cycles(package_graph(graph())) == []


def test_package_graph_joins_modules_into_packages():
    g = {"farskip_jax.a.x": {"farskip_jax.b.y"}, "farskip_jax.b.y": {"farskip_jax.c"},
         "farskip_jax.c": {"farskip_jax.a.z"}, "farskip_jax.a.z": set()}
    assert cycles(package_graph(g)) == [["a", "b", "c"]]


# docs/design.md section 3, bottom to top: a package imports only from its own layer and the layers below.
LAYERS = (("farskip_jax", "errors", "quiet_start", "config", "config_yaml", "connectivity"), ("kernels",), ("model", "losses"), ("parallel",),
          ("loading", "data", "folders"), ("train", "eval", "convert", "fcsd", "serving"), ("analysis",),
          ("experiments", "studies"))
# within the train / eval / convert / fcsd / serving layer: what each may import of the other four
WITHIN = {"train": (), "convert": (), "serving": (), "eval": ("serving",), "fcsd": ("train", "eval", "convert")}
RANK = {p: i for i, layer in enumerate(LAYERS) for p in layer}


def forbidden_edges(g: dict) -> list:
    """(importer, imported, first module edge) of every package edge the layer order forbids."""
    why = {}
    for m, ts in sorted(g.items()):
        for t in sorted(ts):
            why.setdefault((package_of(m), package_of(t)), f"{m} -> {t}")
    bad = []
    for (a, b), edge in sorted(why.items()):
        if a == b:
            continue
        if RANK[b] > RANK[a] or (a in WITHIN and b in WITHIN and b not in WITHIN[a]):
            bad.append((a, b, edge))
    return bad


def test_every_package_has_a_layer():
    assert sorted(set(package_graph(graph())) - set(RANK)) == [], "add the package to LAYERS (and docs/design.md)"


def test_layer_order():
    assert forbidden_edges(graph()) == []


def test_layer_order_finds_an_upward_and_a_sideways_edge():
    g = {"farskip_jax.model.a": {"farskip_jax.loading.b"}, "farskip_jax.loading.b": set(),
         "farskip_jax.train.c": {"farskip_jax.eval.d"}, "farskip_jax.eval.d": {"farskip_jax.loading.b"}}
    assert forbidden_edges(g) == [("model", "loading", "farskip_jax.model.a -> farskip_jax.loading.b"),
                                  ("train", "eval", "farskip_jax.train.c -> farskip_jax.eval.d")]


def deferred_imports(tree) -> list:
    """Import statements inside a function body (any depth)."""
    out = []

    def visit(node, inside):
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, (ast.Import, ast.ImportFrom)) and inside:
                out.append(ch)
            visit(ch, inside or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return out


def unexplained_deferred_imports(src: str) -> list:
    """Line numbers of deferred imports without a `# deferred: <reason>` on their line or the line above."""
    lines = src.splitlines()
    return [n.lineno for n in deferred_imports(ast.parse(src))
            if not any(re.search(r"#\s*deferred:\s*\S", lines[i]) for i in (n.lineno - 1, n.lineno - 2) if i >= 0)]


def test_every_deferred_import_says_why():
    bad = []
    for name, path in MODULES.items():
        with open(path) as f:
            bad += [f"{name}:{ln}" for ln in unexplained_deferred_imports(f.read())]
    assert bad == [], "move the import to the top, or say why it waits (# deferred: <reason>)"


def test_a_deferred_import_without_a_reason_is_found():
    src = ("import os\n\n\ndef f():\n    # deferred: optional dependency\n    import lm_eval\n    import yaml\n"
           "    return yaml, lm_eval, os\n")
    assert unexplained_deferred_imports(src) == [7]


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
