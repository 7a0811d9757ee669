"""Typed, frozen experiment configuration.

A config is a tree of frozen dataclasses (`Config` with sections model, moe, runtime, farskip, mesh,
train, data, distill, eval, inference, kernels). `model` and `moe` are the architecture: what a
checkpoint fixes (shapes, vocabulary, norms, routing kind). `runtime` is how this run computes it
(dtypes, scan, micro-batches, remat, attention and grouped-matmul kernels, dispatch, capacity, FoE
layouts, MoE loss weights): loading weights (`init_from_hf`, `distill.init_from_run`) replaces the
architecture sections whole and never touches runtime (`Config.with_architecture`; docs/config.md
gives every key its side). Keys that lived in model/moe before the split load at their new place
(`MOVED_KEYS`, one printed note).

It is read from YAML files that may inherit from another file with `base: other.yaml` (path relative
to the file), then patched by dotted command-line overrides (`model.num_layers=4 runtime.remat=full`).
An unknown key fails with the nearest valid names, a wrong type names the key and the expected type,
and impossible combinations fail with one `ConfigError`.

    cfg = load_config("configs/tiny.yaml", ["train.steps=50"])
    print(dump_config(cfg))
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import yaml

from farskip_jax.errors import ConfigError
from farskip_jax.layer_sets import (PRESETS, check_converted_layers, layer_spec_forms,  # noqa: F401 (re-exported)
                                    parse_layer_spec)

DType = Literal["float32", "bfloat16", "float16"]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _at_least(obj, section: str, bounds: dict, null_ok: tuple = (), why: dict = {}) -> None:
    """ConfigError `section.key must be >= lo, got v` for the first key of {key: lo} below its bound
    (keys in null_ok may also be None; why: {key: text} appended to the message)."""
    for key, lo in bounds.items():
        v = getattr(obj, key)
        if v is None and key in null_ok:
            continue
        _check(v >= lo, f"{section}.{key} must be >= {lo}{' or null' if key in null_ok else ''}{why.get(key, '')}, "
                        f"got {v}")


@dataclass(frozen=True)
class RopeScalingConfig:
    """RoPE frequency scaling. `type`: none | linear | llama3 | yarn (see model/rope.py)."""

    type: Literal["none", "linear", "llama3", "yarn"] = "none"
    factor: float = 1.0
    original_max_position: int = 4096
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 1.0  # yarn (DeepSeek)
    mscale_all_dim: float = 0.0  # yarn (DeepSeek)
    attention_factor: Optional[float] = None  # yarn: overrides the computed attention scale
    truncate: bool = True  # yarn: round the correction range to whole dims (HF default)


@dataclass(frozen=True)
class ModelConfig:
    """Transformer architecture (what a checkpoint fixes). Layer i is an MoE layer when
    i >= first_k_dense and (i + 1) % moe_every == 0, unless `moe_layers` lists the MoE layers."""

    vocab_size: int = 512
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: Optional[int] = None  # default d_model // num_heads
    mlp_hidden: int = 512  # hidden size of dense SwiGLU layers
    first_k_dense: int = 0
    moe_every: int = 1
    moe_layers: Optional[tuple[int, ...]] = None
    attention: Literal["gqa", "mla"] = "gqa"
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    max_seq_len: int = 2048  # positions the checkpoint serves (HF max_position_embeddings)
    tie_embeddings: bool = False
    init_std: float = 0.02
    # --- pieces of imported families (convert/); the defaults keep the plain GQA model ---
    qk_norm_scope: Literal["head", "all_heads"] = "head"  # q/k RMSNorm per head or over all heads (OLMoE)
    qk_l2_norm: bool = False  # weightless L2 (RMS) norm of q/k after rope, rope layers only (Llama-4)
    rope_interleaved: bool = False  # rotate adjacent pairs (DeepSeek, Llama-4) instead of halves
    nope_layers: tuple[int, ...] = ()  # layers without rope (Llama-4 NoPE layers)
    attention_chunk_size: Optional[int] = None  # chunked local attention (Llama-4)
    chunked_layers: Optional[tuple[int, ...]] = None  # layers using it (None = every layer)
    attn_temperature_tuning: bool = False  # NoPE layers scale q by log1p(floor((pos+1)/floor))*scale+1
    attn_temperature_floor: float = 8192.0
    attn_temperature_scale: float = 0.1
    gated_attention: bool = False  # attention output *= sigmoid(gate_proj(x)) before o_proj (Instella)
    q_lora_rank: Optional[int] = None  # MLA: low-rank query (None = full q projection)
    kv_lora_rank: int = 512  # MLA: compressed kv latent size
    qk_nope_head_dim: int = 128  # MLA: per-head q/k dims without rope ...
    qk_rope_head_dim: int = 64  # ... and with rope (one rope key shared by all heads)
    v_head_dim: int = 128  # MLA: per-head value dim

    def __post_init__(self):
        _at_least(self, "model", dict(vocab_size=1, d_model=1, mlp_hidden=1, max_seq_len=1))
        _at_least(self, "model", dict(head_dim=1), null_ok=("head_dim",), why=dict(head_dim=" (d_model / num_heads)"))
        _check(self.init_std >= 0 and self.norm_eps > 0 and self.rope_theta > 0,
               f"model.init_std must be >= 0, model.norm_eps and model.rope_theta > 0 (got {self.init_std}, "
               f"{self.norm_eps}, {self.rope_theta})")
        _at_least(self, "model", dict(num_layers=1))
        _check(self.num_heads >= 1 and self.num_kv_heads >= 1, "model.num_heads and model.num_kv_heads must be >= 1")
        _check(self.num_heads % self.num_kv_heads == 0,
               f"model.num_kv_heads={self.num_kv_heads} must divide model.num_heads={self.num_heads} "
               f"(grouped-query attention shares each kv head among num_heads/num_kv_heads query heads)")
        _check(self.head_dim is not None or self.d_model % self.num_heads == 0,
               f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}; "
               "set model.head_dim explicitly")
        _check(0 <= self.first_k_dense <= self.num_layers, "model.first_k_dense must be in [0, num_layers]")
        _check(self.moe_every >= 1, "model.moe_every must be >= 1")
        bad = [i for i in self.moe_layers or () if not 0 <= i < self.num_layers]
        _check(not bad, f"model.moe_layers has layer indices outside [0, {self.num_layers}): {bad}")
        bad = [i for i in self.nope_layers + (self.chunked_layers or ()) if not 0 <= i < self.num_layers]
        _check(not bad, f"model.nope_layers/chunked_layers have layer indices outside [0, {self.num_layers}): {bad}")
        _check(self.attention_chunk_size is None or self.attention_chunk_size >= 1, "model.attention_chunk_size must be >= 1")
        if self.attention == "mla":
            _check(self.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even")
            _check(self.kv_lora_rank >= 1 and (self.q_lora_rank is None or self.q_lora_rank >= 1),
                   "model.kv_lora_rank and model.q_lora_rank must be >= 1")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    def is_moe_layer(self, i: int) -> bool:
        if self.moe_layers is not None:
            return i in self.moe_layers
        return i >= self.first_k_dense and (i + 1) % self.moe_every == 0


@dataclass(frozen=True)
class MoEConfig:
    """Routed + shared experts and their router (architecture). `num_experts: 0` makes every layer dense."""

    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 256
    num_shared_experts: int = 1
    shared_hidden: Optional[int] = None  # default expert_hidden * num_shared_experts
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1  # group-limited routing: experts split in n_group groups ...
    topk_group: int = 1  # ... and tokens pick experts only from the best topk_group groups
    group_score: Literal["max", "top2_sum"] = "max"  # how a group is scored (V2: max, V3: top2_sum)
    selection_bias: bool = False  # aux-loss-free balancing: bias added for selection only
    shared_gate: bool = False  # shared-expert output *= sigmoid(x @ w_gate [d, 1]) (Qwen2-MoE)
    route_on_input: bool = False  # the routing weight scales the expert INPUT (Llama-4; needs top_k 1)

    def __post_init__(self):
        _check(self.num_experts >= 0, "moe.num_experts must be >= 0")
        _at_least(self, "moe", dict(num_shared_experts=0))
        if self.num_experts:
            _at_least(self, "moe", dict(expert_hidden=1, shared_hidden=1), null_ok=("shared_hidden",),
                      why=dict(shared_hidden=" (expert_hidden x num_shared_experts)"))
            _check(1 <= self.top_k <= self.num_experts,
                   f"moe.top_k={self.top_k} must be between 1 and moe.num_experts={self.num_experts}")
            _check(self.num_experts % self.n_group == 0, f"moe.n_group={self.n_group} must divide moe.num_experts={self.num_experts}")
            _check(1 <= self.topk_group <= self.n_group, f"moe.topk_group={self.topk_group} must be in [1, moe.n_group={self.n_group}]")
            _check(self.n_group == 1 or self.top_k <= self.topk_group * (self.num_experts // self.n_group),
                   "moe.top_k exceeds the experts available in the selected groups (topk_group * num_experts / n_group)")
        _check(not self.route_on_input or self.top_k == 1,
               f"moe.route_on_input scales each expert's input by its weight and needs moe.top_k=1, got {self.top_k}")

    @property
    def resolved_shared_hidden(self) -> int:
        return self.shared_hidden if self.shared_hidden is not None else self.expert_hidden * self.num_shared_experts


@dataclass(frozen=True)
class RuntimeConfig:
    """How this run computes the architecture; no checkpoint fixes any of it, so loading weights keeps
    every key as the user set it (docs/config.md: each key's side and why)."""

    param_dtype: DType = "float32"
    compute_dtype: DType = "float32"
    remat: Literal["none", "full", "dots", "minimal"] = "none"
    # one jax.lax.scan per stack of identical layers (parameters stacked on a leading "layers" axis;
    # model/stacking.py); checkpoints and HF folders convert at load (docs/scan.md)
    scan_layers: bool = False
    # two-batch overlap when 2: each layer runs the batch as this many interleaved micro-batches whose
    # sub-blocks do not depend on each other (model/layer_loop.py); the same values (dropless MoE)
    micro_batches: int = 1
    # attention core (kernels/attention.py): naive = one [t, s] score matrix; blockwise = flash-style online
    # softmax over `attention_block`-token blocks, blocks above the causal diagonal skipped; causal_blocks =
    # each query block against its key prefix; fused_cpu = the C++ CPU kernel; auto = fused_cpu on CPU when
    # the kernel builds here, naive elsewhere
    attention_impl: Literal["auto", "naive", "blockwise", "causal_blocks", "fused_cpu"] = "auto"
    attention_block: int = 512
    num_groups: int = 1  # Federation of Experts groups (1 = ordinary MoE); the weights are the same for any H
    dispatch: Literal["local", "all_to_all", "hierarchical", "ragged"] = "local"
    # hierarchical dispatch: GPUs per node (a device's node = device.id // gpus_per_node); null = process_index
    gpus_per_node: Optional[int] = None
    gmm: Literal["auto", "blas", "ragged_dot", "tiled", "einsum"] = "auto"
    gmm_tile: int = 256
    capacity_factor: Optional[float] = None  # None = dropless
    # FoE under expert parallelism: tokens between the groups' sub-blocks replicated over the device
    # groups (the paper's layout) or sharded over them (dense parts once; parallel/foe.py, docs/foe.md)
    foe_tokens: Literal["replicated", "sharded"] = "replicated"
    # FoE, token-sharded only: where every group reads the same attention input run it as the ordinary
    # all-head attention on each device's own tokens instead of head groups on gathered copies
    foe_attention: Literal["groups", "local"] = "groups"
    # payload of the FoE cross-group sums / gathers: auto = the compute dtype; float8_e4m3fn = per-token
    # scaled fp8 (lossy; token-sharded only; parallel/foe.py)
    foe_sum_dtype: Literal["auto", "float32", "bfloat16", "float8_e4m3fn"] = "auto"
    aux_loss_weight: float = 0.01  # load-balance loss weight
    z_loss_weight: float = 0.0  # router z-loss weight
    bias_update_rate: float = 1e-3  # moe.selection_bias: the bias step per update

    def __post_init__(self):
        _at_least(self, "runtime", dict(aux_loss_weight=0, z_loss_weight=0, bias_update_rate=0))
        _at_least(self, "runtime", dict(attention_block=1, micro_batches=1), why=dict(micro_batches=" (2 = two-batch overlap)"))
        _check(self.capacity_factor is None or self.capacity_factor > 0, "runtime.capacity_factor must be > 0 or null (dropless)")
        _check(self.gmm_tile >= 1, "runtime.gmm_tile must be >= 1")
        _check(self.gpus_per_node is None or self.gpus_per_node >= 1, "runtime.gpus_per_node must be >= 1 or null")
        _check(self.gpus_per_node is None or self.dispatch == "hierarchical",
               f"runtime.gpus_per_node is read by runtime.dispatch=hierarchical only (got dispatch={self.dispatch!r})")
        _check(self.num_groups >= 1, "runtime.num_groups must be >= 1")
        _check(self.foe_attention == "groups" or self.foe_tokens == "sharded",
               "runtime.foe_attention=local needs runtime.foe_tokens=sharded (with replicated tokens every device "
               "group would run the whole attention on all tokens)")
        _check(self.foe_sum_dtype != "float8_e4m3fn" or self.foe_tokens == "sharded",
               "runtime.foe_sum_dtype=float8_e4m3fn needs runtime.foe_tokens=sharded (the fp8 sum is an all-to-all "
               "of scaled shards plus a local sum, i.e. a reduce-scatter)")


@dataclass(frozen=True)
class FarSkipConfig:
    """Which stream each sub-block reads (docs/design.md section 1); the run's choice, whose default an
    exported folder's "farskip_jax" section gives (convert/connectivity.py).

    preset: standard | farskip | attn_only | mlp_only; `attn_input` / `moe_input` override the
    preset's choice on converted layers. `layers` selects the converted layers (layer_sets.py):
    "all", "none", "first:N", "last:N", "range:A:B" or a list of layer indices; `auto` (FCSD only) is
    chosen at the start of the distillation within `distill.auto_budget` (fcsd/planner.py).
    `skip_distance: d` makes partial/outdated attention inputs lack the MoE outputs of the last d
    layers (d = 1 is the paper's FarSkip)."""

    preset: str = "standard"
    attn_input: Optional[Literal["full", "partial", "outdated"]] = None
    moe_input: Optional[Literal["full", "outdated"]] = None
    layers: Union[str, tuple[int, ...]] = "all"
    skip_distance: int = 1

    def __post_init__(self):
        _check(self.preset in PRESETS, f"farskip.preset={self.preset!r} is unknown; choose one of {sorted(PRESETS)}"
               + _suggest(self.preset, list(PRESETS)))
        _at_least(self, "farskip", dict(skip_distance=1))
        auto = self.layers == "auto"
        if isinstance(self.layers, str) and not auto:
            parse_layer_spec(self.layers, None)  # syntax check; range checked against num_layers by Config
        _check(not auto or self.preset != "standard",
               "farskip.layers: auto chooses which layers to convert, but farskip.preset is standard (nothing to "
               "convert); set farskip.preset: farskip (or attn_only / mlp_only)")

    def converted_layers(self, num_layers: int) -> frozenset[int]:
        return parse_layer_spec(self.layers, num_layers) if isinstance(self.layers, str) else frozenset(self.layers)

    def layer_inputs(self, i: int, num_layers: int) -> tuple[str, str]:
        """(attn_input, moe_input) of layer i."""
        if i not in self.converted_layers(num_layers):
            return ("full", "full")
        attn, moe = PRESETS[self.preset]
        return (self.attn_input or attn, self.moe_input or moe)


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes; their product must equal the device count (one of them may be -1 to take
    the rest). `xla_preset` selects the XLA flags set before JAX starts (parallel/xla_flags.py)."""

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    xla_preset: Literal["none", "cpu", "cuda_hopper", "rocm_mi300"] = "none"
    distributed: Literal["auto", "on", "off"] = "auto"
    coordinator_address: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None

    def __post_init__(self):
        sizes = {"data": self.data, "fsdp": self.fsdp, "expert": self.expert, "tensor": self.tensor}
        _check(all(v == -1 or v >= 1 for v in sizes.values()), f"mesh sizes must be >= 1 or -1, got {sizes}")
        _check(sum(v == -1 for v in sizes.values()) <= 1, f"at most one mesh axis may be -1, got {sizes}")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, schedule, logging and checkpoint cadence."""

    mode: Literal["pretrain", "distill"] = "pretrain"
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    grad_accum: int = 1
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    run_dir: str = "runs/default"
    overwrite: bool = False
    checkpoint_every: int = 0  # 0 = only at the end
    keep_checkpoints: int = 3  # >= 1: the newest checkpoints kept (the final one always among them)
    resume_step: Optional[int] = None  # resume from this checkpoint step instead of the newest (newer ones are dropped)
    max_nonfinite: int = 5
    peak_flops: Optional[float] = None  # per device, for MFU
    tensorboard: bool = True
    time_limit_s: Optional[float] = None  # stop (with a checkpoint) after this many seconds of training
    # cross entropy from the final stream `loss_chunk` sequence positions at a time (losses/chunked.py):
    # the f32 logits of [batch, loss_chunk] tokens live at once instead of [batch, seq_len]; 0 / null = full logits
    loss_chunk: Optional[int] = None

    def __post_init__(self):
        _at_least(self, "train", dict(steps=1, batch_size=1, seq_len=1, grad_accum=1, log_every=1, eval_batches=1))
        _check(self.lr > 0, "train.lr must be > 0")
        _check(_is_int(self.keep_checkpoints) and self.keep_checkpoints >= 1,
               f"train.keep_checkpoints={self.keep_checkpoints!r}: keep at least 1 checkpoint (the run's final one); "
               "set it to 1 or more")
        _check(_is_int(self.checkpoint_every) and self.checkpoint_every >= 0,
               f"train.checkpoint_every={self.checkpoint_every!r}: give the steps between checkpoints (an int >= 1), "
               "or 0 to save only at the end")
        _check(self.resume_step is None or (_is_int(self.resume_step) and self.resume_step >= 0),
               f"train.resume_step={self.resume_step!r}: give a checkpoint step of the run (an int >= 0), or null for "
               "the newest")
        _at_least(self, "train", dict(warmup_steps=0))
        _check(0.0 <= self.min_lr_ratio <= 1.0, f"train.min_lr_ratio must be in [0, 1] (final lr / train.lr), "
                                                f"got {self.min_lr_ratio}")
        _check(0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0,
               f"train.b1 and train.b2 (AdamW moment decays) must be in [0, 1), got {self.b1}, {self.b2}")
        _at_least(self, "train", dict(weight_decay=0, grad_clip=0, eval_every=0),
                  why={k: " (0 turns it off)" for k in ("weight_decay", "grad_clip", "eval_every")})
        _check(0 <= self.seed < 2**32, f"train.seed must be in [0, 2**32) (it seeds the weights and the data order), "
                                       f"got {self.seed}")
        _check(self.peak_flops is None or self.peak_flops > 0,
               f"train.peak_flops must be > 0 (FLOP/s per device) or null (measured on CPU), got {self.peak_flops}")
        _check(self.time_limit_s is None or self.time_limit_s > 0,
               f"train.time_limit_s must be > 0 seconds or null (no limit), got {self.time_limit_s}")
        _check(self.batch_size % self.grad_accum == 0, "train.grad_accum must divide train.batch_size")
        _check(self.loss_chunk is None or (_is_int(self.loss_chunk) and self.loss_chunk >= 0),
               f"train.loss_chunk={self.loss_chunk!r}: give sequence positions per loss chunk (an int >= 1, e.g. 512), "
               "or 0 / null for the full logits")


@dataclass(frozen=True)
class DataConfig:
    """Training text. source: stdlib (the interpreter's own .py files, no download) | text | jsonl |
    arrayrecord; tokenizer: byte or a path to an HF tokenizer.json."""

    source: Literal["stdlib", "text", "jsonl", "arrayrecord"] = "stdlib"
    paths: tuple[str, ...] = ()
    text_field: str = "text"
    tokenizer: str = "byte"
    val_fraction: float = 0.02
    max_docs: Optional[int] = None
    shuffle: bool = True  # shuffle training documents (deterministic from train.seed)
    shard_by: Literal["rows", "docs"] = "rows"  # multi-process split: rows of each global batch, or documents
    prefetch: int = 2  # training batches a background thread prepares ahead of the step (0: none)
    # jsonl / arrayrecord records that do not read (bad JSON, no text field, bad token ids): false = one error
    # naming the first (file, line / record, what is wrong) before the run starts; true = drop them, with a count
    skip_bad_records: bool = False

    def __post_init__(self):
        _check(0.0 < self.val_fraction < 1.0, "data.val_fraction must be in (0, 1)")
        _at_least(self, "data", dict(max_docs=1), null_ok=("max_docs",), why=dict(max_docs=" (every document)"))
        _check(self.prefetch >= 0, "data.prefetch must be >= 0 (batches prepared ahead; 0 turns it off)")
        _check(self.source == "stdlib" or len(self.paths) > 0, f"data.source={self.source!r} needs data.paths")


@dataclass(frozen=True)
class DistillConfig:
    """FCSD self-distillation (teacher = same weights, standard connectivity)."""

    temperature: float = 1.0
    kl: Literal["forward", "reverse", "both"] = "forward"
    kl_weight: float = 1.0
    ce_weight: float = 0.0
    hidden_weight: float = 0.0
    top_k_logits: int = 0  # 0 = full distribution; k > 0: forward KL over the teacher's top-k tokens + one tail bucket
    teacher_dtype: DType = "bfloat16"
    metric: Literal["val_kl", "val_loss", "task"] = "val_kl"  # "task": mean accuracy over eval.tasks
    patience: int = 20
    max_drop: float = 0.02  # stop when the metric is this much (relative) worse than the best; <= 0: off
    eval_every: int = 1000
    init_from_run: Optional[str] = None  # run folder (pretrain or distill) whose newest checkpoint = teacher + student
    export_hf: Optional[str] = None  # folder to write the best student to in HF format (convert/export.py)
    export_family: Optional[str] = None  # HF model_type for export when the weights did not come from an HF folder
    max_tokens: Optional[int] = None  # stop after this many training tokens (e.g. 5% of the teacher's pretraining)
    # --- farskip.layers: auto (fcsd/planner.py); each only with farskip.layers: auto ---
    auto_budget: Optional[float] = None  # allowed relative val-loss gap to the teacher after FCSD (0.01 = 1%)
    auto_retention: Optional[float] = None  # predicted gap after FCSD / untrained gap (default planner.DEFAULT_RETENTION)
    auto_search: Literal["ends", "greedy"] = "ends"  # candidate sets: first/last N; greedy: + one layer at a time

    def __post_init__(self):
        _check(self.temperature > 0, f"distill.temperature must be > 0, got {self.temperature}")
        _at_least(self, "distill", dict(top_k_logits=0), why=dict(top_k_logits=" (0 = full distribution)"))
        _check(self.patience >= 1 and self.eval_every >= 1, "distill.patience and distill.eval_every must be >= 1")
        _check(min(self.kl_weight, self.ce_weight, self.hidden_weight) >= 0,
               "distill weights (kl_weight, ce_weight, hidden_weight) must be >= 0")
        _check(self.max_tokens is None or self.max_tokens >= 1, "distill.max_tokens must be >= 1 or null")
        _check(self.auto_budget is None or 0 < self.auto_budget <= 1,
               f"distill.auto_budget must be a relative val-loss gap in (0, 1] (0.01 = 1%), got {self.auto_budget}")
        _check(self.auto_retention is None or 0 < self.auto_retention <= 1,
               f"distill.auto_retention must be in (0, 1] (the predicted gap after FCSD as a fraction of the "
               f"untrained gap), got {self.auto_retention}")


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation settings (eval.py)."""

    batches: int = 8
    tasks: tuple[str, ...] = ()
    max_new_tokens: int = 64
    top_p: float = 1.0
    temperature: float = 0.0

    def __post_init__(self):
        _at_least(self, "eval", dict(batches=1, max_new_tokens=1),
                  why=dict(batches=" (validation batches)", max_new_tokens=" (tokens to generate)"))
        _check(0.0 < self.top_p <= 1.0,
               f"eval.top_p={self.top_p} must be in (0, 1]: the probability mass sampling keeps (1 = all tokens; "
               "0 would keep none)")
        _check(self.temperature >= 0.0,
               f"eval.temperature={self.temperature} must be >= 0 (0 = greedy decoding, > 0 = sampling)")


@dataclass(frozen=True)
class InferenceConfig:
    """Mesh layout of generation / inference (serving/, docs/inference.md). `training`: the training
    layout (batch over data x fsdp x expert, EP all-to-alls); `tp_ep`: attention heads over mesh.tensor,
    experts over mesh.expert x mesh.tensor with replicated activations, each sub-block ending in an
    all-reduce; `foe`: Federation of Experts with each group on its own GPUs (mesh.expert = a multiple of
    runtime.num_groups), one cross-group all-reduce per layer (serving/foe.py).
    `shared_experts` (tp_ep): `tensor` = the shared experts split over mesh.tensor like a dense MLP, their
    partial sum joining an all-reduce of the layer; `replicated` = whole shared experts on every GPU."""

    layout: Literal["training", "tp_ep", "foe"] = "training"
    shared_experts: Literal["tensor", "replicated"] = "tensor"


@dataclass(frozen=True)
class KernelsConfig:
    """The optional CPU fast paths (farskip_jax/kernels/, docs/cpu_speed.md): C++ XLA FFI kernels for
    the grouped matmul (runtime.gmm: blas), the attention core (runtime.attention_impl: fused_cpu) and the
    dense matmuls of Linear layers; only programs lowered for the CPU contain them. Installed into the
    model's backend seam (kernels/ops.py) where a model is built from a config. Each key has an
    environment override that load_config reads and validates (KERNELS_ENV)."""

    enabled: bool = True  # false: plain JAX everywhere (runtime.gmm auto -> tiled, attention auto -> naive)
    dense_matmul: Literal["auto", "xla"] = "auto"  # auto: float32 Linear dots through BLAS in one-device CPU programs
    amx: Literal["auto", "off"] = "auto"  # auto: bf16 matmuls on Intel AMX tiles where the CPU has them
    blas: Literal["auto", "mkl", "openblas"] = "auto"  # auto: MKL on Intel CPUs with the `mkl` extra, else OpenBLAS
    blas_lib: Optional[str] = None  # a CBLAS shared library (path or name) tried before any other
    cache_dir: Optional[str] = None  # where the compiled library lives (default ~/.cache/farskip_jax)
    host_malloc: Literal["resident", "default"] = "resident"  # CPU runs: glibc keeps freed memory (kernels/host_memory.py)

    def __post_init__(self):
        for key in ("blas_lib", "cache_dir"):
            v = getattr(self, key)
            _check(v is None or bool(v.strip()), f"kernels.{key} is empty; remove the key for the default or name a {key}")
        _check(self.blas_lib is None or self.blas == "auto",
               f"kernels.blas_lib={self.blas_lib!r} and kernels.blas={self.blas!r} both choose the BLAS library; set one")


# environment variable -> kernels key it overrides (load_config: file < environment < command line)
KERNELS_ENV = {"FARSKIP_KERNELS": "enabled", "FARSKIP_DENSE_MATMUL": "dense_matmul", "FARSKIP_NO_AMX": "amx",
               "FARSKIP_BLAS": "blas", "FARSKIP_BLAS_LIB": "blas_lib", "FARSKIP_KERNEL_CACHE": "cache_dir",
               "FARSKIP_HOST_MALLOC": "host_malloc"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def kernels_env_overrides(environ: Optional[dict] = None) -> list[str]:
    """The `kernels.<key>=<value>` overrides of the FARSKIP_* variables set in `environ` (default
    os.environ). FARSKIP_NO_AMX=1 means kernels.amx=off (0 leaves it), FARSKIP_KERNELS=0 kernels.enabled=false.
    A value that is not a choice raises ConfigError naming the variable and the choices."""
    env = os.environ if environ is None else environ
    out = []
    for name, key in KERNELS_ENV.items():
        value = env.get(name, "").strip()
        if not value:
            continue
        if name in ("FARSKIP_NO_AMX", "FARSKIP_KERNELS"):
            v = value.lower()
            _check(v in _TRUE + _FALSE, f"{name}={value!r} is not a choice; expected one of {list(_TRUE + _FALSE)}")
            if name == "FARSKIP_NO_AMX":
                out += ["kernels.amx=off"] if v in _TRUE else []
                continue
            value = "true" if v in _TRUE else "false"
        elif key not in ("blas_lib", "cache_dir"):
            value = value.lower()
            choices = typing.get_args(typing.get_type_hints(KernelsConfig)[key])
            _check(value in choices, f"{name}={env[name]!r} is not a choice (it sets kernels.{key}); "
                                     f"expected one of {list(choices)}")
        out.append(f"kernels.{key}={value}")
    return out


def kernels_from_env(environ: Optional[dict] = None) -> KernelsConfig:
    """The default kernels section with the environment overrides applied (for code that runs before
    a config is loaded, e.g. eval.py's host-memory setup)."""
    return from_dict(KernelsConfig, apply_overrides({}, [o.removeprefix("kernels.") for o in kernels_env_overrides(environ)]))


@dataclass(frozen=True)
class Config:
    """Everything a run needs. `init_from_hf`: an HF checkpoint folder to start from."""

    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    farskip: FarSkipConfig = field(default_factory=FarSkipConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    init_from_hf: Optional[str] = None

    def with_architecture(self, src: "Config") -> "Config":
        """This config with the architecture (model and moe sections, whole) of a checkpoint's config
        `src`; runtime, farskip and every other section stay this config's."""
        return dataclasses.replace(self, model=src.model, moe=src.moe)

    def __post_init__(self):
        m, e, r, mesh = self.model, self.moe, self.runtime, self.mesh
        if e.num_experts and r.num_groups > 1:
            g = r.num_groups
            _check(m.num_kv_heads % g == 0, f"runtime.num_groups={g} must divide model.num_kv_heads={m.num_kv_heads}")
            _check(e.num_experts % g == 0, f"runtime.num_groups={g} must divide moe.num_experts={e.num_experts}")
            _check(e.top_k % g == 0, f"runtime.num_groups={g} must divide moe.top_k={e.top_k}")
            _check(mesh.expert % g == 0 or g % mesh.expert == 0,
                   f"runtime.num_groups={g} and mesh.expert={mesh.expert} must divide one another")
        _check(not e.num_experts or mesh.expert <= 1 or e.num_experts % mesh.expert == 0,
               f"moe.num_experts={e.num_experts} is not divisible by the expert-parallel size mesh.expert={mesh.expert}; "
               "pick an expert-parallel size that divides the experts")
        _check(self.inference.layout != "foe" or r.num_groups > 1,
               "inference.layout=foe runs a Federation of Experts: set runtime.num_groups to the number of groups "
               "(the paper: one per GPU, = mesh.expert)")
        # tp_ep has its own MoE exchange; foe with one group per device needs none (serving/foe.py checks)
        _check(mesh.expert <= 1 or self.inference.layout in ("tp_ep", "foe") or r.dispatch != "local",
               f"mesh.expert={mesh.expert} needs runtime.dispatch: all_to_all or ragged (got 'local')")
        d = self.distill
        for key in ("auto_budget", "auto_retention") + (("auto_search",) if d.auto_search != "ends" else ()):
            _check(self.farskip.layers == "auto" or getattr(d, key) in (None, "ends"),
                   f"distill.{key} only applies to farskip.layers: auto (got farskip.layers={self.farskip.layers!r}); "
                   f"set farskip.layers: auto or drop distill.{key}")
        if self.farskip.layers == "auto":  # resolved by FCSD before any model is built (fcsd/planner.py)
            _check(d.auto_budget is not None,
                   "farskip.layers: auto needs distill.auto_budget: the allowed relative val-loss gap to the teacher "
                   "after FCSD, e.g. 0.01 for 1%")
            _check(self.train.mode == "distill",
                   f"farskip.layers: auto is chosen at the start of FCSD (train.mode: distill), not in train.mode="
                   f"{self.train.mode}; set an explicit farskip.layers (plan one with python -m farskip_jax.fcsd.planner)")
        else:
            check_converted_layers(self.farskip, m.num_layers)
        _check(self.train.seq_len <= m.max_seq_len, f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
        rows = self.train.batch_size // self.train.grad_accum
        _check(rows % r.micro_batches == 0,
               f"runtime.micro_batches={r.micro_batches} (two-batch overlap) splits each step's batch of {rows} rows "
               f"(train.batch_size / train.grad_accum) into equal micro-batches; make it a multiple of {r.micro_batches}")


# --------------------------------------------------------------------------------------------------
# Old key names, dict <-> dataclass with type checks
# --------------------------------------------------------------------------------------------------

# runtime keys that lived in model: / moe: before the split -> where they live now
MOVED_KEYS = {f"{sec}.{k}": f"runtime.{k}" for sec, keys in (
    ("model", ("param_dtype", "compute_dtype", "remat", "scan_layers", "micro_batches", "attention_impl",
               "attention_block")),
    ("moe", ("num_groups", "dispatch", "gpus_per_node", "gmm", "gmm_tile", "capacity_factor", "foe_tokens",
             "foe_attention", "foe_sum_dtype", "aux_loss_weight", "z_loss_weight", "bias_update_rate"))) for k in keys}
_NOTED: set = set()


def migrate_tree(tree: dict, origin: str = "config") -> dict:
    """`tree` (a config mapping) with each MOVED_KEYS key at its new place and one note on stderr naming
    the moves (once per process); ConfigError when the old and the new key hold different values."""
    if not isinstance(tree, dict):
        return tree
    tree, moved = dict(tree), []
    for old, new in MOVED_KEYS.items():
        sec, key = old.split(".")
        if not isinstance(tree.get(sec), dict) or key not in tree[sec]:
            continue
        tree[sec] = dict(tree[sec])
        value = tree[sec].pop(key)
        rt = tree["runtime"] = dict(tree.get("runtime") or {})
        _check(rt.get(key, value) == value, f"{origin}: {old}={value!r} and {new}={rt.get(key)!r} both set {new} "
                                            f"({old} is its old name); keep only {new}")
        rt[key] = value
        moved.append(f"{old} -> {new}")
    note_moved(moved, origin)
    return tree


def note_moved(moved: list[str], origin: str) -> None:
    """One note on stderr naming the old keys `origin` used (["old -> new", ...]); once per process."""
    if moved and not _NOTED:
        _NOTED.update(moved)
        print(f"note: {origin} uses old key names, read at their new place ({', '.join(moved)}); "
              "docs/config.md lists every key's section", file=sys.stderr)


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=3, cutoff=0.5)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, a, path)
            except ConfigError:
                pass
        raise ConfigError(f"{path}={value!r} has the wrong type; expected {_type_name(tp)}")
    if origin is Literal:
        if isinstance(value, bool) and ("on" if value else "off") in args:
            value = "on" if value else "off"  # YAML 1.1 reads bare on/off as booleans
        if value in args and type(value) is type(next(a for a in args if a == value)):
            return value
        raise ConfigError(f"{path}={value!r} is not allowed; choose one of {list(args)}"
                          + _suggest(str(value), [str(a) for a in args]))
    if dataclasses.is_dataclass(tp):
        _check(isinstance(value, dict), f"{path} must be a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, path)
    if origin is tuple:
        _check(isinstance(value, (list, tuple)), f"{path}={value!r} must be a list")
        return tuple(_coerce(v, args[0] if args else Any, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        _check(isinstance(value, bool), f"{path}={value!r} must be true or false")
    elif tp is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        _check(_is_int(value), f"{path}={value!r} must be an integer")
    elif tp is float:
        try:  # YAML reads "1e-3" as a string
            return float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else float("x")
        except ValueError:
            raise ConfigError(f"{path}={value!r} must be a number") from None
    elif tp is str:
        _check(isinstance(value, str), f"{path}={value!r} must be a string")
    return value


# keys that existed once -> why they are gone (the error names it; results stay in the docs)
_NO_GAIN = "measured no gain over plain FCSD (docs/fcsd.md, 'Conversion methods'); drop the key"
REMOVED_KEYS = {
    "distill.anneal": f"connectivity annealing {_NO_GAIN}", "distill.anneal_tokens": f"connectivity annealing {_NO_GAIN}",
    "distill.progressive": f"progressive conversion {_NO_GAIN}", "distill.settle_rel": f"progressive conversion {_NO_GAIN}",
    "distill.stage_tokens": f"progressive conversion {_NO_GAIN}",
    "distill.local_weight": f"the teacher-forced local term {_NO_GAIN}",
    "train.inject_nan_at": "fault injection is a test hook now (train/step.py NAN_AT_STEPS); drop the key",
    **{f"farskip.{k}": f"it is distill.{k} now (with the other FCSD keys)" for k in ("auto_budget", "auto_retention",
                                                                                    "auto_search")},
}


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Build dataclass `cls` from a (nested) dict, rejecting unknown keys with suggestions (a whole
    Config's dict is migrated first: migrate_tree)."""
    if cls is Config and not path:
        data = migrate_tree(data)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else key
        _check(full not in REMOVED_KEYS, f"config key {full!r} was removed: {REMOVED_KEYS.get(full)}")
        _check(full not in MOVED_KEYS, f"config key {full!r} is {MOVED_KEYS.get(full)} now (the run's choices "
                                       f"live in runtime:, docs/config.md); set {MOVED_KEYS.get(full)}")
        _check(key in hints and key in names,
               f"unknown config key {full!r}" + (_suggest(key, names) or f"; valid keys: {names}"))
        kwargs[key] = _coerce(value, hints[key], full)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as e:
        raise ConfigError(f"{path or cls.__name__}: {e}") from None


def to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples as lists) of a config dataclass."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    return [to_dict(x) for x in cfg] if isinstance(cfg, tuple) else cfg


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML text (loads back to the same Config)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_from_dict(tree: dict) -> Config:
    return from_dict(Config, tree)


def replace(cfg: Any, **changes: Any) -> Any:
    """`dataclasses.replace` that accepts dotted keys: replace(cfg, **{"model.num_layers": 2})."""
    tree = to_dict(cfg)
    for k, v in changes.items():
        node, parts = tree, k.split(".")
        for p in parts[:-1]:
            node = node[p]
        node[parts[-1]] = to_dict(v)
    return from_dict(type(cfg), tree)


from farskip_jax.config_yaml import apply_overrides, load_config, load_yaml_tree, read_yaml_mapping  # noqa: E402,F401
from farskip_jax.config_yaml import check_request  # noqa: E402,F401
