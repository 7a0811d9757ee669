"""Typed, frozen experiment configuration: a tree of frozen dataclasses (`Config`, sections below).

`model` and `moe` are the architecture, what a checkpoint fixes: loading weights replaces them whole
(`Config.with_architecture`). `runtime` and every other section are the run's choices, which no load
touches (docs/config.md gives every key its side). Every key and value is checked: an unknown key
names the nearest valid ones, a wrong type the expected type, a value out of its `Annotated` range
the range (and why), an impossible combination its fix; each is one `ConfigError`. YAML files,
overrides and old key names: config_yaml.py.

    cfg = load_config("configs/tiny.yaml", ["train.steps=50"])
    print(dump_config(cfg))
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Optional, Union

import yaml

from farskip_jax.config_yaml import MOVED_KEYS, apply_overrides, load_yaml_tree, migrate_tree, note_moved  # noqa: F401
from farskip_jax.connectivity import layer_sets
from farskip_jax.errors import ConfigError, did_you_mean

DType = Literal["float32", "bfloat16", "float16"]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class Bound:
    """A field's range (`Annotated[int, Bound(1)]`), checked when its section is built: lo <= v (lo < v
    with lo_open), and v <= hi (v < hi with hi_open) when hi is set; `why` explains it in the error."""

    lo: float
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""

    def check(self, v: Any, path: str, nullable: bool, integer: bool) -> None:
        real = isinstance(v, int if integer else (int, float)) and not isinstance(v, bool)
        if (v is None and nullable) or (real and (v > self.lo if self.lo_open else v >= self.lo) and (
                self.hi is None or (v < self.hi if self.hi_open else v <= self.hi))):
            return
        what = (f"{'>' if self.lo_open else '>='} {self.lo}" if self.hi is None else
                f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}")
        raise ConfigError(f"{path} must be {'an integer ' if integer and not real else ''}{what}"
                          f"{' or null' if nullable else ''}{f' ({self.why})' if self.why else ''}, got {v!r}")


Pos, NonNeg = Annotated[int, Bound(1)], Annotated[int, Bound(0)]
PosReal, NonNegReal = Annotated[float, Bound(0, lo_open=True)], Annotated[float, Bound(0)]
@functools.cache
def _bounds(cls: type) -> list[tuple[str, Bound, bool, bool]]:
    """(field, Bound, nullable, integer) of each bounded field of section class `cls`."""
    out = []
    for name, tp in typing.get_type_hints(cls, include_extras=True).items():
        args = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
        for a in (a for a in args if typing.get_origin(a) is Annotated):
            out += [(name, b, type(None) in args, a.__origin__ is int) for b in a.__metadata__ if isinstance(b, Bound)]
    return out


def section(path: str):
    """@dataclass(frozen=True) for the config section at `path` ("train", "model.rope_scaling"): building
    one checks each `Bound` of its fields, then runs the class's `check()` (cross-key rules), if any."""

    def post_init(self):
        for name, bound, nullable, integer in _bounds(type(self)):
            bound.check(getattr(self, name), f"{path}.{name}", nullable, integer)
        getattr(self, "check", lambda: None)()

    def wrap(cls: type) -> type:
        cls.__post_init__ = post_init
        return dataclass(frozen=True)(cls)

    return wrap


@section("model.rope_scaling")
class RopeScalingConfig:
    """RoPE frequency scaling. `type`: none | linear | llama3 | yarn (see model/rope.py)."""

    type: Literal["none", "linear", "llama3", "yarn"] = "none"
    factor: PosReal = 1.0
    original_max_position: Pos = 4096
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 1.0  # yarn (DeepSeek)
    mscale_all_dim: float = 0.0  # yarn (DeepSeek)
    attention_factor: Optional[float] = None  # yarn: overrides the computed attention scale
    truncate: bool = True  # yarn: round the correction range to whole dims (HF default)


