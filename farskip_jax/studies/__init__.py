"""Studies: the modelled comparisons (compare_overlap, compare_serving, multinode_scaling,
inference_overlap, overlap_levers, foe_compare), the FCSD experiments (fcsd_*, hardness_curve,
hard_corpus) and the one-GPU device check, each a module run as `python -m farskip_jax.studies.NAME`,
built on one harness (harness.py: compile cache, result store, grid, tables, figures). Nothing else
in the package imports them; their recorded results live in the repository's benchmarks/results/.
"""
