"""Reading an HF checkpoint folder: config.json, single or sharded *.safetensors, tokenizer files.

    ckpt = HFCheckpoint(path)
    ckpt.config            the parsed config.json (dict)
    ckpt.names()           every tensor name of the checkpoint
    ckpt.shape(name)       its shape (from the headers only)
    ckpt.read(name, idx)   a numpy slice of it, memory-mapped (idx: tuple of slices)

Sharded checkpoints are found through `model.safetensors.index.json` (its weight_map); a shard the
index names but the folder lacks raises CheckpointError naming the file. Every JSON file of a folder
(config.json, the index, an import folder's hf_config.json) is read by `read_json`: a file that is
not a JSON object raises CheckpointError naming it and the parser's line / column.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from farskip_jax.loading.safetensors_io import MappedTensor, TensorInfo, read_header
from farskip_jax.errors import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def read_json(path: str, what: str = "config.json") -> dict:
    """The JSON object in `path`; CheckpointError naming the file and the error position otherwise."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path} is not a JSON text file (invalid UTF-8 at byte {e.start}); it should be the "
                              f"{what} of the checkpoint: restore it (re-download or re-export the folder)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos}); "
                              f"fix the file or restore the checkpoint's {what} (re-download or re-export the "
                              "folder)") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a JSON {type(obj).__name__}, not the object a {what} is; restore the "
                              "checkpoint's file (re-download or re-export the folder)")
    return obj


def read_hf_config(folder: str) -> dict:
    """The parsed config.json of an HF checkpoint folder (read_json's errors)."""
    return read_json(os.path.join(folder, "config.json"), "config.json")


class HFCheckpoint:
    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"HF checkpoint folder not found: {self.path}")
        cfg_path = os.path.join(self.path, "config.json")
        if not os.path.isfile(cfg_path):
            raise CheckpointError(f"{self.path} has no config.json; point at a HuggingFace model folder")
        self.config: dict = read_hf_config(self.path)
        self._infos: dict[str, TensorInfo] = {}
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index):
            weight_map = read_json(index, "model.safetensors.index.json").get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no \"weight_map\" object (tensor name -> shard file); restore the "
                                      "checkpoint's index (re-download the folder)")
            shards = sorted(set(weight_map.values()))
            missing = [s for s in shards if not os.path.isfile(os.path.join(self.path, s))]
            if missing:
                raise CheckpointError(
                    f"{self.path}: shard file(s) {missing} listed in model.safetensors.index.json are missing; "
                    "download the complete checkpoint")
            for s in shards:
                infos = read_header(os.path.join(self.path, s))
                for name, file in weight_map.items():
                    if file == s:
                        if name not in infos:
                            raise CheckpointError(f"{s} lacks tensor {name!r} that the index assigns to it")
                        self._infos[name] = infos[name]
        else:
            files = sorted(glob.glob(os.path.join(self.path, "*.safetensors")))
            if not files:
                raise CheckpointError(f"{self.path} holds no *.safetensors files (PyTorch .bin checkpoints are not read)")
            for fpath in files:
                self._infos.update(read_header(fpath))

    def names(self) -> list[str]:
        return sorted(self._infos)

    def has(self, name: str) -> bool:
        return name in self._infos

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

    def dtype(self, name: str) -> np.dtype:
        return self._info(name).dtype

    def _info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the checkpoint") from None

    def read(self, name: str, idx=None) -> np.ndarray:
        """The tensor (or the slice idx of it) as numpy, in its stored dtype."""
        t = MappedTensor(self._info(name))
        return t[tuple(idx) if idx is not None else ...]

    def view(self, prefix: str, config: dict) -> "HFCheckpoint":
        """The tensors under `prefix` (renamed without it) with `config` as config.json: the text model
        of a multimodal checkpoint. Tensors outside the prefix (vision tower, projector) are dropped."""
        sub = object.__new__(HFCheckpoint)
        sub.path, sub.config = self.path, config
        sub._infos = {n[len(prefix):]: i for n, i in self._infos.items() if n.startswith(prefix)}
        return sub

    def extra_files(self) -> list[str]:
        """Tokenizer/generation files present in the folder (copied along on import)."""
        return [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(self.path, f))]