@section("model")
class ModelConfig:
    """Transformer architecture. Layer i is an MoE layer when i >= first_k_dense and
    (i + 1) % moe_every == 0, unless `moe_layers` lists the MoE layers."""

    vocab_size: Pos = 512
    d_model: Pos = 128
    num_layers: Pos = 4
    num_heads: Pos = 4
    num_kv_heads: Pos = 2
    head_dim: Optional[Annotated[int, Bound(1, why="d_model / num_heads")]] = None
    mlp_hidden: Pos = 512  # hidden size of dense SwiGLU layers
    first_k_dense: NonNeg = 0
    moe_every: Pos = 1
    moe_layers: Optional[tuple[int, ...]] = None
    attention: Literal["gqa", "mla"] = "gqa"
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False
    norm_eps: PosReal = 1e-6
    rope_theta: PosReal = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    max_seq_len: Pos = 2048  # positions the checkpoint serves (HF max_position_embeddings)
    tie_embeddings: bool = False
    init_std: NonNegReal = 0.02
    qk_norm_scope: Literal["head", "all_heads"] = "head"  # q/k RMSNorm per head or over all heads (OLMoE)
    qk_l2_norm: bool = False  # weightless L2 (RMS) norm of q/k after rope, rope layers only (Llama-4)
    rope_interleaved: bool = False  # rotate adjacent pairs (DeepSeek, Llama-4) instead of halves
    nope_layers: tuple[int, ...] = ()  # layers without rope (Llama-4 NoPE layers)
    attention_chunk_size: Optional[Pos] = None  # chunked local attention (Llama-4)
    chunked_layers: Optional[tuple[int, ...]] = None  # layers using it (None = every layer)
    attn_temperature_tuning: bool = False  # NoPE layers scale q by log1p(floor((pos+1)/floor))*scale+1
    attn_temperature_floor: float = 8192.0
    attn_temperature_scale: float = 0.1
    gated_attention: bool = False  # attention output *= sigmoid(gate_proj(x)) before o_proj (Instella)
    q_lora_rank: Optional[Pos] = None  # MLA: low-rank query (None = full q projection)
    kv_lora_rank: Pos = 512  # MLA: compressed kv latent size
    qk_nope_head_dim: int = 128  # MLA: per-head q/k dims without rope ...
    qk_rope_head_dim: int = 64  # ... and with rope (one rope key shared by all heads)
    v_head_dim: int = 128  # MLA: per-head value dim

    def check(self):
        n = self.num_layers
        _check(self.num_heads % self.num_kv_heads == 0,
               f"model.num_kv_heads={self.num_kv_heads} must divide model.num_heads={self.num_heads} "
               f"(grouped-query attention shares each kv head among num_heads/num_kv_heads query heads)")
        _check(self.head_dim is not None or self.d_model % self.num_heads == 0,
               f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}; "
               "set model.head_dim explicitly")
        _check(self.first_k_dense <= n, "model.first_k_dense must be in [0, num_layers]")
        for key in ("moe_layers", "nope_layers", "chunked_layers"):
            bad = [i for i in getattr(self, key) or () if not 0 <= i < n]
            _check(not bad, f"model.{key} has layer indices outside [0, {n}): {bad}")
        _check(self.attention != "mla" or self.qk_rope_head_dim % 2 == 0,
               f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    def is_moe_layer(self, i: int) -> bool:
        if self.moe_layers is not None:
            return i in self.moe_layers
        return i >= self.first_k_dense and (i + 1) % self.moe_every == 0


@section("moe")
class MoEConfig:
    """Routed + shared experts and their router (architecture). `num_experts: 0` makes every layer dense."""

    num_experts: NonNeg = 8
    top_k: int = 2
    expert_hidden: Pos = 256
    num_shared_experts: NonNeg = 1
    shared_hidden: Optional[Annotated[int, Bound(1, why="expert_hidden x num_shared_experts")]] = None
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: Pos = 1  # group-limited routing: experts split in n_group groups ...
    topk_group: Pos = 1  # ... and tokens pick experts only from the best topk_group groups
    group_score: Literal["max", "top2_sum"] = "max"  # how a group is scored (V2: max, V3: top2_sum)
    selection_bias: bool = False  # aux-loss-free balancing: bias added for selection only
    shared_gate: bool = False  # shared-expert output *= sigmoid(x @ w_gate [d, 1]) (Qwen2-MoE)
    route_on_input: bool = False  # the routing weight scales the expert INPUT (Llama-4; needs top_k 1)

    def check(self):
        e, k = self.num_experts, self.top_k
        if e:
            _check(1 <= k <= e, f"moe.top_k={k} must be between 1 and moe.num_experts={e}")
            _check(e % self.n_group == 0, f"moe.n_group={self.n_group} must divide moe.num_experts={e}")
            _check(self.topk_group <= self.n_group, f"moe.topk_group={self.topk_group} must be in [1, moe.n_group={self.n_group}]")
            _check(self.n_group == 1 or k <= self.topk_group * (e // self.n_group),
                   "moe.top_k exceeds the experts available in the selected groups (topk_group * num_experts / n_group)")
        _check(not self.route_on_input or k == 1,
               f"moe.route_on_input scales each expert's input by its weight and needs moe.top_k=1, got {k}")

    @property
    def resolved_shared_hidden(self) -> int:
        return self.shared_hidden if self.shared_hidden is not None else self.expert_hidden * self.num_shared_experts


@section("runtime")
class RuntimeConfig:
    """How this run computes the architecture: no checkpoint fixes any of it, so loading weights keeps
    every key as the user set it. Kernels and layouts: docs/config.md."""

    param_dtype: DType = "float32"
    compute_dtype: DType = "float32"
    remat: Literal["none", "full", "dots", "minimal"] = "none"
    scan_layers: bool = False  # one lax.scan per stack of identical layers (docs/scan.md)
    micro_batches: Annotated[int, Bound(1, why="2 = two-batch overlap")] = 1
    attention_impl: Literal["auto", "naive", "blockwise", "causal_blocks", "fused_cpu"] = "auto"  # kernels/attention.py
    attention_block: Pos = 512
    num_groups: Pos = 1  # Federation of Experts groups (1 = ordinary MoE); the same weights for any H
    dispatch: Literal["local", "all_to_all", "hierarchical", "ragged"] = "local"
    gpus_per_node: Optional[Pos] = None  # hierarchical dispatch: node = device.id // this (null: process_index)
    gmm: Literal["auto", "blas", "ragged_dot", "tiled", "einsum"] = "auto"
    gmm_tile: Pos = 256
    capacity_factor: Optional[Annotated[float, Bound(0, lo_open=True, why="null: dropless")]] = None
    foe_tokens: Literal["replicated", "sharded"] = "replicated"  # FoE under EP: tokens over device groups
    foe_attention: Literal["groups", "local"] = "groups"  # local: shared-input attention on own tokens
    foe_sum_dtype: Literal["auto", "float32", "bfloat16", "float8_e4m3fn"] = "auto"  # FoE sum payload
    aux_loss_weight: NonNegReal = 0.01  # load-balance loss weight
    z_loss_weight: NonNegReal = 0.0  # router z-loss weight
    bias_update_rate: NonNegReal = 1e-3  # moe.selection_bias: the bias step per update

    def check(self):
        _check(self.gpus_per_node is None or self.dispatch == "hierarchical",
               f"runtime.gpus_per_node is read by runtime.dispatch=hierarchical only (got dispatch={self.dispatch!r})")
        _check(self.foe_attention == "groups" or self.foe_tokens == "sharded",
               "runtime.foe_attention=local needs runtime.foe_tokens=sharded (with replicated tokens every device "
               "group would run the whole attention on all tokens)")
        _check(self.foe_sum_dtype != "float8_e4m3fn" or self.foe_tokens == "sharded",
               "runtime.foe_sum_dtype=float8_e4m3fn needs runtime.foe_tokens=sharded (the fp8 sum is an all-to-all "
               "of scaled shards plus a local sum, i.e. a reduce-scatter)")


@section("farskip")
class FarSkipConfig:
    """Which stream each sub-block reads (docs/design.md section 1; parsed by connectivity/layer_sets.py).
    preset: standard | farskip | attn_only | mlp_only; attn_input / moe_input override the preset on the
    converted `layers` (`auto`: chosen by FCSD within distill.auto_budget); `skip_distance: d`: partial /
    outdated inputs lack the MoE outputs of the last d layers (1 = the paper's FarSkip)."""

    preset: str = "standard"
    attn_input: Optional[Literal["full", "partial", "outdated"]] = None
    moe_input: Optional[Literal["full", "outdated"]] = None
    layers: Union[str, tuple[int, ...]] = "all"
    skip_distance: Pos = 1

    def check(self):
        layer_sets.check_farskip_section(self)

    def converted_layers(self, num_layers: int) -> frozenset[int]:
        return layer_sets.converted_layers(self, num_layers)

    def layer_inputs(self, i: int, num_layers: int) -> tuple[str, str]:
        """(attn_input, moe_input) of layer i."""
        return layer_sets.layer_inputs(self, i, num_layers)


@section("mesh")
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

    def check(self):
        sizes = {"data": self.data, "fsdp": self.fsdp, "expert": self.expert, "tensor": self.tensor}
        _check(all(v == -1 or v >= 1 for v in sizes.values()), f"mesh sizes must be >= 1 or -1, got {sizes}")
        _check(sum(v == -1 for v in sizes.values()) <= 1, f"at most one mesh axis may be -1, got {sizes}")


@section("train")
class TrainConfig:
    """Optimisation, schedule, logging and checkpoint cadence."""

    mode: Literal["pretrain", "distill"] = "pretrain"
    steps: Pos = 300
    batch_size: Pos = 16
    seq_len: Pos = 128
    lr: PosReal = 3e-3
    min_lr_ratio: Annotated[float, Bound(0, 1, why="final lr / train.lr")] = 0.1
    warmup_steps: NonNeg = 30
    weight_decay: Annotated[float, Bound(0, why="0 turns it off")] = 0.1
    b1: Annotated[float, Bound(0, 1, hi_open=True, why="AdamW moment decay")] = 0.9
    b2: Annotated[float, Bound(0, 1, hi_open=True, why="AdamW moment decay")] = 0.95
    grad_clip: Annotated[float, Bound(0, why="0 turns it off")] = 1.0
    grad_accum: Pos = 1
    seed: Annotated[int, Bound(0, 2**32, hi_open=True, why="it seeds the weights and the data order")] = 0
    eval_every: Annotated[int, Bound(0, why="0 turns it off")] = 100
    eval_batches: Pos = 4
    log_every: Pos = 10
    run_dir: str = "runs/default"
    overwrite: bool = False
    checkpoint_every: Annotated[int, Bound(0, why="the steps between checkpoints; 0 saves only at the end")] = 0
    keep_checkpoints: Annotated[int, Bound(1, why="the newest checkpoints kept; keep at least the run's final one")] = 3
    resume_step: Optional[Annotated[int, Bound(0, why="a checkpoint step to resume from, newer ones are dropped; null: the newest")]] = None
    max_nonfinite: int = 5
    peak_flops: Optional[Annotated[float, Bound(0, lo_open=True, why="FLOP/s per device; null: measured on CPU")]] = None
    tensorboard: bool = True
    time_limit_s: Optional[Annotated[float, Bound(0, lo_open=True, why="seconds; stop with a checkpoint after it; null: no limit")]] = None
    loss_chunk: Optional[Annotated[int, Bound(0, why="positions per cross-entropy chunk, losses/chunked.py; 0 / null: all")]] = None

    def check(self):
        _check(self.batch_size % self.grad_accum == 0, "train.grad_accum must divide train.batch_size")


@section("data")
class DataConfig:
    """Training text. source: stdlib (the interpreter's own .py files, no download) | text | jsonl |
    arrayrecord; tokenizer: byte or a path to an HF tokenizer.json."""

    source: Literal["stdlib", "text", "jsonl", "arrayrecord"] = "stdlib"
    paths: tuple[str, ...] = ()
    text_field: str = "text"
    tokenizer: str = "byte"
    val_fraction: Annotated[float, Bound(0, 1, lo_open=True, hi_open=True)] = 0.02
    max_docs: Optional[Annotated[int, Bound(1, why="null: every document")]] = None
    shuffle: bool = True  # shuffle training documents (deterministic from train.seed)
    shard_by: Literal["rows", "docs"] = "rows"  # multi-process split: rows of each global batch, or documents
    prefetch: Annotated[int, Bound(0, why="batches a background thread prepares ahead; 0 turns it off")] = 2
    skip_bad_records: bool = False  # unreadable jsonl/arrayrecord records: false = one error naming the first; true = drop, counted

    def check(self):
        _check(self.source == "stdlib" or len(self.paths) > 0, f"data.source={self.source!r} needs data.paths")


@section("distill")
class DistillConfig:
    """FCSD self-distillation (teacher = same weights, standard connectivity); the auto_* keys apply to
    farskip.layers: auto only (fcsd/planner.py)."""

    temperature: PosReal = 1.0
    kl: Literal["forward", "reverse", "both"] = "forward"
    kl_weight: NonNegReal = 1.0
    ce_weight: NonNegReal = 0.0
    hidden_weight: NonNegReal = 0.0
    top_k_logits: Annotated[int, Bound(0, why="0 = full distribution; k: forward KL over the teacher's top k + one tail bucket")] = 0
    teacher_dtype: DType = "bfloat16"
    metric: Literal["val_kl", "val_loss", "task"] = "val_kl"  # "task": mean accuracy over eval.tasks
    patience: Pos = 20
    max_drop: float = 0.02  # stop when the metric is this much (relative) worse than the best; <= 0: off
    eval_every: Pos = 1000
    init_from_run: Optional[str] = None  # run folder (pretrain or distill) whose newest checkpoint = teacher + student
    export_hf: Optional[str] = None  # folder to write the best student to in HF format (convert/export.py)
    export_family: Optional[str] = None  # HF model_type for export when the weights did not come from an HF folder
    max_tokens: Optional[Pos] = None  # stop after this many training tokens (e.g. 5% of the teacher's pretraining)
    auto_budget: Optional[Annotated[float, Bound(0, 1, lo_open=True, why="relative val-loss gap, 0.01 = 1%")]] = None
    auto_retention: Optional[Annotated[float, Bound(0, 1, lo_open=True, why="predicted gap after / before FCSD")]] = None
    auto_search: Literal["ends", "greedy"] = "ends"  # candidate sets: first/last N; greedy: + one layer at a time


@section("eval")
class EvalConfig:
    """Evaluation settings (eval.py)."""

    batches: Annotated[int, Bound(1, why="validation batches")] = 8
    tasks: tuple[str, ...] = ()
    max_new_tokens: Annotated[int, Bound(1, why="tokens to generate")] = 64
    top_p: Annotated[float, Bound(0, 1, lo_open=True, why="probability mass sampling keeps; 1 = all tokens")] = 1.0
    temperature: Annotated[float, Bound(0, why="0 = greedy decoding, > 0 = sampling")] = 0.0


@section("inference")
class InferenceConfig:
    """Mesh layout of generation (serving/, docs/inference.md): training | tp_ep (heads over mesh.tensor,
    all-reduces) | dp_ep (SGLang's large-scale EP) | foe (a GPU group per FoE group); shared_experts
    (tp_ep): `tensor` splits them over mesh.tensor, `replicated` keeps them whole on every GPU."""

    layout: Literal["training", "tp_ep", "dp_ep", "foe"] = "training"
    shared_experts: Literal["tensor", "replicated"] = "tensor"


@section("kernels")
class KernelsConfig:
    """The optional CPU fast paths (farskip_jax/kernels/, docs/cpu_speed.md): C++ XLA FFI kernels for the
    grouped matmul, the attention core and float32 Linear matmuls. Environment overrides: KERNELS_ENV."""

    enabled: bool = True  # false: plain JAX everywhere (runtime.gmm auto -> tiled, attention auto -> naive)
    dense_matmul: Literal["auto", "xla"] = "auto"  # auto: float32 Linear dots through BLAS in one-device CPU programs
    amx: Literal["auto", "off"] = "auto"  # auto: bf16 matmuls on Intel AMX tiles where the CPU has them
    blas: Literal["auto", "mkl", "openblas"] = "auto"  # auto: MKL on Intel CPUs with the `mkl` extra, else OpenBLAS
    blas_lib: Optional[str] = None  # a CBLAS shared library (path or name) tried before any other
    cache_dir: Optional[str] = None  # where the compiled library lives (default ~/.cache/farskip_jax)
    host_malloc: Literal["resident", "default"] = "resident"  # CPU runs: glibc keeps freed memory (kernels/host_memory.py)

    def check(self):
        for key in ("blas_lib", "cache_dir"):
            v = getattr(self, key)
            _check(v is None or bool(v.strip()), f"kernels.{key} is empty; remove the key for the default or name a {key}")
        _check(self.blas_lib is None or self.blas == "auto",
               f"kernels.blas_lib={self.blas_lib!r} and kernels.blas={self.blas!r} both choose the BLAS library; set one")


@section("")
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

    def check(self):
        m, e, r, mesh, d, fs = self.model, self.moe, self.runtime, self.mesh, self.distill, self.farskip
        g = r.num_groups
        if e.num_experts and g > 1:
            for what, n in (("model.num_kv_heads", m.num_kv_heads), ("moe.num_experts", e.num_experts),
                            ("moe.top_k", e.top_k)):
                _check(n % g == 0, f"runtime.num_groups={g} must divide {what}={n}")
            _check(mesh.expert % g == 0 or g % mesh.expert == 0,
                   f"runtime.num_groups={g} and mesh.expert={mesh.expert} must divide one another")
        _check(not e.num_experts or mesh.expert <= 1 or e.num_experts % mesh.expert == 0,
               f"moe.num_experts={e.num_experts} is not divisible by the expert-parallel size mesh.expert={mesh.expert}; "
               "pick an expert-parallel size that divides the experts")
        _check(self.inference.layout != "foe" or g > 1,
               "inference.layout=foe runs a Federation of Experts: set runtime.num_groups to the number of groups "
               "(the paper: one per GPU, = mesh.expert)")
        # tp_ep has its own MoE exchange; foe with one group per device needs none (serving/foe.py checks)
        _check(mesh.expert <= 1 or self.inference.layout in ("tp_ep", "foe") or r.dispatch != "local",
               f"mesh.expert={mesh.expert} needs runtime.dispatch: all_to_all or ragged (got 'local')")
        for key in ("auto_budget", "auto_retention") + (("auto_search",) if d.auto_search != "ends" else ()):
            _check(fs.layers == "auto" or getattr(d, key) in (None, "ends"),
                   f"distill.{key} only applies to farskip.layers: auto (got farskip.layers={fs.layers!r}); "
                   f"set farskip.layers: auto or drop distill.{key}")
        if fs.layers == "auto":  # resolved by FCSD before any model is built (fcsd/planner.py)
            _check(d.auto_budget is not None, "farskip.layers: auto needs distill.auto_budget: the allowed relative "
                                              "val-loss gap to the teacher after FCSD, e.g. 0.01 for 1%")
            _check(self.train.mode == "distill",
                   f"farskip.layers: auto is chosen at the start of FCSD (train.mode: distill), not in train.mode="
                   f"{self.train.mode}; set an explicit farskip.layers (plan one with python -m farskip_jax.analysis.conversion_plan)")
        else:
            layer_sets.check_converted_layers(fs, m.num_layers)
        _check(self.train.seq_len <= m.max_seq_len, f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
        rows = self.train.batch_size // self.train.grad_accum
        _check(rows % r.micro_batches == 0,
               f"runtime.micro_batches={r.micro_batches} (two-batch overlap) splits each step's batch of {rows} rows "
               f"(train.batch_size / train.grad_accum) into equal micro-batches; make it a multiple of {r.micro_batches}")


# keys that existed once -> why they are gone (the error names it; results stay in the docs)
_NO_GAIN = "measured no gain over plain FCSD (docs/fcsd.md, 'Conversion methods'); drop the key"
REMOVED_KEYS = {
    **{f"distill.{k}": f"connectivity annealing {_NO_GAIN}" for k in ("anneal", "anneal_tokens")},
    **{f"distill.{k}": f"progressive conversion {_NO_GAIN}" for k in ("progressive", "settle_rel", "stage_tokens")},
    "distill.local_weight": f"the teacher-forced local term {_NO_GAIN}",
    "train.inject_nan_at": "fault injection is a test fixture now (tests/conftest.py nan_at_steps); drop the key",
    **{f"farskip.{k}": f"it is distill.{k} now (with the other FCSD keys)" for k in ("auto_budget", "auto_retention",
                                                                                    "auto_search")},
}


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, a, path)
            except ConfigError:
                pass
        raise ConfigError(f"{path}={value!r} has the wrong type; expected "
                          f"{getattr(tp, '__name__', None) or str(tp).replace('typing.', '')}")
    if origin is Literal:
        if isinstance(value, bool) and ("on" if value else "off") in args:
            value = "on" if value else "off"  # YAML 1.1 reads bare on/off as booleans
        if value in args and type(value) is type(next(a for a in args if a == value)):
            return value
        raise ConfigError(f"{path}={value!r} is not allowed; choose one of {list(args)}"
                          + did_you_mean(str(value), [str(a) for a in args]))
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
        _check(isinstance(value, int) and not isinstance(value, bool), f"{path}={value!r} must be an integer")
    elif tp is float:
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                return float(value)  # YAML reads "1e-3" as a string
            except ValueError:
                pass
        raise ConfigError(f"{path}={value!r} must be a number")
    elif tp is str:
        _check(isinstance(value, str), f"{path}={value!r} must be a string")
    return value


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Build dataclass `cls` from a (nested) dict, rejecting unknown keys with suggestions (a whole
    Config's dict is migrated first: migrate_tree)."""
    if cls is Config and not path:
        data = migrate_tree(data)
    hints, names, kwargs = typing.get_type_hints(cls), [f.name for f in dataclasses.fields(cls)], {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else key
        _check(full not in REMOVED_KEYS, f"config key {full!r} was removed: {REMOVED_KEYS.get(full)}")
        _check(full not in MOVED_KEYS, f"config key {full!r} is {MOVED_KEYS.get(full)} now (the run's choices "
                                       f"live in runtime:, docs/config.md); set {MOVED_KEYS.get(full)}")
        _check(key in names, f"unknown config key {full!r}" + (did_you_mean(key, names) or f"; valid keys: {names}"))
        kwargs[key] = _coerce(value, hints[key], full)
    try:
        return cls(**kwargs)
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
        if k in MOVED_KEYS:
            note_moved([f"{k} -> {MOVED_KEYS[k]}"], f"replace({k}=...)")
        *parents, last = MOVED_KEYS.get(k, k).split(".")
        node = tree
        for p in parents:
            node = node[p]
        node[last] = to_dict(v)
    return from_dict(type(cfg), tree)


# environment variable -> kernels key it overrides (load_config: file < environment < command line)
KERNELS_ENV = {"FARSKIP_KERNELS": "enabled", "FARSKIP_DENSE_MATMUL": "dense_matmul", "FARSKIP_NO_AMX": "amx",
               "FARSKIP_BLAS": "blas", "FARSKIP_BLAS_LIB": "blas_lib", "FARSKIP_KERNEL_CACHE": "cache_dir",
               "FARSKIP_HOST_MALLOC": "host_malloc"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def kernels_env_overrides(environ: Optional[dict] = None) -> list[str]:
    """The `kernels.<key>=<value>` overrides of the FARSKIP_* variables set in `environ` (default
    os.environ). FARSKIP_NO_AMX=1 means kernels.amx=off (0 leaves it), FARSKIP_KERNELS=0 kernels.enabled=false.
    A value that is not a choice raises ConfigError naming the variable and the choices."""
    env, out = os.environ if environ is None else environ, []
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
            value, choices = value.lower(), typing.get_args(typing.get_type_hints(KernelsConfig)[key])
            _check(value in choices, f"{name}={env[name]!r} is not a choice (it sets kernels.{key}); "
                                     f"expected one of {list(choices)}")
        out.append(f"kernels.{key}={value}")
    return out


def kernels_from_env(environ: Optional[dict] = None) -> KernelsConfig:
    """The default kernels section with the environment overrides applied (for code that runs before
    a config is loaded, e.g. eval.py's host-memory setup)."""
    return from_dict(KernelsConfig, {o.split("=")[0][len("kernels."):]: yaml.safe_load(o.split("=", 1)[1])
                                     for o in kernels_env_overrides(environ)})


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> Config:
    """Load `path` (or the defaults when None), apply the kernels' environment overrides
    (kernels_env_overrides), then the dotted overrides, validate (check_request included)."""
    tree = load_yaml_tree(path) if path else {}
    tree = apply_overrides(tree, kernels_env_overrides() + list(overrides or []))
    return check_request(from_dict(Config, tree))


def check_request(cfg: Config) -> Config:
    """`cfg` when what it asks a new run to do is possible as asked, else ConfigError: the warmup of
    train.warmup_steps must fit in train.steps (the schedule would otherwise never reach train.lr).
    Checked where a config is requested (load_config), not where a saved run's config is read back."""
    t = cfg.train
    _check(t.warmup_steps <= t.steps,
           f"train.warmup_steps={t.warmup_steps} is longer than the run (train.steps={t.steps}): the learning rate "
           f"would never reach train.lr on the schedule asked for; set train.warmup_steps <= {t.steps} "
           f"(e.g. train.warmup_steps={t.steps // 10} for a short run)")
    return cfg
