"""The farskip section read: presets -> stream kinds, the `farskip.layers` forms ('all', 'none',
'first:N', 'last:N', 'range:A:B', a list) -> the set of converted layers, and each layer's
(attn_input, moe_input): which stream the layer body reads (`Streams.attn_input`; model/block.py `Block.layer`).

Plain Python (no JAX): config validation and the XLA flags chosen before JAX starts read it.

    parse_layer_spec("last:2", 4) == frozenset({2, 3})
    layer_inputs(FarSkipConfig(preset="farskip", layers="last:2"), 3, 4) == ("partial", "outdated")
"""

from __future__ import annotations

from typing import Optional

from farskip_jax.errors import ConfigError, did_you_mean


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


ATTN_KINDS = ("full", "partial", "outdated")  # the streams attention may read (streams.py)
MOE_KINDS = ("full", "outdated")  # the streams the MoE / dense MLP may read
PRESETS: dict[str, tuple[str, str]] = {
    # preset -> (attn_input, moe_input) on converted layers (docs/design.md section 1)
    "standard": ("full", "full"),
    "farskip": ("partial", "outdated"),
    "attn_only": ("partial", "full"),
    "mlp_only": ("full", "outdated"),
}


def check_farskip_section(fs) -> None:
    """ConfigError unless the farskip section `fs` names a preset and a layer set of valid syntax (the
    bounds need the model: check_converted_layers), and `auto` has something to convert."""
    _check(fs.preset in PRESETS, f"farskip.preset={fs.preset!r} is unknown; choose one of {sorted(PRESETS)}"
           + did_you_mean(fs.preset, PRESETS))
    if isinstance(fs.layers, str) and fs.layers != "auto":
        parse_layer_spec(fs.layers, None)
    _check(fs.layers != "auto" or fs.preset != "standard",
           "farskip.layers: auto chooses which layers to convert, but farskip.preset is standard (nothing to "
           "convert); set farskip.preset: farskip (or attn_only / mlp_only)")


def converted_layers(fs, num_layers: int) -> frozenset[int]:
    """The layers the farskip section `fs` converts on a num_layers model (no bounds check)."""
    return parse_layer_spec(fs.layers, num_layers) if isinstance(fs.layers, str) else frozenset(fs.layers)


def layer_inputs(fs, i: int, num_layers: int) -> tuple[str, str]:
    """(attn_input, moe_input) of layer i under the farskip section `fs`."""
    if i not in converted_layers(fs, num_layers):
        return ("full", "full")
    attn, moe = PRESETS[fs.preset]
    return (fs.attn_input or attn, fs.moe_input or moe)


def check_converted_layers(fs, num_layers: int) -> frozenset[int]:
    """The converted layers of the farskip section `fs` (config.FarSkipConfig) on a num_layers model;
    ConfigError when a spec or list leaves the model's layers, or when the set is empty while the preset
    (or attn_input / moe_input) converts: such a run would be the standard model under a FarSkip banner. An empty set ('none', []) is
    meaningful only with farskip.preset: standard, which converts nothing anyway."""
    if isinstance(fs.layers, str):
        conv = parse_layer_spec(fs.layers, num_layers)
    else:
        conv = frozenset(fs.layers)
        bad = sorted(i for i in conv if not 0 <= i < num_layers)
        _check(not bad, f"farskip.layers lists layers outside [0, {num_layers}): {bad} (model.num_layers={num_layers}); "
                        "valid forms: " + layer_spec_forms(num_layers))
    converting = fs.preset != "standard" or fs.attn_input not in (None, "full") or fs.moe_input not in (None, "full")
    _check(conv or not converting,
           f"farskip.layers={fs.layers if isinstance(fs.layers, str) else list(fs.layers)!r} converts none of the "
           f"{num_layers} layers, so farskip.preset={fs.preset!r} would run the standard model; set farskip.layers to "
           f"the layers to convert (valid forms: {layer_spec_forms(num_layers)}) or farskip.preset: standard")
    return conv


def layer_spec_forms(num_layers: Optional[int] = None) -> str:
    """The valid forms of farskip.layers (for error messages), with the bounds of a num_layers model."""
    n = "L" if num_layers is None else str(num_layers)
    return (f"'all', 'first:N' or 'last:N' with 1 <= N <= {n}, 'range:A:B' with 0 <= A < B <= {n} (B exclusive), "
            f"a list of layer indices in [0, {n}), or 'none' (no converted layer: only with farskip.preset: standard)")


def parse_layer_spec(spec: str, num_layers: Optional[int]) -> frozenset[int]:
    """'all' | 'none' | 'first:N' | 'last:N' | 'range:A:B' -> set of layer indices ('auto' is not a
    set: it is resolved to one before any model sees it, fcsd/distill.resolve_auto_layers).

    Nothing is clamped: N must be in [0, num_layers], A <= B within [0, num_layers], else ConfigError
    naming the spec, the layer count and the valid forms. first:0, last:0 and range:A:A are exact
    empty sets (a sweep's zero point); Config refuses an empty set under a converting preset.
    num_layers=None checks the syntax only (FarSkipConfig; Config checks the bounds against the model)."""
    s = spec.strip()
    if s == "auto":
        raise ConfigError(
            "farskip.layers=auto has not been resolved to a layer set: FCSD (train.mode: distill) chooses it at the "
            "start of the run, and `python -m farskip_jax.analysis.conversion_plan` plans it without training; elsewhere set an "
            "explicit set (a run's choice is in <run_dir>/farskip_auto.json and its config.yaml)")
    bounds = None
    try:
        if s == "all":
            return frozenset(range(num_layers or 0))
        if s == "none":
            return frozenset()
        kind, _, rest = s.partition(":")
        if kind in ("first", "last"):
            n = int(rest)
            if num_layers is None:
                return frozenset()  # syntax only: bounds need the model
            if not 0 <= n <= num_layers:
                bounds = f"N={n} is outside [0, {num_layers}]"
            else:
                return frozenset(range(n)) if kind == "first" else frozenset(range(num_layers - n, num_layers))
        elif kind == "range":
            a, b = (int(v) for v in rest.split(":"))
            if num_layers is None:
                return frozenset()
            if not 0 <= a <= b <= num_layers:
                bounds = f"A={a}, B={b} do not satisfy 0 <= A <= B <= {num_layers}"
            else:
                return frozenset(range(a, b))
    except ValueError:
        pass
    if bounds is not None:
        raise ConfigError(f"farskip.layers={spec!r} does not fit the model's {num_layers} layers (model.num_layers="
                          f"{num_layers}): {bounds}; valid forms: "
                          + layer_spec_forms(num_layers))
    raise ConfigError(f"farskip.layers={spec!r} is not a layer set; use 'all', 'none', 'first:N', 'last:N', "
                      "'range:A:B' or a list of layer indices like [1, 2, 5]")
