"""analysis/peak_buffers.py: the values live at a compiled program's peak, read from XLA's dumped
live ranges and scheduled HLO, with shapes and the named scope that made them."""

import jax
import jax.numpy as jnp

from farskip_jax.analysis import peak_buffers as pb


def test_parsers_on_text():
    assert pb.split_tuple_shape("(f32[2]{0}, (s32[], f32[3,4]{1,0}))") == ["f32[2]{0}", "(s32[], f32[3,4]{1,0})"]
    assert pb.element_shape("(f32[2]{0}, (s32[], f32[3,4]{1,0}))", (1, 1)) == "f32[3,4]"
    assert pb.element_shape("bf16[8,16]{1,0}", ()) == "bf16[8,16]"
    live = ("HloLiveRange (max 3):\n  Live ranges at 2 (peak):\n    dot.1{}: 4096 bytes (cumulative: 4096 bytes)\n"
            "    while.3{1}: 64 bytes (cumulative: 4160 bytes)\n")
    assert pb.parse_live_at_peak(live) == [("dot.1", (), 4096), ("while.3", (1,), 64)]
    hlo = ("%fused_computation (p: f32[4]) -> f32[4] {\n  %p = f32[4]{0} parameter(0)\n"
           '  ROOT %exp.1 = f32[4]{0} exponential(%p), metadata={op_name="jit(f)/inner/exp"}\n}\n\n'
           "ENTRY %main (x: f32[4]) -> (f32[4], /*index=1*/s32[]) {\n  %x = f32[4]{0} parameter(0)\n"
           "  %fusion = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation\n"
           "  ROOT %t = (f32[4]{0}, /*index=1*/s32[]) tuple(%fusion, %c)\n}\n")
    ins = pb.parse_hlo(hlo)
    assert ins["fusion"] == ("f32[4]{0}", "fusion", "jit(f)/inner/exp")  # the fused root's scope
    assert ins["t"][1] == "tuple" and pb.element_shape(ins["t"][0], (1,)) == "s32[]"
    assert pb.short_scope("jit(step)/transpose(jvp(loss))/dot") == "transpose(jvp(loss))/dot"


def test_peak_buffers_of_a_compiled_program():
    def f(x, w):
        with jax.named_scope("wide"):
            y = jnp.tanh(x @ w)  # [128, 1024]: the largest value, live until its gradient is taken
        return jnp.sum(y @ w.T)

    x = jax.ShapeDtypeStruct((128, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
    with pb.dumping() as d:
        c = jax.jit(jax.grad(f, argnums=1)).lower(x, w).compile(compiler_options=d.options)
        bufs = pb.peak_buffers(d.path)
    assert bufs and [b.bytes for b in bufs] == sorted((b.bytes for b in bufs), reverse=True)
    assert all(b.shape != "?" for b in bufs)
    # the live bytes at the peak are within the program's own totals
    m = c.memory_analysis()
    assert sum(b.bytes for b in bufs) <= m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    made = [b for b in bufs if b.opcode != "parameter"]
    assert made[0].bytes == 128 * 1024 * 4 or made[0].bytes == 64 * 1024 * 4, made[0]
    s = pb.summary(bufs, top=3)
    assert any(b.shape == "f32[128,1024]" and "wide" in b.scope for b in bufs), pb.format_peak_buffers(s)
    assert s["n_arguments"] >= 1 and s["argument_bytes"] >= 64 * 1024 * 4  # the arguments are live too
    assert s["bytes"] == s["argument_bytes"] + s["other_bytes"] and len(s["largest"]) <= 3
    assert all(b["opcode"] != "parameter" for b in s["largest"])
    text = pb.format_peak_buffers(s, top=2)
    assert "GiB" in text and len(text.splitlines()) == 1 + min(2, len(s["largest"]))
