"""The residual streams of FarSkip connectivity (DESIGN.md section 1).

With a_j, s_j, r_j the attention, shared (dense MLP for dense layers) and routed outputs of layer j:

    full       R_k      = R_{k-1} + a_k + s_k + r_k
    no_routed  N_k      = R_k minus r_j of the last d layers          -> attention input `partial`
    no_moe     O_k      = R_k minus s_j + r_j of the last d layers    -> attention input `outdated`

d = `skip_distance` (1 = the paper's FarSkip: partial = R_{k-2} + a_{k-1} + s_{k-1}, outdated =
R_{k-2} + a_{k-1}). The MoE reads R_{k-1} + a_k (`full`) or R_{k-1} (`outdated`). All streams start
as the embedding. Everything is additive (no subtraction), so each stream is exactly the sum named
above; streams nobody reads are dead code that XLA removes (standard connectivity costs nothing).

Connectivity annealing (FCSD, docs/fcsd.md "Conversion methods"): `attn_input(kind, keep)` and
`moe_input(kind, attn_out, keep)` with keep = 1 - alpha (a traced scalar) give the FarSkip stream plus
`keep` times what FarSkip removes from it (partial: the pending routed outputs; outdated: pending
routed + shared; MoE outdated: the layer's own attention output). Still additive, so keep = 0
(alpha = 1) is bitwise the FarSkip stream and keep = 1 (alpha = 0) the full stream up to the order
of the sum. keep=None is the plain FarSkip code path.

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


def add_scaled(x: jax.Array, keep: jax.Array, y: Optional[jax.Array]) -> jax.Array:
    """x + keep * y in x's dtype (keep is cast to y's dtype first): keep == 0 returns x bitwise
    (x + 0 * y == x for finite y), keep == 1 is x + y. y None: x."""
    if y is None:
        return x
    return (x + jnp.asarray(keep).astype(y.dtype) * y).astype(x.dtype)


def sum_present(*ys: Optional[jax.Array]) -> Optional[jax.Array]:
    """The sum of the ys that are not None (None when all are)."""
    present = [y for y in ys if y is not None]
    if not present:
        return None
    return add_present(present[0], *present[1:])


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

    def attn_input(self, kind: str, keep: Optional[jax.Array] = None) -> jax.Array:
        """The stream attention reads: full | partial | outdated. keep (= 1 - alpha, a scalar) adds
        back that fraction of what partial/outdated remove from the full stream (annealing)."""
        if keep is not None and kind in ("partial", "outdated"):
            removed = sum_present(*self.pending_routed) if kind == "partial" else sum_present(
                *self.pending_routed, *self.pending_shared)
            return add_scaled(self.attn_input(kind), keep, removed)
        if kind == "full":
            return self.full
        if kind == "partial":
            return self.no_routed
        if kind == "outdated":
            return self.no_moe
        raise ValueError(f"unknown attention input {kind!r}")

    def moe_input(self, kind: str, attn_out: jax.Array, keep: Optional[jax.Array] = None) -> jax.Array:
        """The stream the MoE/MLP reads: full = R_{k-1} + a_k | outdated = R_{k-1} (+ keep * a_k when
        keep = 1 - alpha is given: annealing)."""
        if keep is not None and kind == "outdated":
            return add_scaled(self.full, keep, attn_out)
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
