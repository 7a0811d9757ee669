"""Fingerprints of lowered programs: for refactors that must not change what is compiled.

    python -m benchmarks.program_fingerprint OUT.mlir [--config configs/tiny.yaml] [overrides ...]
    python -m benchmarks.program_fingerprint --suite OUT.json [--only NAME,...]
    python -m benchmarks.program_fingerprint --compare BASE.json NEW.json

One program (the first form): the train step as benchmarks/train_throughput.py builds it (a
Transformer by hand, the config's kernels installed, one batch of the embedded corpus), lowered for
this machine's CPU; writes the StableHLO without location info to OUT.mlir and prints its line count,
a hash and the custom calls it makes (docs/cpu_speed.md, "The kernel seam").

The suite (`--suite`): every kind of program the README and docs take figures from, each lowered
(not compiled) as HLO text, in three groups, each in a subprocess of its own:

    cpu1   one CPU device: the tiny train step (unrolled, scanned + remat, two-batch overlap, FoE)
           and the KV-cache prefill / decode steps (unrolled, scanned, stacked-but-unrolled, TBO, FoE)
    cpu8   eight CPU devices: the tp_ep layout's forward and decode steps (tensor-parallel and
           replicated shared experts, scanned), the FoE serving layout's decode step
    gpu    deviceless GPU programs (compile-only H200 devices): the overlap report's train / forward
           programs (DeepSeek-V2-Lite EP 8 as the README headline; DeepSeek-V3-6L over two nodes with
           TBO and FoE as compare_overlap, grouped-GEMM proxy) and the serving prefill / decode
           programs of analysis/inference_report (tp_ep, TBO, FoE; scanned and unrolled)

Per program three hashes: `structure` (the HLO with all metadata removed: what XLA compiles),
`scopes` (the HLO with each op's op_name kept: the named scopes the cost model reads) and the
program's line count. `--compare` prints, per program, equal / which hash differs; where `scopes`
differs it lists the op names whose counts changed, and where `structure` differs the opcode counts
that changed. The shapes are small where size does not change the code path (batch, sequence,
cache length); configs and connectivities are those of the figures.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUPS = ("cpu1", "cpu8", "gpu")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--suite":
        return suite(argv[1:])
    if argv and argv[0] == "--compare":
        return compare(*argv[1:3])
    if argv and argv[0] == "--group":
        return run_group(argv[1], argv[2], argv[3] if len(argv) > 3 else "")
    return single(argv)


def single(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from farskip_jax.config import load_config
    from farskip_jax.data.pipeline import make_iterator
    from farskip_jax.model.transformer import Transformer
    from farskip_jax.loading.optimizer import make_optimizer
    from farskip_jax.loading.train_state import init_state
    from farskip_jax.train.step import make_train_step

    cfg = load_config(a.config, a.overrides)
    try:
        from farskip_jax import kernels

        kernels.install(cfg.kernels)
    except ImportError:  # a checkout from before the kernel seam
        pass
    tx, schedule = make_optimizer(cfg.train)
    graphdef, state = init_state(Transformer(cfg, rngs=nnx.Rngs(0)), tx, 0)
    it = make_iterator(cfg.data, "train", batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=0)
    batch = {k: jnp.asarray(v) for k, v in next(it).items()}
    text = jax.jit(make_train_step(graphdef, cfg, tx, schedule)).lower(state, batch).as_text(debug_info=False)
    text = re.sub(r"#loc\d*", "", text)
    with open(a.out, "w") as f:
        f.write(text)
    calls = sorted(set(re.findall(r"custom_call @([\w.]+)\(", text)))
    print(f"{a.out}: {len(text.splitlines())} lines, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}, "
          f"custom calls {({c: text.count(f'@{c}(') for c in calls})}", flush=True)
    return 0


# --------------------------------------------------------------------------------------------------
# the suite
# --------------------------------------------------------------------------------------------------


def suite(argv) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--only", default="", help="comma-separated program names (default: all)")
    p.add_argument("--groups", default=",".join(GROUPS))
    a = p.parse_args(argv)
    result = {}
    for g in a.groups.split(","):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.environ.get("PYTHONPATH", ROOT))
        flags = env.get("XLA_FLAGS", "")
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
        if g == "cpu8":
            flags += " --xla_force_host_platform_device_count=8"
        env["XLA_FLAGS"] = flags.strip()
        tmp = f"{a.out}.{g}.part"
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--group", g, tmp, a.only], env=env)
        if r.returncode:
            print(f"error: group {g} failed (exit {r.returncode})", file=sys.stderr)
            return 2
        with open(tmp) as f:
            result.update(json.load(f))
        os.remove(tmp)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(f"{a.out}: {len(result)} programs")
    return 0


def hlo_parts(text: str) -> tuple[str, str]:
    """(structure, scoped) texts of an HLO module printed with debug info: structure without any
    metadata, scoped with each op's op_name only (stack frames and source locations dropped)."""
    head, sep, rest = text.partition("\nStackFrames\n")
    body = head.split("\nFileNames\n")[0] + "\n" + rest.split("\n\n", 1)[1] if sep else text
    scoped = re.sub(r" stack_frame_id=\d+", "", body)
    scoped = re.sub(r" source_(file|line|end_line|column|end_column)=(\"[^\"]*\"|\d+)", "", scoped)
    structure = re.sub(r", metadata=\{[^}]*\}", "", scoped)
    return structure, scoped


