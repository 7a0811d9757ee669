"""Compiled-schedule analysis: is the all-to-all time hidden under compute? (docs/overlap.md)

    deviceless.py  compile for a GPU topology without a GPU; XLA's latency-hiding schedule dump
    hlo.py         that dump as a graph of ops with modelled start/end times; textproto.py reads it
    scopes.py      layer / named scope / fwd-bwd of an op from its metadata
    report.py      per-all-to-all hidden time, totals, side-by-side table
    bound.py       structural upper bound (max-flow of independent compute into collectives)
    cost_model.py  two-stream re-timing for MI300X / MI325X (hardware XLA has no spec for)
    topology.py    collective times on several nodes: intra-node links + per-GPU NICs
    sensitivity.py the step speedup vs all-to-all bandwidth (two-stream model), paper-implied bandwidth
    programs.py    the real model's forward / train step as abstract programs
    timeline.py    one layer's compute and all-to-all streams, standard above farskip
    overlap.py     `python -m farskip_jax.analysis.overlap` (the report)
    conversion_plan.py  `python -m farskip_jax.analysis.conversion_plan` (farskip.layers: auto, planned
                   without training, and the overlap the choice buys)
"""
