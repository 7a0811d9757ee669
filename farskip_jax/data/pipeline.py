"""grain pipelines: documents -> shuffled, packed [batch, seq] rows with document boundaries kept.

    it = make_iterator(cfg, "train", batch_size=16, seq_len=128, seed=0)
    batch = next(it)          # dict of np.ndarray [local_batch, seq_len]:
      tokens       int32  input ids
      targets      int32  next-token ids (the token after `tokens[i]` in the same document)
      positions    int32  position of the token inside its document (RoPE; causal mask)
      segment_ids  int32  1, 2, ... per document piece inside a row; 0 = padding
      loss_mask    float32 1 where `targets` is a real next token, 0 on padding
    state = it.get_state(); ...; it.set_state(state)   # checkpointable (JSON-able dict)

Packing is grain's concat-then-split: documents [BOS ... EOS] are concatenated and cut into rows of
seq_len; a document cut at a row end continues in the next row with its positions continuing; the
model masks attention with segment_ids, so attention never crosses documents.

Prefetch (`data.prefetch` = N > 0, training split): a background thread keeps N batches ready, so
host data work overlaps device compute (XLA releases the GIL while it runs); the trainer records
the time each step waited for its batch (`data_wait_s`).

Sharding over processes (`data.shard_by`):
  rows  every process packs the same global stream and keeps its own rows of each global batch, so a
        run on P processes sees exactly the batches of a 1-process run (reading cost x P);
  docs  each process reads a disjoint 1/P of the (shuffled) documents (scales to large corpora).
The order is a deterministic function of `seed` (grain index shuffle, new permutation every epoch).
"""

from __future__ import annotations

from typing import Optional

import grain
import grain.experimental as gx
import numpy as np

from farskip_jax.config import DataConfig
from farskip_jax.data.sources import build_source
from farskip_jax.data.tokenizer import load_tokenizer
from farskip_jax.errors import DataError


def _to_pairs(doc: np.ndarray) -> dict:
    """[BOS, t1, ..., EOS] -> inputs [n-1] and next-token targets [n-1]."""
    doc = np.asarray(doc, np.int32)
    return {"inputs": doc[:-1], "targets": doc[1:]}


def _format(row: dict) -> dict:
    seg = row["inputs_segment_ids"].astype(np.int32)
    return {
        "tokens": row["inputs"].astype(np.int32),
        "targets": row["targets"].astype(np.int32),
        "positions": row["inputs_positions"].astype(np.int32),
        "segment_ids": seg,
        "loss_mask": (seg > 0).astype(np.float32),
    }


def packed_rows(source, seq_len: int, *, seed: Optional[int], repeat: bool,
                shard: tuple[int, int] = (0, 1)) -> grain.IterDataset:
    """grain IterDataset of packed single rows (dicts of [seq_len] arrays) from a document source."""
    ds = grain.MapDataset.source(source)
    if seed is not None:
        ds = ds.shuffle(seed=seed)
    if repeat:
        ds = ds.repeat(None)
    idx, count = shard
    if count > 1:
        ds = ds[idx::count]
    ds = ds.map(_to_pairs).filter(lambda e: e["inputs"].shape[0] > 0)
    ids = ds.to_iter_dataset()
    ids = gx.ConcatThenSplitIterDataset(ids, length_struct={"inputs": seq_len, "targets": seq_len})
    return ids.map(_format)


class _TakeRows:
    """Keep rows [start, start + n) of each batch (per-process slice of a global batch)."""

    def __init__(self, start: int, n: int):
        self.start, self.n = start, n

    def __call__(self, batch: dict) -> dict:
        return {k: v[self.start:self.start + self.n] for k, v in batch.items()}


class _CheckIds:
    """DataError when a batch holds a token id outside [0, vocab_size) (a model would read garbage rows
    of its embedding, or NaN): names the data source and the fix."""

    def __init__(self, vocab_size: int, where: str):
        self.vocab_size, self.where = vocab_size, where

    def __call__(self, batch: dict) -> dict:
        for key in ("tokens", "targets"):
            ids = batch[key]
            bad = (ids < 0) | (ids >= self.vocab_size)
            if bad.any():
                raise DataError(f"{self.where} holds token id {int(ids[bad].flat[0])} (in {key!r}), outside the "
                                f"model's vocabulary [0, {self.vocab_size}): re-tokenize the data with the model's "
                                "tokenizer (python -m farskip_jax.data.prepare --tokenizer ...) or use a model whose "
                                "vocab_size covers it")
        return batch


def make_dataset(cfg: DataConfig, split: str, *, batch_size: int, seq_len: int, seed: int,
                 process_index: int = 0, process_count: int = 1, tokenizer=None,
                 vocab_size: Optional[int] = None, report=None) -> grain.IterDataset:
    """Batched grain IterDataset for `split`; `batch_size` is the GLOBAL batch (rows over all processes).

    Train: shuffled by `seed`, repeated forever. Val: file order, repeated (the evaluator takes the
    first `eval_batches` batches of a fresh iterator, so the validation set is fixed).
    vocab_size: every batch is checked to hold ids below it (DataError naming the source otherwise).
    report: gets the line counting records left out by data.skip_bad_records (data/records.py).
    """
    if batch_size % process_count:
        raise DataError(f"global batch {batch_size} is not divisible by the {process_count} processes")
    tok = tokenizer or load_tokenizer(cfg.tokenizer)
    source = build_source(cfg, split, tok, vocab_size=vocab_size, report=report)
    local = batch_size // process_count
    shuffle_seed = seed if (split == "train" and cfg.shuffle) else None
    if cfg.shard_by == "docs" and process_count > 1:
        rows = packed_rows(source, seq_len, seed=shuffle_seed, repeat=True, shard=(process_index, process_count))
        ds = rows.batch(local, drop_remainder=True)
    else:
        rows = packed_rows(source, seq_len, seed=shuffle_seed, repeat=True)
        ds = rows.batch(batch_size, drop_remainder=True)
        if process_count > 1:
            ds = ds.map(_TakeRows(process_index * local, local))
    if vocab_size is not None:
        ds = ds.map(_CheckIds(vocab_size, f"the {split!r} split of data.source={cfg.source!r} ({source!r})"))
    if split == "train" and cfg.prefetch > 0:
        # a background thread packs the next batches while the device computes (the iterator's state
        # is that of the batches handed out, so checkpoints resume exactly as without it)
        ds = gx.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cfg.prefetch)
    return ds


def make_iterator(cfg: DataConfig, split: str, **kw) -> grain.DatasetIterator:
    """`iter(make_dataset(...))`: a grain iterator with get_state()/set_state()."""
    return iter(make_dataset(cfg, split, **kw))


def first_batches(*datasets: grain.IterDataset) -> list[dict]:
    """The first batch of each dataset (fresh iterators, nothing consumed): empty or unreadable data and
    out-of-vocabulary ids fail here, before a run writes anything."""
    out = []
    for ds in datasets:
        it = iter(ds)
        try:
            out.append(next(it))
        except StopIteration:
            raise DataError("the data yields no full batch: add documents, or lower train.batch_size / "
                            "train.seq_len") from None
        finally:
            close_iterator(it)
    return out


def close_iterator(it) -> None:
    """Stop a grain iterator's prefetch thread (a no-op for iterators without one)."""
    close = getattr(it, "close", None)
    if close is not None:
        close()
