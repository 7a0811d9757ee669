"""Losses computed from the final-normed stream and the unembedding, a chunk of positions at a time
(losses/chunked.py), so the full [batch, seq, vocab] f32 logits never exist at once."""

from farskip_jax.losses.chunked import chunked_ce, chunked_fcsd

__all__ = ["chunked_ce", "chunked_fcsd"]
