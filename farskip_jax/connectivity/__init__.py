"""FarSkip connectivity, in one place: which layers are converted and which stream each of their
sub-blocks reads (layer_sets.py: presets and `farskip.layers` forms, plain Python that config
validation and the XLA flags read before JAX starts), and the residual streams the model carries
(streams.py: `Streams`, JAX). This file imports nothing, so `connectivity.layer_sets` stays JAX-free.
"""
