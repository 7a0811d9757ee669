"""A recording layer step for tests: what each layer's sub-blocks read and returned.

    records = record(model, tokens, farskip)          # the model's own step, run unrolled
    records[k]: dict(attn_in, moe_in, attn, shared, routed, attn_kind, moe_kind) of layer k; a Federation
    of Experts adds attn_groups / routed_groups [H, b, s, d] (attn_in is then [H, b, s, d]) and keeps
    every routed sum in its own layer (FoEStep(defer=False): out.routed is always set)

The recorder subclasses the model's layer step (model/layer_step.py) and only observes it: the layer
it records is the one every forward runs. Eager calls only (the records are the arrays themselves).
"""

from farskip_jax.model.foe import FoEStep


def record(model, tokens, farskip, **call_kw) -> list:
    records = []
    base = model.layer_step
    extra = {"defer": False} if isinstance(base, type) and issubclass(base, FoEStep) else {}

    class Recorder(base):
        scannable = False

        def __init__(self, *args):
            super().__init__(*args, **extra)

        def moe_input(self, x):
            self.moe_in = x  # the stream the layer body gave its MoE
            return super().moe_input(x)

        def __call__(self, block, carry, site, entry=None):
            x, _ = self.attention_input(carry, site, self.plan(block, carry, site))
            new, out, entry = super().__call__(block, carry, site, entry)
            rec = dict(attn_in=x, moe_in=self.moe_in, attn=out.attn,
                       shared=out.shared, routed=out.routed, attn_kind=site.kinds[0], moe_kind=site.kinds[1])
            if isinstance(self, FoEStep):
                rec.update(attn_groups=out.attn_groups, routed_groups=out.routed_groups)
            records.append(rec)
            return new, out, entry

    model.layer_step = Recorder
    try:
        model(tokens, farskip=farskip, **call_kw)
    finally:
        model.layer_step = base
    return records
