"""The losses of training and FCSD, shared by evaluation (it measures the same divergences).

    ce.py          next-token cross entropy from full logits (one-pass custom VJP)
    divergence.py  teacher/student divergences (forward / reverse / both KL, top-k + tail), hidden-state L2
    chunked.py     the cross entropy and the FCSD divergences from final streams, a chunk of positions at a time
"""
