"""Reading what the project stores, below train/, eval/, convert/ and fcsd/ (docs/design.md section 3).

    load.py           load_run / load_hf / load_import -> (cfg, graphdef, {params, bias, rest})
    hf_folder.py      an HF checkpoint folder -> Config + Transformer, one tensor at a time (import_hf)
    reader.py, safetensors_io.py, hf_fields.py, spec.py, families/   the HF files and each family's keys
    connectivity.py   which connectivity an imported folder runs under
    import_folder.py  what an import folder is; native.py reads one back (load_native)
    checkpoint.py     orbax checkpoints of a run's train state, verified by digest.py
    train_state.py    the train state a checkpoint holds; optimizer.py the optimizer whose state it holds
    layer_keys.py     per-layer <-> stacked parameter keys (checkpoints, HF keys)

It imports config, model/ and parallel/ only.
"""
