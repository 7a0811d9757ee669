"""The buffers live at a compiled program's memory peak, with their shapes and the scope that made them.

    with dumping() as d:
        compiled = jax.jit(f).lower(*args).compile(compiler_options=d.options)
    bufs = peak_buffers(d.path)                    # [PeakBuffer], largest first
    print(format_peak_buffers(summary(bufs), top=8))

XLA writes, for every compiled module when `xla_dump_to` is set (a per-compile debug option), its
scheduled HLO (`*after_optimizations.txt`) and the live ranges of its buffer assignment
(`*after_optimizations-live-range.txt`, section "Live ranges at N (peak)": the values live at the
step of the schedule where the most bytes are live, with their sizes). This module reads the two:
each live value at the peak gets the shape and opcode of the HLO instruction that defines it and its
scope, the `op_name` metadata (jax's name stack: `jax.named_scope`, `jvp(...)` = forward,
`transpose(jvp(...))` = backward). A fusion without metadata takes its fused root's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import shutil
import tempfile
from typing import Iterator, Optional

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_LIVE = re.compile(r"^\s*([\w.\-]+)\{([\d,]*)\}:\s*(\d+) bytes")
_PEAK = re.compile(r"Live ranges at (\d+) \(peak\):")


@dataclasses.dataclass
class PeakBuffer:
    """One value live at the peak: `name` (HLO instruction) with tuple `index`, its bytes, shape,
    opcode and scope (op_name metadata; "" when XLA kept none)."""

    name: str
    index: tuple
    bytes: int
    shape: str
    opcode: str
    scope: str


@dataclasses.dataclass
class Dump:
    path: str

    @property
    def options(self) -> dict:
        return {"xla_dump_to": self.path}


@contextlib.contextmanager
def dumping(keep: Optional[str] = None) -> Iterator[Dump]:
    """A fresh dump folder for one compile (`Dump.options` go into `compile(compiler_options=...)`);
    removed afterwards unless `keep` names a folder to keep it in."""
    path = keep or tempfile.mkdtemp(prefix="xla_dump_")
    os.makedirs(path, exist_ok=True)
    try:
        yield Dump(path)
    finally:
        if keep is None:
            shutil.rmtree(path, ignore_errors=True)


def split_tuple_shape(shape: str) -> list[str]:
    """'(f32[2]{0}, (s32[], f32[3]))' -> ['f32[2]{0}', '(s32[], f32[3])'] (top level only)."""
    s = shape.strip()
    if not s.startswith("("):
        return [s]
    out, depth, cur = [], 0, ""
    for ch in s[1:-1]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def element_shape(shape: str, index: tuple) -> str:
    """The shape at tuple `index` of an HLO shape string, without its layout ('f32[4,8]')."""
    for i in index:
        parts = split_tuple_shape(shape)
        if i >= len(parts):
            break
        shape = parts[i]
    return re.sub(r"\{[^{}]*\}", "", shape).strip()


def parse_hlo(text: str) -> dict:
    """{instruction name: (shape, opcode, op_name)} of an HLO module's text (every computation);
    fusions (and calls) without op_name take the op_name of their called computation's root."""
    instrs, roots, calls = {}, {}, {}
    comp = None
    for line in re.sub(r"/\*.*?\*/", "", text).splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("(")[0]:
            comp = m.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        op = _OPNAME.search(rest)
        instrs[name] = (shape.strip(), opcode, op.group(1) if op else "")
        c = _CALLS.search(rest)
        if c:
            calls[name] = c.group(1)
        if line.lstrip().startswith("ROOT") and comp is not None:
            roots[comp] = name
    for name, comp_name in calls.items():
        shape, opcode, op = instrs[name]
        seen = 0
        while not op and comp_name in roots and seen < 8:  # nested fusions: follow roots
            root = roots[comp_name]
            op = instrs.get(root, ("", "", ""))[2]
            comp_name = calls.get(root, "")
            seen += 1
        instrs[name] = (shape, opcode, op)
    return instrs


def parse_live_at_peak(text: str) -> list[tuple[str, tuple, int]]:
    """[(value name, tuple index, bytes)] of the 'Live ranges at N (peak):' section of a live-range dump."""
    out, inside = [], False
    for line in text.splitlines():
        if _PEAK.search(line):
            inside = True
            continue
        if inside:
            m = _LIVE.match(line)
            if not m:
                if line.strip():
                    break
                continue
            idx = tuple(int(i) for i in m.group(2).split(",") if i)
            out.append((m.group(1), idx, int(m.group(3))))
    return out


def _module_files(path: str) -> tuple[str, str]:
    """(scheduled HLO, live ranges) of the largest dumped module in `path`."""
    ranges = glob.glob(os.path.join(path, "*after_optimizations-live-range.txt"))
    if not ranges:
        raise FileNotFoundError(f"no '*after_optimizations-live-range.txt' in {path}: compile with "
                                "compiler_options={'xla_dump_to': path}")
    live = max(ranges, key=os.path.getsize)
    hlo = live.replace("-live-range.txt", ".txt")
    if not os.path.exists(hlo):
        raise FileNotFoundError(f"{hlo} (the scheduled HLO next to {live}) is missing")
    return hlo, live


def peak_buffers(path: str) -> list[PeakBuffer]:
    """The values live at the peak of the module dumped in `path`, largest first."""
    hlo, live = _module_files(path)
    with open(hlo) as f:
        instrs = parse_hlo(f.read())
    with open(live) as f:
        at_peak = parse_live_at_peak(f.read())
    out = []
    for name, idx, nbytes in at_peak:
        shape, opcode, scope = instrs.get(name, ("?", "?", ""))
        out.append(PeakBuffer(name, idx, nbytes, element_shape(shape, idx), opcode, scope))
    return sorted(out, key=lambda b: -b.bytes)


def short_scope(scope: str, width: int = 110) -> str:
    """op_name without the outer 'jit(...)/' and cut in the middle to `width` characters."""
    s = re.sub(r"^jit\([^)]*\)/", "", scope) or "(no op_name)"
    return s if len(s) <= width else s[: width // 2 - 2] + " .. " + s[-(width // 2 - 2):]


def summary(bufs: list[PeakBuffer], top: int = 24) -> dict:
    """JSON-able: totals of the values live at the peak, split into arguments (parameters) and the
    rest (temporaries and outputs), and the `top` largest of the rest (dicts of PeakBuffer)."""
    args = [b for b in bufs if b.opcode == "parameter"]
    rest = [b for b in bufs if b.opcode != "parameter"]
    return dict(n=len(bufs), bytes=sum(b.bytes for b in bufs), n_arguments=len(args),
                argument_bytes=sum(b.bytes for b in args), n_other=len(rest), other_bytes=sum(b.bytes for b in rest),
                largest=[dataclasses.asdict(b) for b in rest[:top]])


def format_peak_buffers(s: dict, top: int = 10, unit: float = 2**30) -> str:
    """Lines of a `summary`: the totals, then its `top` largest non-argument buffers (GiB, shape,
    opcode, scope)."""
    lines = [f"  live at the peak: {s['bytes'] / unit:.2f} GiB in {s['n']} buffers = arguments {s['argument_bytes'] / unit:.2f} "
             f"GiB ({s['n_arguments']}) + temporaries/outputs {s['other_bytes'] / unit:.2f} GiB ({s['n_other']}); "
             f"the largest of these:"]
    for b in s["largest"][:top]:
        lines.append(f"  {b['bytes'] / unit:8.3f} GiB  {b['shape']:<28} {b['opcode']:<18} {short_scope(b['scope'])}")
    return "\n".join(lines)
