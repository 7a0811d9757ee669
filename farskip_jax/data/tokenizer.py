"""Tokenizers: byte-level (default, no files needed) or an HF `tokenizer.json` (the `tokenizers` library).

Byte-level ids (documented, fixed):
    0..255  the UTF-8 bytes of the text, id == byte value
    256     BOS (begins every document)
    257     EOS (ends every document)
    258     PAD (never a training target; rows are padded only at the end of a finite stream)
so `ByteTokenizer.vocab_size == 259` and a model needs `model.vocab_size >= 259`.
`raw_bytes` (RawByteTokenizer) is the same without special tokens: ids 0..255 only, for byte-level
checkpoints with exactly 256 ids; documents are kept apart by the packer's segment ids alone.

An HF tokenizer keeps its own ids; BOS/EOS are taken from its special tokens when it has them
(`<s>`/`</s>`, `<|begin_of_text|>`/`<|end_of_text|>`, `<|endoftext|>` ...), PAD falls back to EOS.

    tok = load_tokenizer("byte")            # or "raw_bytes", or load_tokenizer("path/to/tokenizer.json")
    ids = tok.encode_document("print(1)\n")  # np.int32 [n + 2]: BOS, tokens..., EOS
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
from tokenizers import decoders, models, pre_tokenizers, Tokenizer, trainers

from farskip_jax.errors import ConfigError, DataError


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus BOS=256, EOS=257, PAD=258."""

    name = "byte"
    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> np.ndarray:
        """text -> int32 [n] (no special tokens)."""
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int32)

    def encode_document(self, text: str) -> np.ndarray:
        """text -> int32 [n + 2] = BOS, bytes..., EOS."""
        ids = np.empty(len(text.encode("utf-8", errors="replace")) + 2, np.int32)
        ids[0], ids[-1] = self.bos_id, self.eos_id
        ids[1:-1] = self.encode(text)
        return ids

    def decode(self, ids) -> str:
        b = bytes(int(i) for i in np.asarray(ids).reshape(-1) if 0 <= int(i) < 256)
        return b.decode("utf-8", errors="replace")


class RawByteTokenizer(ByteTokenizer):
    """UTF-8 bytes as ids 0..255 and nothing else (no BOS/EOS; PAD = 0, never a target)."""

    name = "raw_bytes"
    bos_id = None
    eos_id = None
    pad_id = 0
    vocab_size = 256

    def encode_document(self, text: str) -> np.ndarray:
        """text -> int32 [n]: the bytes alone."""
        return self.encode(text)


_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<｜begin▁of▁sentence｜>")
_EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "<|im_end|>", "<｜end▁of▁sentence｜>")


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from a tokenizer.json file (special tokens not auto-added)."""

    def __init__(self, path: str):
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a plain Exception on malformed files
            raise DataError(f"cannot read tokenizer file {path!r}: {e}") from None
        self.name = os.path.abspath(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._find(_BOS_CANDIDATES)
        self.eos_id = self._find(_EOS_CANDIDATES)
        if self.eos_id is None:
            raise DataError(f"tokenizer {path!r} has none of the end-of-text tokens {list(_EOS_CANDIDATES)}; "
                            "documents could not be separated")
        self.pad_id = self.eos_id

    def _find(self, candidates) -> Optional[int]:
        for c in candidates:
            i = self._tok.token_to_id(c)
            if i is not None:
                return int(i)
        return None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_document(self, text: str) -> np.ndarray:
        body = self.encode(text)
        head = [self.bos_id] if self.bos_id is not None else []
        return np.concatenate([np.asarray(head, np.int32), body, np.asarray([self.eos_id], np.int32)])

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)


def load_tokenizer(spec: str):
    """'byte' -> ByteTokenizer; 'raw_bytes' -> RawByteTokenizer; a path to tokenizer.json (or a folder
    holding one) -> HFTokenizer."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "raw_bytes":
        return RawByteTokenizer()
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise DataError(f"data.tokenizer={spec!r}: no such tokenizer.json; use 'byte', 'raw_bytes' or the path of an HF "
                        "tokenizer.json (or the folder of an HF checkpoint that ships one)")
    return HFTokenizer(path)


def check_vocab(tok, vocab_size: int, model: str) -> None:
    """ConfigError unless every id of `tok` fits a model of `vocab_size` rows (`model` names where that
    model comes from, for the message)."""
    if tok.vocab_size <= vocab_size:
        return
    fix = "give the model's own tokenizer.json as data.tokenizer"
    if isinstance(tok, ByteTokenizer) and vocab_size >= RawByteTokenizer.vocab_size:
        fix = (f"use data.tokenizer=raw_bytes (the {RawByteTokenizer.vocab_size} byte ids without BOS/EOS), or "
               + fix)
    raise ConfigError(f"data.tokenizer={getattr(tok, 'name', tok)!r} produces ids up to {tok.vocab_size - 1} but "
                      f"{model} has model.vocab_size={vocab_size}: {fix}")


def train_bpe(texts, vocab_size: int, out_path: str, *, min_frequency: int = 2) -> "HFTokenizer":
    """Train a byte-level BPE tokenizer (the `tokenizers` library) on an iterable of strings and write
    it to `out_path` (tokenizer.json). Special tokens `<|begin_of_text|>` (BOS, id 0) and
    `<|end_of_text|>` (EOS, id 1), found by HFTokenizer like any HF checkpoint's. Every byte is in the
    initial alphabet, so any text encodes (no unknown token). Give it TRAINING text only: a tokenizer
    fitted on validation documents leaks them. Returns the loaded HFTokenizer."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    if vocab_size < 256 + len(specials) + 1:
        raise ConfigError(f"BPE vocab_size={vocab_size} must exceed the 256 byte tokens plus "
                          f"{len(specials)} special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tok.save(out_path)
    return HFTokenizer(out_path)
