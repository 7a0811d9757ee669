"""The residual streams of FarSkip connectivity (docs/design.md section 1): the one place that says which
stream a sub-block reads and how the streams are summed.

With a_j, s_j, r_j the attention, shared (dense MLP for dense layers) and routed outputs of layer j:

    full       R_k      = R_{k-1} + a_k + s_k + r_k
    no_routed  N_k      = R_k minus r_j of the last d layers          -> attention input `partial`
    no_moe     O_k      = R_k minus s_j + r_j of the last d layers    -> attention input `outdated`

d = `skip_distance` (1 = the paper's FarSkip: partial = R_{k-2} + a_{k-1} + s_{k-1}, outdated =
R_{k-2} + a_{k-1}). The MoE reads R_{k-1} + a_k (`full`) or R_{k-1} (`outdated`): model/block.py `Block.layer`. All
streams start as the embedding. Everything is additive (no subtraction), so each stream is exactly
the sum named above; streams nobody reads are dead code that XLA removes (standard connectivity
costs nothing).

Summation order (d = 1) is the FarSkip-native layout's (Instella-MoE): t = R_{k-1} + a_k;
N_k = t + s_k; R_k = t + (s_k + r_k) (= t + (r_k + s_k) bitwise: one add commutes); O_k = t. So a model exported in that layout and run by it
matches this one to rounding of the same sums. d > 1 keeps running sums: N_k = N_{k-1} + r_{k-d}
+ a_k + s_k, O_k = O_{k-1} + s_{k-d} + r_{k-d} + a_k.

`Streams.pruned(kinds)` replaces the streams that no attention of `kinds` reads by scalar zeros (a
scan carry then holds, and XLA copies, only live streams); `Streams.padded()` is the fixed-shape form a `jax.lax.scan` carries (model/layer_loop.py): the
pending tuples hold exactly d arrays, zeros where a layer had no routed/shared output or where fewer
than d layers have run. Adding a zero is exact (x + 0 == x), so it computes the same sums.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from farskip_jax.connectivity.layer_sets import ATTN_KINDS


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
        for missing outputs, oldest first): a pytree of fixed structure for a scan carry. d = 1 keeps
        no pending outputs (its streams are sums of the full stream and the layer's own outputs)."""
        if self.distance == 1:
            return self
        zero = jnp.zeros_like(self.full)

        def fill(xs: tuple) -> tuple:
            xs = tuple(zero if x is None else x for x in xs)
            return (zero,) * (self.distance - len(xs)) + xs

        return self.replace(pending_routed=fill(self.pending_routed), pending_shared=fill(self.pending_shared))

    def pruned(self, attn_kinds) -> "Streams":
        """These streams with the ones no attention input of `attn_kinds` (the kinds of every layer still
        to run) reads replaced by scalar zeros: the MoE reads `full` only, `partial` reads no_routed,
        `outdated` no_moe; pending routed outputs feed both, pending shared outputs no_moe only."""
        partial, outdated = "partial" in attn_kinds, "outdated" in attn_kinds
        live = dict(no_routed=partial, no_moe=outdated, pending_routed=partial or outdated, pending_shared=outdated)
        zero = jnp.zeros((), self.full.dtype)
        out = {}
        for name, keep in live.items():
            v = getattr(self, name)
            if not keep and not (isinstance(v, tuple) and not v):
                out[name] = tuple(zero for _ in v) if isinstance(v, tuple) else zero
        return self.replace(**out) if out else self

    def attn_input(self, kind: str) -> jax.Array:
        """The stream attention reads: full | partial | outdated."""
        if kind == "full":
            return self.full
        if kind == "partial":
            return self.no_routed
        if kind == "outdated":
            return self.no_moe
        raise ValueError(f"unknown attention input {kind!r}; expected one of {ATTN_KINDS}")

    def update(self, attn: jax.Array, shared: Optional[jax.Array], routed: Optional[jax.Array]) -> "Streams":
        """The streams after a layer with outputs a (attn), s (shared or dense MLP; None without shared
        experts) and r (routed; None on dense layers)."""
        if self.distance == 1:  # the native order: N = (R + a) + s, R' = (R + a) + (s + r), O = R + a
            moe_out = shared if routed is None else (routed if shared is None else shared + routed)
            t = self.full + attn
            return Streams(full=add_present(t, moe_out), no_routed=add_present(t, shared), no_moe=t, distance=1)
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
