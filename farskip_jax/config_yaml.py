"""YAML config files -> Config: `base:` inheritance, dotted command-line overrides, the kernels'
environment overrides, and the checks of what a new run asks (config.py holds the sections).

    cfg = load_config("configs/tiny.yaml", ["train.steps=50", "runtime.remat=full"])
"""

from __future__ import annotations

import os
from typing import Optional

import yaml

from farskip_jax.config import MOVED_KEYS, Config, from_dict, kernels_env_overrides, migrate_tree, note_moved
from farskip_jax.errors import ConfigError


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
    if t.warmup_steps > t.steps:
        raise ConfigError(
           f"train.warmup_steps={t.warmup_steps} is longer than the run (train.steps={t.steps}): the learning rate "
           f"would never reach train.lr on the schedule asked for; set train.warmup_steps <= {t.steps} "
           f"(e.g. train.warmup_steps={t.steps // 10} for a short run)")
    return cfg
