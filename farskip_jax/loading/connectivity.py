"""Which connectivity an imported HF folder runs under, and where that choice came from.

    section, origin = import_connectivity(hf_config, family_section, overrides)

Sources, strongest last (each replaces the one before):
1. the family default: `standard` for every stock HF family; the Instella keys ("farskip",
   "farskip_start_idx", "farskip_end_idx", "attn_only_farskip", "mlp_only_farskip") of a FarSkip-native
   DeepSeek-V3 layout (families/farskip_native.py);
2. the "farskip_jax" section that `export_hf` writes into config.json (preset, converted layers,
   attn/moe inputs, skip distance): an exported FCSD student re-imports with the connectivity it was
   trained under. It is more precise than the Instella keys (any layer set, skip distance), so it wins;
3. explicit overrides (`farskip.preset=standard`, `farskip.layers=last:4`), applied key by key over the
   section of 1-2 (as a YAML override over its base). Overriding `farskip.preset` also drops the
   restored `attn_input` / `moe_input` refinements, which belonged to the restored preset, unless they
   are overridden too: `farskip.preset=standard` always gives the standard model. A restored section
   that converts no layers (an export of a standard model) loses its empty layer set too, so
   `farskip.preset=farskip` on such a folder converts the preset's default layers (all).

`describe(cfg, origin)` is the one line the import CLI prints.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Union

from farskip_jax.config import Config, FarSkipConfig
from farskip_jax.errors import CheckpointError

EXPORT_KEY = "farskip_jax"
FIELDS = tuple(f.name for f in dataclasses.fields(FarSkipConfig))

ORIGIN_FAMILY = "family default"
ORIGIN_NATIVE = "FarSkip-native keys of config.json"
ORIGIN_EXPORTED = 'exported config.json ("farskip_jax")'
ORIGIN_OVERRIDE = "override"


def exported_section(hf: dict) -> Optional[dict]:
    """The farskip section saved under config.json's "farskip_jax" key by export_hf, or None.

    Raises CheckpointError when the key is present but is not such a section."""
    if EXPORT_KEY not in hf:
        return None
    sec = hf[EXPORT_KEY]
    if not isinstance(sec, dict):
        raise CheckpointError(f'config.json key "{EXPORT_KEY}" must be a mapping of FarSkip settings '
                              f"({', '.join(FIELDS)}), got {type(sec).__name__}; fix or delete the key")
    unknown = sorted(set(sec) - set(FIELDS))
    if unknown:
        raise CheckpointError(f'config.json "{EXPORT_KEY}" has unknown key(s) {unknown}; expected some of '
                              f"{list(FIELDS)} (written by farskip_jax export); fix or delete them")
    out = {k: v for k, v in sec.items() if v is not None}
    if isinstance(out.get("layers"), list):
        out["layers"] = tuple(int(i) for i in out["layers"])
    return out


def override_keys(overrides: Union[None, Iterable[str], dict]) -> dict:
    """{farskip field: raw value} of the farskip.* overrides ("farskip.preset=x" or {"farskip.preset": x})."""
    items = overrides.items() if isinstance(overrides, dict) else (
        (o.partition("=")[0].strip(), o.partition("=")[2]) for o in (overrides or []))
    out = {}
    for key, value in items:
        if key == "farskip":
            out.update(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else dict(value or {}))
        elif key.startswith("farskip."):
            out[key.split(".", 1)[1]] = value
    return out


def import_connectivity(hf: dict, family_section: Optional[dict],
                        overrides: Union[None, Iterable[str], dict] = None) -> tuple[dict, str]:
    """(farskip section before overrides, origin of the final connectivity) for an HF config.json.

    The caller applies the overrides to the config tree as usual; a preset override drops the
    section's attn_input/moe_input unless those are overridden as well (module docstring)."""
    section = dict(family_section or {})
    origin = ORIGIN_NATIVE if section.get("preset", "standard") != "standard" else ORIGIN_FAMILY
    exported = exported_section(hf)
    if exported is not None:
        section, origin = exported, ORIGIN_EXPORTED
    over = override_keys(overrides)
    if over:
        origin = ORIGIN_OVERRIDE if origin == ORIGIN_FAMILY else f"{ORIGIN_OVERRIDE} over the {origin}"
        if "preset" in over:
            dropped = ["attn_input", "moe_input"]
            if section.get("preset", "standard") == "standard" or not section.get("layers", "all"):
                dropped.append("layers")  # a standard export converts no layers: the new preset's default
            for k in dropped:
                if k not in over:
                    section.pop(k, None)
    return section, origin


def describe(cfg: Config, origin: str) -> str:
    """One line naming the connectivity of cfg and where it came from, e.g.
    `connectivity: farskip on layers [1, 2] (attn partial / moe outdated, skip distance 1); source: ...`."""
    fs = cfg.farskip
    n = cfg.model.num_layers
    changed = [i for i in range(n) if fs.layer_inputs(i, n) != ("full", "full")]
    if not changed:
        what = "standard (every layer reads the full stream)"
    else:
        io = ", ".join(f"attn {a} / moe {m}" for a, m in sorted({fs.layer_inputs(i, n) for i in changed}))
        span = f"all {n} layers" if len(changed) == n else f"layers {changed}"
        what = f"{fs.preset} on {span} ({io}, skip distance {fs.skip_distance})"
    return f"connectivity: {what}; source: {origin}"