def record(lowered) -> dict:
    text = lowered.as_text(dialect="hlo", debug_info=True)
    structure, scoped = hlo_parts(text)
    names = collections.Counter(re.findall(r'op_name="([^"]*)"', scoped))
    ops = collections.Counter(re.findall(r"= \S+ ([a-z][\w-]*)\(", structure))
    h = lambda s: hashlib.sha256(s.encode()).hexdigest()[:16]  # noqa: E731
    return {"structure": h(structure), "scopes": h(scoped), "lines": len(structure.splitlines()),
            "op_names": dict(names), "opcodes": dict(ops)}


def run_group(group: str, out: str, only: str) -> int:
    import jax

    jax.config.update("jax_default_matmul_precision", "highest") if group != "gpu" else None
    wanted = set(only.split(",")) - {""}
    programs = {"cpu1": cpu1_programs, "cpu8": cpu8_programs, "gpu": gpu_programs}[group]()
    res = {}
    for name, build in programs:
        if wanted and name not in wanted:
            continue
        import time

        t0 = time.time()
        res[name] = record(build())
        print(f"  {name}: {res[name]['lines']} lines, structure {res[name]['structure']}, "
              f"scopes {res[name]['scopes']} ({time.time() - t0:.1f}s)", flush=True)
    with open(out, "w") as f:
        json.dump(res, f)
    return 0


def _cfg(path: str, over=()):
    from farskip_jax.config import load_config

    return load_config(os.path.join(ROOT, path), list(over))


def _generate_module():
    try:
        from farskip_jax.serving import generate
    except ImportError:
        from farskip_jax.eval import generate
    return generate


def _serving_module():
    try:
        from farskip_jax.serving import programs
    except ImportError:
        from farskip_jax.eval import serving as programs
    return programs


def _train(cfg):
    """The tiny train step (single()'s program) of cfg, lowered."""
    def build():
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from farskip_jax import kernels
        from farskip_jax.model.transformer import Transformer
        from farskip_jax.loading.optimizer import make_optimizer
        from farskip_jax.loading.train_state import init_state
        from farskip_jax.train.step import make_train_step

        kernels.install(cfg.kernels)
        tx, schedule = make_optimizer(cfg.train)
        graphdef, state = init_state(Transformer(cfg, rngs=nnx.Rngs(0)), tx, 0)
        from farskip_jax.data.pipeline import make_iterator

        it = make_iterator(cfg.data, "train", batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=0)
        batch = {k: jnp.asarray(v) for k, v in next(it).items()}
        return jax.jit(make_train_step(graphdef, cfg, tx, schedule)).lower(state, batch)
    return build


