"""YAML config files -> config trees (plain dicts): `base:` inheritance, dotted `section.key=value`
overrides, and old key names moved to their place (MOVED_KEYS). config.load_config builds the Config.

    tree = apply_overrides(load_yaml_tree("configs/tiny.yaml"), ["runtime.remat=full"])
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import yaml

from farskip_jax.errors import ConfigError

# runtime keys that lived in model: / moe: before the split -> where they live now
MOVED_KEYS = {f"{sec}.{k}": f"runtime.{k}" for sec, keys in (
    ("model", ("param_dtype", "compute_dtype", "remat", "scan_layers", "micro_batches", "attention_impl",
               "attention_block")),
    ("moe", ("num_groups", "dispatch", "gpus_per_node", "gmm", "gmm_tile", "capacity_factor", "foe_tokens",
             "foe_attention", "foe_sum_dtype", "aux_loss_weight", "z_loss_weight", "bias_update_rate"))) for k in keys}
_NOTED: set = set()


def migrate_tree(tree: dict, origin: str = "config") -> dict:
    """`tree` (a config mapping) with each MOVED_KEYS key at its new place (note_moved); ConfigError when
    the old and the new key hold different values."""
    if not isinstance(tree, dict):
        return tree
    tree, moved = dict(tree), []
    for old, new in MOVED_KEYS.items():
        sec, key = old.split(".")
        if isinstance(tree.get(sec), dict) and key in tree[sec]:
            tree[sec] = dict(tree[sec])
            value, rt = tree[sec].pop(key), dict(tree.get("runtime") or {})
            if rt.get(key, value) != value:
                raise ConfigError(f"{origin}: {old}={value!r} and {new}={rt.get(key)!r} both set {new} ({old} is its "
                                  f"old name); keep only {new}")
            tree["runtime"] = {**rt, key: value}
            moved.append(f"{old} -> {new}")
    note_moved(moved, origin)
    return tree


def note_moved(moved: list[str], origin: str) -> None:
    """One note on stderr naming the old keys `origin` used (["old -> new", ...]); once per process."""
    if moved and not _NOTED:
        _NOTED.update(moved)
        print(f"note: {origin} uses old key names, read at their new place ({', '.join(moved)}); "
              "docs/config.md lists every key's section", file=sys.stderr)


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _duplicate_keys(node, path: str = "") -> Optional[tuple[str, int, int]]:
    """(dotted key, first line, second line) of the first key that a mapping of the composed YAML
    `node` holds twice (1-based lines), else None. YAML merge keys (`<<`) are left to the loader."""
    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            full = f"{path}.{key}" if path else str(key)
            if key is not None and key != "<<":
                if key in seen:
                    return full, seen[key], key_node.start_mark.line + 1
                seen[key] = key_node.start_mark.line + 1
            found = _duplicate_keys(value_node, full)
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found = _duplicate_keys(item, f"{path}[{i}]")
            if found:
                return found
    return None


def read_yaml_mapping(path: str) -> dict:
    """The mapping one YAML config file holds. ConfigError (naming the file and the fix) when the path
    is a folder or missing, the text is not YAML, holds no settings, is not a mapping, or sets one key
    twice (YAML would keep the last silently; `base:` files and command-line overrides are the ways
    to change a value)."""
    if os.path.isdir(path):
        raise ConfigError(f"config {path} is a folder; pass a YAML file such as configs/tiny.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not a YAML text file (invalid UTF-8 at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror or e}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if data is None:
        raise ConfigError(f"{path} holds no settings (empty or only comments); a config needs at least "
                          "`base: tiny.yaml` or one section, e.g. `train: {steps: 100}`")
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping at the top level (section: {{key: value}}), "
                          f"got a {type(data).__name__}")
    dup = _duplicate_keys(node)
    if dup:
        key, first, second = dup
        raise ConfigError(f"{path}: key {key!r} is set twice (lines {first} and {second}); YAML would keep only the "
                          f"second silently. Keep one (merge the two into one entry); a `base:` file or a "
                          "command-line override (section.key=value) is the way to change a value")
    return data


def load_yaml_tree(path: str, _seen: tuple[str, ...] = ()) -> dict:
    """Read a YAML config and merge it over its `base:` chain (paths relative to each file)."""
    path = os.path.abspath(path)
    if path in _seen:
        raise ConfigError(f"config inheritance cycle: {' -> '.join(_seen + (path,))}")
    data = migrate_tree(read_yaml_mapping(path), path)
    base = data.pop("base", None)
    if base is not None:
        bases = base if isinstance(base, list) else [base]
        if not bases or not all(isinstance(b, str) and b.strip() for b in bases):
            raise ConfigError(f"{path}: base={base!r} must name a YAML file (a path relative to this file) or a list "
                              "of them, e.g. `base: tiny.yaml`")
        merged: dict = {}
        for b in bases:
            b = os.path.expanduser(b)
            bpath = b if os.path.isabs(b) else os.path.join(os.path.dirname(path), b)
            if not os.path.isfile(bpath):  # name the file whose `base:` points nowhere
                what = "is a folder" if os.path.isdir(bpath) else "does not exist"
                raise ConfigError(f"{path}: base: {b} {what} ({bpath}); name a YAML file, relative to this file")
            merged = _deep_merge(merged, load_yaml_tree(bpath, _seen + (path,)))
        data = _deep_merge(merged, data)
    return data


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict."""
    tree = dict(tree)
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} must look like section.key=value (e.g. model.num_layers=4)")
        key, _, raw = ov.partition("=")
        if key.strip() in MOVED_KEYS:
            note_moved([f"{key.strip()} -> {MOVED_KEYS[key.strip()]}"], f"override {ov!r}")
            key = MOVED_KEYS[key.strip()]
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        parts = key.strip().split(".")
        node = tree
        for p in parts[:-1]:
            child = node.get(p)
            child = dict(child) if isinstance(child, dict) else {}
            node[p] = child
            node = child
        node[parts[-1]] = value
    return tree
