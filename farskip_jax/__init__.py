"""farskip_jax: FarSkip-Collective MoE transformers in JAX/Flax NNX.

Layout and layer order: docs/design.md section 3 (config.py, kernels/, model/, losses/, parallel/,
loading/, data/, train/, eval/, convert/, fcsd/, serving/, analysis/, experiments/).
"""

__version__ = "0.1.0"

from farskip_jax.quiet_start import quiet_jax_start as _quiet_jax_start

_quiet_jax_start()  # no CUDA-plugin noise on machines without a GPU (farskip_jax/quiet_start.py)