def _decode(cfg, t: int, scan=None, layout_of=None):
    """The KV-cache step of cfg (prefill t = prompt, decode t = 1) lowered: make_decode_fn on one
    device, or on the layout layout_of(cfg) -> (model, layout)."""
    def build():
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from farskip_jax import kernels
        from farskip_jax.model.transformer import Transformer

        gen = _generate_module()
        kernels.install(cfg.kernels)
        if layout_of is None:
            model, layout = Transformer(cfg, rngs=nnx.Rngs(0)), None
        else:
            model, layout = layout_of(cfg)
        graphdef, state = nnx.split(model)
        b, p = 4, 12
        cache = gen.init_cache(model, b, p + 4, layout)
        fn = gen.make_decode_fn(graphdef, cfg.farskip, layout, scan)
        put = (lambda x: x) if layout is None else (lambda x: jax.device_put(x, layout.batch_sharding(x.ndim)))
        tokens = put(jnp.ones((b, t), jnp.int32))
        return fn.lower(state, tokens, jnp.int32(0 if t > 1 else p), cache, put(jnp.zeros((b,), jnp.int32)))
    return build


TINY = "configs/tiny.yaml"
FOE_TINY = "configs/foe_tiny.yaml"


def cpu1_programs():
    c = _cfg
    return [
        ("train_tiny", _train(c(TINY))),
        ("train_tiny_scan_farskip_remat", _train(c(TINY, ["runtime.scan_layers=true", "farskip.preset=farskip",
                                                          "runtime.remat=full"]))),
        ("train_tiny_scan_minimal_d2", _train(c(TINY, ["runtime.scan_layers=true", "farskip.preset=farskip",
                                                       "farskip.skip_distance=2", "runtime.remat=minimal"]))),
        ("train_tiny_tbo_farskip", _train(c(TINY, ["runtime.micro_batches=2", "farskip.preset=farskip"]))),
        ("train_foe_tiny_farskip_remat", _train(c(FOE_TINY, ["farskip.preset=farskip", "runtime.remat=minimal"]))),
        ("train_foe_tiny_standard", _train(c(FOE_TINY))),
        ("prefill_tiny", _decode(c(TINY), 12)),
        ("decode_tiny_farskip", _decode(c(TINY, ["farskip.preset=farskip"]), 1)),
        ("prefill_tiny_scan_farskip", _decode(c(TINY, ["runtime.scan_layers=true", "farskip.preset=farskip"]), 12)),
        ("decode_tiny_scan_last2", _decode(c(TINY, ["runtime.scan_layers=true", "farskip.preset=farskip",
                                                    "farskip.layers=last:2"]), 1)),
        ("decode_tiny_scan_unrolled", _decode(c(TINY, ["runtime.scan_layers=true"]), 1, scan=False)),
        ("decode_tiny_tbo_farskip", _decode(c(TINY, ["runtime.micro_batches=2", "farskip.preset=farskip"]), 1)),
        ("prefill_foe_tiny_farskip", _decode(c(FOE_TINY, ["farskip.preset=farskip"]), 12)),
        ("decode_foe_tiny", _decode(c(FOE_TINY), 1)),
    ]


def _tp_ep(cfg):
    from flax import nnx

    from farskip_jax.model.transformer import Transformer
    from farskip_jax.parallel.mesh import make_mesh

    try:
        from farskip_jax.serving.tp_ep import inference_model, layout_for
    except ImportError:  # a checkout from before farskip_jax/serving/
        from farskip_jax.parallel.inference import inference_model, layout_for

    mesh = make_mesh(cfg.mesh)
    return inference_model(cfg, mesh, nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)))), layout_for(cfg, mesh)


def _foe_layout(cfg):
    from flax import nnx

    from farskip_jax.model.transformer import Transformer

    try:
        from farskip_jax.serving.foe import FoELayout, foe_inference_mesh, foe_inference_model
    except ImportError:
        from farskip_jax.parallel.foe_inference import FoELayout, foe_inference_mesh, foe_inference_model

    mesh = foe_inference_mesh(cfg)
    return foe_inference_model(cfg, mesh, nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)))), FoELayout(mesh)


def _tp_ep_forward(cfg):
    def build():
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from farskip_jax import kernels

        kernels.install(cfg.kernels)
        model, layout = _tp_ep(cfg)
        graphdef, state = nnx.split(model)
        tokens = jax.device_put(jnp.ones((4, 16), jnp.int32), layout.batch_sharding(2))
        return layout.forward_fn(graphdef).lower(state, tokens)
    return build


