"""farskip_jax: FarSkip-Collective MoE transformers in JAX/Flax NNX.

Layout (DESIGN.md section 3): config.py (typed configs), model/ (NNX modules and the two residual
streams), parallel/ (mesh, sharding, expert-parallel collectives, XLA flags), convert/ (HF import and
export), data/, train/, eval/, analysis/.
"""

__version__ = "0.1.0"

from farskip_jax.quiet_start import quiet_jax_start as _quiet_jax_start

_quiet_jax_start()  # no CUDA-plugin noise on machines without a GPU (farskip_jax/quiet_start.py)
