"""FCSD's local reconstruction term (`distill.local_weight`): teacher-forced sub-block matching.

Converting to FarSkip changes what each sub-block reads (attention: no routed output of the layer
before; MoE: no attention output of its own layer). The end-to-end KL sees that change only through
the whole network, where the errors of early layers compound into the inputs of later ones. This
term gives every converted sub-block its own target instead: run each student layer on the FarSkip
inputs built from the TEACHER's outputs of the layers before it (`Transformer.teacher_forced`), and
ask its outputs to equal the teacher's outputs of that layer:

    local = mean over sub-blocks j of  sum_tokens ||o_j^s - o_j^t||^2 / sum_tokens ||o_j^t||^2

with o = the attention output a_k and the MLP/MoE output shared_k + routed_k of every layer k (the
relative squared error, so every sub-block counts the same whatever its scale), masked tokens only.
On an unconverted layer the inputs are the teacher's own, so its term is 0 until its weights move.
It is the layer-wise reconstruction that post-training quantisation uses to recover with little
data, applied to a connectivity change; the KL term still trains the network end to end.

    t_out = teacher(tokens, ..., farskip=STANDARD, return_trace=True)
    trace = trace_arrays(t_out.trace, compute_dtype)
    outs = student.teacher_forced(trace, positions, segment_ids, farskip=cfg.farskip)
    loss += local_weight * local_reconstruction(trace, outs, mask)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from farskip_jax.model.connectivity import sum_present


def trace_arrays(trace: tuple, dtype) -> tuple:
    """The teacher's per-layer trace as constants for the student: the arrays attn_in, attn, shared,
    routed (None kept) in `dtype` (the student's compute dtype), gradients stopped; names dropped."""
    keep = ("attn_in", "attn", "shared", "routed")
    return tuple({k: None if t[k] is None else jax.lax.stop_gradient(t[k].astype(dtype)) for k in keep}
                 for t in trace)


def _rel_sq_err(s: jax.Array, t: jax.Array, m: jax.Array) -> jax.Array:
    """sum over masked tokens of ||s - t||^2 / sum of ||t||^2 (t, s: [b, s, d]; m: [b, s]); []."""
    s, t = s.astype(jnp.float32), jax.lax.stop_gradient(t.astype(jnp.float32))
    err = jnp.sum(jnp.sum(jnp.square(s - t), -1) * m)
    ref = jnp.sum(jnp.sum(jnp.square(t), -1) * m)
    return err / jnp.maximum(ref, 1e-20)


def local_reconstruction(t_trace: tuple, s_outs: list, mask: jax.Array) -> jax.Array:
    """Mean relative squared error of the student's teacher-forced sub-block outputs (`s_outs`, per layer
    a BlockOutput) against the teacher's (`t_trace`, per layer dict attn / shared / routed) over the
    masked tokens ([b, s]); []. Gradients reach the student only."""
    m = mask.astype(jnp.float32)
    terms = []
    for t, s in zip(t_trace, s_outs):
        terms.append(_rel_sq_err(s.attn, t["attn"], m))
        t_mlp, s_mlp = sum_present(t["shared"], t["routed"]), sum_present(s.shared, s.routed)
        if t_mlp is not None:
            terms.append(_rel_sq_err(s_mlp, t_mlp, m))
    return jnp.mean(jnp.stack(terms))