TP = ["inference.layout=tp_ep", "mesh.data=2", "mesh.tensor=4", "mesh.expert=1", "runtime.capacity_factor=null"]
FOE_SERVE = ["inference.layout=foe", "mesh.data=4", "mesh.expert=2", "runtime.dispatch=local"]


def cpu8_programs():
    c = _cfg
    return [
        ("tp_ep_forward_farskip", _tp_ep_forward(c(TINY, TP + ["farskip.preset=farskip"]))),
        ("tp_ep_forward_standard_replicated", _tp_ep_forward(c(TINY, TP + ["inference.shared_experts=replicated"]))),
        ("tp_ep_forward_tbo_farskip", _tp_ep_forward(c(TINY, TP + ["farskip.preset=farskip", "runtime.micro_batches=2"]))),
        ("tp_ep_prefill_farskip", _decode(c(TINY, TP + ["farskip.preset=farskip"]), 12, layout_of=_tp_ep)),
        ("tp_ep_decode_standard", _decode(c(TINY, TP), 1, layout_of=_tp_ep)),
        ("tp_ep_decode_scan_farskip", _decode(c(TINY, TP + ["farskip.preset=farskip", "runtime.scan_layers=true"]), 1,
                                              layout_of=_tp_ep)),
        ("tp_ep_decode_scan_replicated", _decode(c(TINY, TP + ["runtime.scan_layers=true",
                                                               "inference.shared_experts=replicated"]), 1,
                                                 layout_of=_tp_ep)),
        ("tp_ep_decode_tbo_farskip", _decode(c(TINY, TP + ["farskip.preset=farskip", "runtime.micro_batches=2"]), 1,
                                             layout_of=_tp_ep)),
        ("foe_serve_prefill_farskip", _decode(c(FOE_TINY, FOE_SERVE + ["farskip.preset=farskip"]), 12,
                                              layout_of=_foe_layout)),
        ("foe_serve_decode_standard", _decode(c(FOE_TINY, FOE_SERVE), 1, layout_of=_foe_layout)),
    ]


DSV2 = "configs/deepseek_v2_lite.yaml"
DSV3 = "configs/deepseek_v3_6l.yaml"
GQA = ["model.attention=gqa", "model.num_kv_heads=16", "model.head_dim=128", "moe.n_group=1", "moe.topk_group=1"]
HEADLINE = ["runtime.dispatch=all_to_all", "runtime.capacity_factor=1.0", "mesh.data=1", "mesh.expert=8",
            "runtime.gmm=auto", "runtime.attention_impl=auto"]


def _overlap(path, over, program: str, num_devices: int, gpn: int, batch: int, seq: int, proxy: bool):
    """analysis.programs' train / forward program of the config, lowered for compile-only H200s."""
    def build():
        import contextlib

        from farskip_jax.analysis.deviceless import gpu_devices
        from farskip_jax.analysis.programs import analysis_mesh, forward_program, grouped_gemm_proxy, train_program

        cfg = _cfg(path, over)
        mesh = analysis_mesh(cfg, gpu_devices("h200", num_devices, gpus_per_node=gpn))
        with grouped_gemm_proxy() if proxy else contextlib.nullcontext():
            fn, args = {"train": train_program, "forward": forward_program}[program](cfg, mesh, batch, seq)
            return fn.lower(*args)
    return build


def _serving(path, over, preset, program: str, gpus: int, scan=None, layers=None, micro_batches=1, foe=None):
    """analysis.inference_report's serving program (compile_serving without the compile)."""
    def build():
        from farskip_jax.analysis import inference_report as ir
        from farskip_jax.analysis.deviceless import gpu_devices

        cfg = ir.serving_config(_cfg(path, over), preset, gpus, 8, layers, scan, micro_batches=micro_batches,
                                foe_groups=foe)
        mesh = ir.serving_mesh(cfg, gpu_devices("h200", gpus, gpus_per_node=8))
        progs = _serving_module()
        with ir.balanced_grouped_gemm(ir.useful_fraction(cfg, mesh)):
            if program == "prefill":
                fn, args = progs.prefill_program(cfg, mesh, 16, 256, 256, last_logits=True)
            else:
                fn, args = progs.decode_program(cfg, mesh, 64, 512)
            return fn.lower(*args)
    return build


