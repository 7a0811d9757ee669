"""Read our named scopes back out of HLO op_name metadata.

The model wraps its parts in `jax.named_scope` (layer_i, attention_qkv/core/out, router, dispatch,
expert_compute, combine, shared_experts, dense_mlp). After jit/grad an op_name looks like

    jit(step)/jvp(layer_3)/moe/dispatch/all_to_all                      forward
    jit(step)/transpose(jvp(layer_3))/attention/attention_qkv/dot_general   backward

so: layer = the last `layer_<i>`, scope = the innermost known scope, direction = bwd when the path
went through a `transpose(...)` (reverse-mode), fwd otherwise (forward recomputation under remat
counts as fwd work).
"""

from __future__ import annotations

import re
from typing import Optional

SCOPES = ("attention_qkv", "attention_core", "attention_out", "router", "dispatch", "expert_compute", "combine",
          "shared_experts", "dense_mlp")
COARSE = {"attention_qkv": "attention", "attention_core": "attention", "attention_out": "attention",
          "router": "moe", "dispatch": "moe", "expert_compute": "moe", "combine": "moe",
          "shared_experts": "shared", "dense_mlp": "shared"}
_LAYER = re.compile(r"layer_(\d+)")
_SCOPE = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(SCOPES) + r")(?![A-Za-z0-9])")


def layer_of(op_name: str) -> Optional[int]:
    m = _LAYER.findall(op_name or "")
    return int(m[-1]) if m else None


def scope_of(op_name: str) -> str:
    """Innermost known scope, 'attention'/'moe'/'mlp' when only the block is named, else 'other'."""
    m = _SCOPE.findall(op_name or "")
    if m:
        return m[-1]
    for block in ("attention", "moe", "mlp"):
        if re.search(rf"(?<![A-Za-z0-9_]){block}(?![A-Za-z0-9_])", op_name or ""):
            return block
    return "other"


def direction_of(op_name: str) -> str:
    return "bwd" if "transpose(" in (op_name or "") else "fwd"


def label_of(op_name: str) -> str:
    """'L3/attention_qkv' style label for a compute op ('other' outside the layers)."""
    layer = layer_of(op_name)
    scope = scope_of(op_name)
    return scope if layer is None else f"L{layer}/{scope}"
