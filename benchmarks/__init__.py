"""Micro-benchmarks: each module measures two or more variants side by side in one process and
prints their ratios; run one from the repository root as `python -m benchmarks.NAME` (--help lists
its options). The studies (modelled comparisons, multi-node, serving, FCSD experiments) are
farskip_jax.studies; results/ holds the recorded figures the docs cite."""