def gpu_programs():
    out = []
    for preset in ("standard", "farskip"):
        for prog in ("train", "forward"):
            out.append((f"overlap_dsv2lite_{prog}_{preset}",
                        _overlap(DSV2, HEADLINE + [f"farskip.preset={preset}"], prog, 8, 8, 8, 1024, False)))
    a2a = ["runtime.dispatch=all_to_all", "runtime.capacity_factor=1.0", "mesh.data=1", "mesh.expert=16"]
    for name, over in (("standard", []), ("standard_tbo", ["runtime.micro_batches=2"]),
                       ("farskip", []), ("farskip_tbo", ["runtime.micro_batches=2"]),
                       ("foe", ["runtime.num_groups=2"]), ("foe_farskip", ["runtime.num_groups=2"])):
        preset = "farskip" if "farskip" in name else "standard"
        over = a2a + over + [f"farskip.preset={preset}"]
        path_over = GQA + over if name.startswith("foe") else over
        out.append((f"overlap_dsv3_6l_train_g16_{name}", _overlap(DSV3, path_over, "train", 16, 8, 32, 512, True)))
    for gpus in (8, 16):
        for prog in ("prefill", "decode"):
            for name, preset, mb, foe in (("standard", "standard", 1, None), ("standard_tbo", "standard", 2, None),
                                          ("farskip", "farskip", 1, None), ("farskip_tbo", "farskip", 2, None),
                                          ("foe", "standard", 1, gpus), ("foe_farskip", "farskip", 1, gpus)):
                if foe and gpus == 16:
                    continue  # 16 groups do not split DeepSeek-V3-6L-GQA's 16 kv heads x top-8
                out.append((f"serving_dsv3gqa_g{gpus}_{prog}_{name}",
                            _serving(DSV3, GQA, preset, prog, gpus, scan=False, micro_batches=mb, foe=foe)))
    for prog in ("prefill", "decode"):
        for preset in ("standard", "farskip"):
            for scan in (True, False):
                out.append((f"serving_dsv2lite_g8_{prog}_{preset}_{'scan' if scan else 'loop'}",
                            _serving(DSV2, [], preset, prog, 8, scan=scan, layers=4)))
    return out


# --------------------------------------------------------------------------------------------------
# comparing two suites
# --------------------------------------------------------------------------------------------------


def compare(base_path: str, new_path: str) -> int:
    with open(base_path) as f:
        base = json.load(f)
    with open(new_path) as f:
        new = json.load(f)
    same = 0
    for name in sorted(set(base) | set(new)):
        if name not in base or name not in new:
            print(f"{name}: only in {'base' if name in base else 'new'}")
            continue
        a, b = base[name], new[name]
        if a["structure"] == b["structure"] and a["scopes"] == b["scopes"]:
            same += 1
            continue
        what = [k for k in ("structure", "scopes") if a[k] != b[k]]
        print(f"{name}: {' and '.join(what)} differ ({a['lines']} -> {b['lines']} lines)")
        if a["structure"] != b["structure"]:
            ops = {k: (a["opcodes"].get(k, 0), b["opcodes"].get(k, 0)) for k in set(a["opcodes"]) | set(b["opcodes"])}
            changed = {k: v for k, v in ops.items() if v[0] != v[1]}
            print(f"    opcode counts changed: {changed or 'none (order / operands only)'}")
        na, nb = collections.Counter(a["op_names"]), collections.Counter(b["op_names"])
        gone, added = na - nb, nb - na
        for label, c in (("-", gone), ("+", added)):
            for k, v in sorted(c.items())[:40]:
                print(f"    {label} {v} x {k}")
            if len(c) > 40:
                print(f"    {label} ... {len(c) - 40} more op names")
    print(f"{same} of {len(set(base) & set(new))} programs equal (structure and scopes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
