"""Flax NNX model: layers, attention, router/experts/MoE, residual streams, transformer."""

from farskip_jax.model.transformer import ModelOutput, Transformer

__all__ = ["Transformer", "ModelOutput"]
