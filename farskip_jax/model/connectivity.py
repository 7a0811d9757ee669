"""The residual streams of FarSkip connectivity (DESIGN.md section 1).

With a_j, s_j, r_j the attention, shared (dense MLP for dense layers) and routed outputs of layer j:

    full       R_k      = R_{k-1} + a_k + s_k + r_k
    no_routed  N_k      = R_k minus r_j of the last d layers          -> attention input `partial`
    no_moe     O_k      = R_k minus s_j + r_j of the last d layers    -> attention input `outdated`

d = `skip_distance` (1 = the paper's FarSkip: partial = R_{k-2} + a_{k-1} + s_{k-1}, outdated =
R_{k-2} + a_{k-1}). The MoE reads R_{k-1} + a_k (`full`) or R_{k-1} (`outdated`). All streams start
as the embedding. Everything is additive (no subtraction), so each stream is exactly the sum named
above; streams nobody reads are dead code that XLA removes (standard connectivity costs nothing).

`Streams.padded()` is the fixed-shape form a `jax.lax.scan` carries (model/transformer.py): the
pending tuples hold exactly d arrays, zeros where a layer had no routed/shared output or where
fewer than d layers have run. Adding a zero is exact (x + 0 == x), so it computes the same sums.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct


def add_present(x: jax.Array, *ys: Optional[jax.Array]) -> jax.Array:
    """x + every y that is not None."""
    for y in ys:
        if y is not None:
            x = x + y
    return x


@struct.dataclass
class Streams:
    full: jax.Array
    no_routed: jax.Array
    no_moe: jax.Array
    pending_routed: tuple = ()  # routed outputs of the last <= d layers, oldest first
    pending_shared: tuple = ()
    distance: int = struct.field(pytree_node=False, default=1)

    @classmethod
    def init(cls, h: jax.Array, distance: int = 1) -> "Streams":
        return cls(full=h, no_routed=h, no_moe=h, distance=distance)

    def padded(self) -> "Streams":
        """The same streams with pending_routed / pending_shared of exactly `distance` arrays (zeros
        for missing outputs, oldest first): a pytree of fixed structure for a scan carry."""
        zero = jnp.zeros_like(self.full)

        def fill(xs: tuple) -> tuple:
            xs = tuple(zero if x is None else x for x in xs)
            return (zero,) * (self.distance - len(xs)) + xs

        return self.replace(pending_routed=fill(self.pending_routed), pending_shared=fill(self.pending_shared))

    def attn_input(self, kind: str) -> jax.Array:
        """The stream attention reads: full | partial | outdated."""
        if kind == "full":
            return self.full
        if kind == "partial":
            return self.no_routed
        if kind == "outdated":
            return self.no_moe
        raise ValueError(f"unknown attention input {kind!r}")

    def moe_input(self, kind: str, attn_out: jax.Array) -> jax.Array:
        """The stream the MoE/MLP reads: full = R_{k-1} + a_k | outdated = R_{k-1}."""
        if kind == "full":
            return self.full + attn_out
        if kind == "outdated":
            return self.full
        raise ValueError(f"unknown moe input {kind!r}")

    def update(self, attn: jax.Array, shared: Optional[jax.Array], routed: Optional[jax.Array]) -> "Streams":
        pr, ps = list(self.pending_routed), list(self.pending_shared)
        no_routed, no_moe = self.no_routed, self.no_moe
        if len(pr) == self.distance:
            r_old, s_old = pr.pop(0), ps.pop(0)
            no_routed = add_present(no_routed, r_old)
            no_moe = add_present(no_moe, s_old, r_old)
        moe_out = shared if routed is None else (routed if shared is None else shared + routed)
        full = add_present(self.full + attn, moe_out)
        pr.append(routed)
        ps.append(shared)
        return Streams(full=full, no_routed=add_present(no_routed + attn, shared), no_moe=no_moe + attn,
                       pending_routed=tuple(pr), pending_shared=tuple(ps), distance=self.distance)
