"""Train-step tokens/s of our model vs HF transformers' PyTorch Qwen3-MoE, same config and weights.

    python -m benchmarks.vs_hf [--layers 4] [--batch 8] [--seq 256] [--repeats 5] [--hf-impl eager,grouped_mm]
                               [--attention-impl auto,naive,causal_blocks] [--attention-block 128]

A random Qwen3-MoE (HF config class, fp32) is saved with save_pretrained and imported through
`farskip_jax.convert.import_hf`, so both sides hold the same weights. Checked first: fp32 logits
agreement on the benchmark batch. Then one train step each (forward, cross entropy + load-balance
loss, backward, global-norm clip 1.0, AdamW) is timed alternately on the same CPU and batch
(ours: the project's jitted `make_train_step`; HF: model forward with router logits, backward,
torch AdamW), median of `repeats`. --dtype bfloat16: both sides compute in bf16 with float32 weights
(ours runtime.compute_dtype: bfloat16, which runs the AMX kernels on CPUs that have them; HF under
torch.autocast). Prints tokens/s and the ratio ours / HF for each HF experts
implementation asked for (`eager` is transformers' per-expert loop, `grouped_mm` its grouped GEMM).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from farskip_jax import kernels  # noqa: E402
from farskip_jax.kernels.host_memory import keep_freed_memory  # noqa: E402

from farskip_jax.config import replace  # noqa: E402
from farskip_jax.convert import import_hf  # noqa: E402
from farskip_jax.train.flops import measure_matmul_peak, train_flops_per_token  # noqa: E402
from farskip_jax.loading.optimizer import make_optimizer  # noqa: E402
from farskip_jax.loading.train_state import init_state  # noqa: E402
from farskip_jax.train.step import make_train_step  # noqa: E402


def hf_config(args) -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, num_hidden_layers=args.layers, num_attention_heads=8,
        num_key_value_heads=4, head_dim=args.d_model // 8, intermediate_size=4 * args.d_model,
        moe_intermediate_size=args.expert_hidden, num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=4096, initializer_range=0.02,
        output_router_logits=True, router_aux_loss_coef=0.001)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hf-impl", default="eager,grouped_mm", help="transformers experts implementations to time")
    ap.add_argument("--attention-impl", default="auto",
                    help="comma list of our runtime.attention_impl values to time side by side "
                         "(auto = the model default: fused_cpu on CPU; naive, blockwise, causal_blocks, fused_cpu)")
    ap.add_argument("--attention-block", type=int, default=128,
                    help="runtime.attention_block for the blockwise / causal_blocks cores (they fall back to "
                         "naive when the sequence is not longer than one block)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="compute dtype of both sides: ours runtime.compute_dtype (float32 master weights), HF "
                         "under torch.autocast(cpu, bfloat16) (float32 weights too)")
    ap.add_argument("--qwen3-30b-proportions", action="store_true",
                    help="Qwen3-30B-A3B's expert proportions at d_model 256: 128 experts, top-8, expert hidden 96")
    ap.add_argument("--malloc", choices=["resident", "default"], default="resident",
                    help="resident (as train.py on CPU): glibc keeps freed memory for both sides "
                         "(farskip_jax/kernels/host_memory.py); default: every step page-faults its big buffers afresh")
    args = ap.parse_args(argv)
    if args.malloc == "resident" and not keep_freed_memory("resident"):
        raise SystemExit("--malloc resident: glibc mallopt refused (not glibc?)")
    from farskip_jax.config import kernels_from_env

    kernels.install(kernels_from_env())  # the CPU kernels of a default kernels section (as train.py's runs)
    if args.qwen3_30b_proportions:
        args.experts, args.top_k, args.expert_hidden = 128, 8, 96
    torch.manual_seed(0)
    print(f"jax {jax.__version__} / torch {torch.__version__} (threads {torch.get_num_threads()}) / "
          f"transformers {transformers.__version__}, {os.cpu_count()} CPUs", flush=True)

    hcfg = hf_config(args)
    hf_models = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = transformers.AutoModelForCausalLM.from_config(hcfg).float()
        base.save_pretrained(tmp)
        for impl in args.hf_impl.split(","):
            hf_models[impl] = transformers.AutoModelForCausalLM.from_pretrained(
                tmp, dtype=torch.float32, experts_implementation=impl).train()
        impls = args.attention_impl.split(",")
        # one import per attention core: the core is model config, held by the modules themselves
        ours_models = {impl: import_hf(tmp, overrides={"runtime.aux_loss_weight": hcfg.router_aux_loss_coef,
                                                       "runtime.compute_dtype": args.dtype,
                                                       "runtime.attention_impl": impl,
                                                       "runtime.attention_block": args.attention_block})
                       for impl in impls}
    cfg, model = ours_models[impls[0]]
    cfg = replace(cfg, **{"train.lr": 1e-4, "train.warmup_steps": 1, "train.weight_decay": 0.1,
                          "train.grad_clip": 1.0, "train.batch_size": args.batch, "train.seq_len": args.seq})
    print(f"model: {args.layers} layers, d_model {args.d_model}, {args.experts} experts top-{args.top_k}, expert "
          f"hidden {args.expert_hidden}, vocab {args.vocab}; batch {args.batch} x seq {args.seq}; {args.dtype}; "
          f"our gmm backend: {cfg.runtime.gmm} (resolves per platform)", flush=True)

    rng = np.random.default_rng(0)
    seq = rng.integers(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    tokens, targets = seq[:, :-1], seq[:, 1:]
    b, s = tokens.shape
    batch = dict(tokens=jnp.asarray(tokens), targets=jnp.asarray(targets),
                 positions=jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
                 segment_ids=jnp.ones((b, s), jnp.int32), loss_mask=jnp.ones((b, s), jnp.float32))

    # logits agreement (before any step changes the weights; fp32: ~1e-6, bf16: bf16 rounding)
    autocast = dict(device_type="cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    ours_logits = np.asarray(jax.jit(lambda m, t: m(t).logits)(model, batch["tokens"]))
    for impl, hf in hf_models.items():
        with torch.no_grad(), torch.autocast(**autocast):
            ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
        diff = np.abs(ours_logits - ref).max()
        print(f"logits agreement vs HF[{impl}]: max |diff| = {diff:.2e} (max |logit| {np.abs(ref).max():.2f})",
              flush=True)

    tx, schedule = make_optimizer(cfg.train)
    ours_steps = {}
    for impl in impls:  # one state each (the step donates it)
        vcfg = replace(cfg, **{"runtime.attention_impl": impl})
        graphdef, state = init_state(ours_models[impl][1], tx, 0)
        state = jax.tree.map(jnp.copy, state)  # own buffers: the step donates them
        step = jax.jit(make_train_step(graphdef, vcfg, tx, schedule), donate_argnums=0)

        def ours(step=step, box=[state]):
            box[0], metrics = step(box[0], batch)
            return float(metrics["loss"])

        ours_steps["ours" if len(impls) == 1 else f"ours[{impl}]"] = ours
    del model, ours_models

    t_tokens = torch.tensor(tokens, dtype=torch.long)
    t_targets = torch.tensor(targets, dtype=torch.long)
    hf_steps = {}
    for impl, hf in hf_models.items():
        opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(cfg.train.b1, cfg.train.b2), weight_decay=0.1)

        def hf_step(hf=hf, opt=opt):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(**autocast):
                out = hf(input_ids=t_tokens, output_router_logits=True)
            logits = out.logits.float()
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), t_targets.reshape(-1))
            loss = ce + hcfg.router_aux_loss_coef * out.aux_loss.float()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
            opt.step()
            return float(loss.detach())

        hf_steps[f"hf[{impl}]"] = hf_step
    variants = {**ours_steps, **hf_steps}
    for name, fn in variants.items():  # compile / warm up (twice: the first output state may retrace)
        t0 = time.perf_counter()
        loss = fn()
        fn()
        print(f"  warm-up {name:16s} {time.perf_counter() - t0:6.1f}s  loss {loss:.4f}", flush=True)
    times = {v: [] for v in variants}
    for r in range(args.repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        print(f"  repeat {r + 1}/{args.repeats}: " + " ".join(f"{v}={times[v][-1] * 1e3:.0f}ms" for v in variants),
              flush=True)
    tok = b * s
    ours_tps = {name: tok / statistics.median(times[name]) for name in ours_steps}
    for name, tps in ours_tps.items():
        print(f"{name:22s} {tps:9.0f} tokens/s")
    best = max(ours_tps, key=ours_tps.get)
    tps_of = {}
    for name in hf_steps:
        tps_of[name] = tps = tok / statistics.median(times[name])
        print(f"{name:22s} {tps:9.0f} tokens/s   " + "  ".join(
            f"{o}/HF = {t / tps:.2f}x" for o, t in ours_tps.items()))
    roofline(cfg, s, ours_tps[best], tps_of, args.dtype)
    return 0


def torch_matmul_peak(n: int = 1024, seconds: float = 1.0, dtype=torch.float32) -> float:
    """Best observed FLOPs/s of an [n, n] @ [n, n] torch matmul in `dtype` (the CPU's practical peak
    for torch: oneDNN, AMX for bf16 where the CPU has it)."""
    a, w = torch.randn(n, n).to(dtype), (torch.randn(n, n) / n ** 0.5).to(dtype)
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        a = a @ w
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
    return best


def roofline(cfg, seq_len: int, ours_tps: float, hf_tps: dict, dtype: str = "float32") -> None:
    """What tokens/s the step's useful FLOPs allow at this CPU's measured matmul peak in `dtype`, and
    the largest ours/HF ratio that leaves possible (a ratio target above it cannot be met)."""
    fpt = train_flops_per_token(cfg, seq_len)
    jdt, tdt = (jnp.float32, torch.float32) if dtype == "float32" else (jnp.bfloat16, torch.bfloat16)
    peak = max(measure_matmul_peak(jdt), torch_matmul_peak(dtype=tdt))
    ceiling = peak / fpt
    print(f"roofline: {fpt / 1e6:.1f} MFLOP per trained token (6 x active matmul params + attention); "
          f"{dtype} matmul peak of this CPU {peak / 1e9:.0f} GFLOP/s (best of XLA and torch) -> at most "
          f"{ceiling:.0f} tokens/s")
    print(f"  ours at {ours_tps / ceiling:.0%} of that ceiling" + "".join(
        f"; {n} at {t / ceiling:.0%} (ours/{n} can be at most {ceiling / t:.2f}x)" for n, t in hf_tps.items()))


if __name__ == "__main__":
    sys.exit(main())
