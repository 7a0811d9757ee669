"""Serving: generation with a KV cache and the serving layouts' models and programs. The collectives
these compose (tensor-parallel attention, the all-reduces, FoE's group sums) are parallel/'s.

    generate.py   generate(model, prompts, n), the KV cache (init_cache) and the decode step
                  (decode_step / make_decode_fn) every layout runs
    tp_ep.py      inference.layout=tp_ep: TpEpLayout (layer: parallel/tp_ep.TpEpLayer), inference_model
    dp_ep.py      inference.layout=dp_ep: DpEpLayout (layer: parallel/dp_ep.DpEpLayer), dp_ep_model
    foe.py        inference.layout=foe: FoELayout (a Federation of Experts, one group per GPU)
    programs.py   serving_model(cfg, ...) for cfg.inference.layout; prefill / decode programs for
                  deviceless analysis (analysis/inference_report.py)

A serving layout is a small object: the model's layer step (None: the ordinary one), its routed
compute, its compile options and the shardings of batches and caches (`batch_sharding`,
`cache_sharding`, `stacked_cache_sharding`, `cache_heads`).
"""
