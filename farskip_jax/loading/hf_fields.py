"""The fields of an HF config.json, checked before a family module reads them.

    tree = read_family_config(hf, family.config_tree, where="/models/x/config.json")

A family module reads the fields it needs as `hf["num_experts_per_tok"]`; `read_family_config` hands
it the config as a `Fields` mapping whose missing (or null) entries raise CheckpointError naming the
field, the model type and the file, instead of a KeyError deep in the family. Before that, every
integer field the families read (layer count, sizes, expert counts, ...) that is present must be an
integer in range, so `"num_hidden_layers": "3"` is named as such, and one routed-expert count (num_experts,
num_local_experts or n_routed_experts: every supported family is an MoE) must be given.
"""

from __future__ import annotations

from typing import Callable

from farskip_jax.errors import CheckpointError

# integer fields of the supported families' config.json -> the smallest valid value
INT_FIELDS = {
    "vocab_size": 1, "hidden_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
    "head_dim": 1, "intermediate_size": 1, "intermediate_size_mlp": 1, "moe_intermediate_size": 1,
    "shared_expert_intermediate_size": 1, "num_experts": 1, "num_local_experts": 1, "n_routed_experts": 1,
    "num_experts_per_tok": 1, "n_shared_experts": 0, "kv_lora_rank": 1, "q_lora_rank": 1, "qk_nope_head_dim": 1,
    "qk_rope_head_dim": 1, "v_head_dim": 1, "first_k_dense_replace": 0, "max_position_embeddings": 1,
    "decoder_sparse_step": 1, "n_group": 1, "topk_group": 1, "interleave_moe_layer_step": 1,
    "attention_chunk_size": 1, "moe_layer_freq": 1,
}
FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor", "initializer_range")
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def _restore(where: str) -> str:
    return f"fix {where} or restore the checkpoint's original (re-download or re-export the folder)"


class Fields(dict):
    """A config.json dict whose `[key]` names a missing or null field in a CheckpointError."""

    where: str = "config.json"

    def _missing(self, key: str, what: str) -> CheckpointError:
        mt = dict.get(self, "model_type", "?")
        return CheckpointError(f"{self.where} {what} {key!r}, which a {mt} config.json must give (farskip_jax reads the "
                               f"model's shape from it); {_restore(self.where)}")

    def __missing__(self, key):
        raise self._missing(key, "lacks")

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if value is None:
            raise self._missing(key, "has null for")
        return value


def check_types(hf: dict, where: str = "config.json") -> None:
    """CheckpointError naming the first present integer / float field of the wrong type or range."""
    for key, low in INT_FIELDS.items():
        v = hf.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise CheckpointError(f"{where}: {key!r} is {v!r} (a JSON {_json_type(v)}), not an integer: write it as "
                                  f"{_as_int_hint(v)}, or restore the checkpoint's original config.json (re-download or "
                                  "re-export the folder)")
        if v < low:
            raise CheckpointError(f"{where}: {key!r} is {v}, must be >= {low}; {_restore(where)}")
    for key in FLOAT_FIELDS:
        v = hf.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise CheckpointError(f"{where}: {key!r} is {v!r} (a JSON {_json_type(v)}), not a number; {_restore(where)}")


def _as_int_hint(v) -> str:
    """How the value would read as a JSON integer ("the JSON number 3"), or "a JSON integer"."""
    try:
        f = float(str(v).strip())
        if f.is_integer():
            return f"the JSON number {int(f)}"
    except ValueError:
        pass
    return "a JSON integer"


def _json_type(v) -> str:
    return {str: "string", float: "number", bool: "boolean", list: "array", dict: "object"}.get(type(v), type(v).__name__)


def read_family_config(hf: dict, config_tree: Callable[[dict], dict], where: str = "config.json") -> dict:
    """config_tree(hf) with the fields checked (module docstring); CheckpointError names what is wrong."""
    check_types(hf, where)
    if all(hf.get(k) is None for k in EXPERT_COUNT_FIELDS):
        raise CheckpointError(f"{where} gives no routed-expert count (one of {', '.join(EXPERT_COUNT_FIELDS)}), which a "
                              f"{hf.get('model_type', '?')} config.json must give; {_restore(where)}")
    fields = Fields(hf)
    fields.where = where
    try:
        tree = config_tree(fields)
    except (KeyError, TypeError, ValueError) as e:  # a field the checks above do not know, read the wrong way
        raise CheckpointError(f"{where} cannot be read as a {hf.get('model_type', '?')} config.json "
                              f"({type(e).__name__}: {e}); {_restore(where)}") from None
    return tree
