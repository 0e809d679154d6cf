"""The synthetic format table: every format on a few realistic tensors, and its error.

``python -m quantscope.demo`` (``make demo``) prints it;
:func:`format_table` returns it as text for other front ends (``quantscope formats``).

Three 512 x 1024 float32 tensors, seeded:

* ``gauss``: N(0, 1), the easy case.
* ``student-t``: Student's t with 3 degrees of freedom, heavy tails like real weights.
* ``outliers``: N(0, 1) with 1% of the columns (input channels) scaled by 50, like the
  outlier features of transformer activations.

Each scheme takes its qparams from the per-unit min / max (no search), so the table
shows what the format and granularity alone cost. Error is SQNR in dB
(``10 log10(sum x^2 / sum (x - x')^2)``, higher is better) and the MSE.
``bits/elem`` counts the scales too (fp32 per channel or group, 8-bit E8M0 / e4m3 block
scales, NVFP4's global scale).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from .. import presets
from ..calibration.results.report import sqnr_db
from ..formats import as_int
from ..layout import Block, Channel, Group, Tile
from ..qdq import fake_quantize
from ..qparams import qparams_from_range
from ..spec import QuantSpec
from ..stats.minmax import unit_minmax

__all__ = ["COL_MULTIPLE", "SCHEMES", "check_size", "demo_tensors", "format_table", "main",
           "scheme_error"]

ROWS, COLS = 512, 1024

#: (name, spec) of every scheme in the table, in order.
SCHEMES: list[tuple[str, QuantSpec]] = [
    ("int8 per-channel", presets.INT8_PER_CHANNEL),
    ("int8 group128", QuantSpec("int8", Group(128))),
    ("int4 per-channel", QuantSpec("int4", Channel(0))),
    ("int4 group128", presets.INT4_GROUP128),
    ("int4 group128 asym", presets.INT4_GROUP128_ASYM),
    ("int2 per-channel asym", QuantSpec("int2", Channel(0), symmetric=False)),
    ("int2 group128 asym", QuantSpec("int2", Group(128), symmetric=False)),
    ("fp8 e4m3 per-channel", presets.FP8_PER_CHANNEL),
    ("fp8 e4m3 tile128x128", QuantSpec("fp8_e4m3", Tile(128, 128))),
    ("fp8 e5m2 per-channel", QuantSpec("fp8_e5m2", Channel(0))),
    ("fp6 e3m2 per-channel", QuantSpec("fp6_e3m2", Channel(0))),
    ("fp6 e2m3 per-channel", QuantSpec("fp6_e2m3", Channel(0))),
    ("fp4 e2m1 per-channel", QuantSpec("fp4_e2m1", Channel(0))),
    ("fp4 e2m1 group32", QuantSpec("fp4_e2m1", Group(32))),
    ("mxfp8 (e4m3, floor)", presets.MXFP8),
    ("mxfp6 e3m2", presets.MXFP6_E3M2),
    ("mxfp6 e2m3", presets.MXFP6_E2M3),
    ("mxfp4 (floor)", presets.MXFP4),
    ("mxfp4 (even)", QuantSpec("fp4_e2m1", Block(32), scale="e8m0:even")),
    ("mxfp4 (rceil)", QuantSpec("fp4_e2m1", Block(32), scale="e8m0:rceil")),
    ("mxint8", presets.MXINT8),
    ("nvfp4", presets.NVFP4),
    ("bfp16", presets.BFP16),
]

#: the group sizes of the table's schemes: each must divide the column count (blocks and
#: tiles pad their tail, groups do not); the columns must be a multiple of all of them
_GROUPS = sorted({s.layout.size for _, s in SCHEMES if isinstance(s.layout, Group)})
COL_MULTIPLE = math.lcm(*_GROUPS)


def _size_problem(name: str, value) -> str | None:
    """What is wrong with ``value`` as the table's ``name`` ("rows" / "cols"), or None."""
    multiple, n = (COL_MULTIPLE if name == "cols" else 1), as_int(value)
    if n is not None and n > 0 and n % multiple == 0:
        return None
    allowed = ("a positive integer" if multiple == 1 else f"a positive multiple of {multiple} "
               f"(the group sizes {', '.join(map(str, _GROUPS))} must divide it)")
    return f"must be {allowed}, got {value!r}"


def check_size(name: str, value: int) -> int:
    """``value`` as the table's ``name`` ("rows" / "cols"), as a Python int; a
    ``ValueError`` naming it and what it may be unless it is one."""
    problem = _size_problem(name, value)
    if problem:
        raise ValueError(f"format_table: {name} {problem}")
    return int(value)


def _size_arg(name: str):
    """The argparse ``type`` of ``--rows`` / ``--cols`` (argparse names the option)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = text
        problem = _size_problem(name, value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value
    return parse


def demo_tensors(seed: int = 0, rows: int = ROWS, cols: int = COLS) -> dict[str, torch.Tensor]:
    """The three seeded test tensors (see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    gauss = torch.randn(rows, cols, generator=g)
    # Student-t(3) = N(0,1) / sqrt(chi2_3 / 3), chi2_3 as a sum of three squared normals
    chi2 = torch.randn(3, rows, cols, generator=g).square().sum(0)
    student = torch.randn(rows, cols, generator=g) / (chi2 / 3).sqrt()
    outliers = torch.randn(rows, cols, generator=g)
    cols_out = torch.randperm(cols, generator=g)[: max(1, cols // 100)]
    outliers[:, cols_out] *= 50
    return {"gauss": gauss, "student-t": student, "outliers": outliers}


def scheme_error(x: torch.Tensor, spec: QuantSpec) -> tuple[float, float]:
    """(SQNR dB, MSE) of min-max fake quantization of ``x`` under ``spec``."""
    q = qparams_from_range(*unit_minmax(spec.layout.to_units(x)), spec)
    q = q.reshape(spec.layout.qparam_shape(x.shape))
    err = float((fake_quantize(x, q, spec) - x).double().square().sum())
    return sqnr_db(float(x.double().square().sum()), err), err / x.numel()


def bits_per_element(spec: QuantSpec, shape) -> float:
    """Element bits plus scale (and zero point) bits, averaged over the tensor."""
    fmt = spec.format
    bits = fmt.bits if hasattr(fmt, "bits") else 1 + fmt.ebits + fmt.mbits
    units = spec.layout.num_units(shape)
    scale_bits = {"e8m0": 8, "fp8_e4m3": 8, "fp16": 16, "bf16": 16}.get(spec.scale.kind, 32)
    extra = units * (scale_bits + (0 if spec.symmetric else bits))
    if spec.scale.has_global_scale:
        extra += 32
    return bits + extra / math.prod(shape)


def format_table(seed: int = 0, rows: int = ROWS, cols: int = COLS) -> str:
    """The table as text: one line per scheme, SQNR dB and MSE per tensor; computed on one
    thread, the caller's count put back after (``quantscope formats`` runs in its caller's
    process)."""
    rows, cols = check_size("rows", rows), check_size("cols", cols)
    # the tensors are small: one thread is as fast, and immune to a busy machine's
    # oversubscription (OpenMP spinning made this table 10x slower on a shared 2-core box)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _table(seed, rows, cols)
    finally:
        torch.set_num_threads(before)


def _table(seed: int, rows: int, cols: int) -> str:
    tensors = demo_tensors(seed, rows, cols)
    names = list(tensors)
    head = ["scheme", "bits/elem"] + [f"{n} {c}" for n in names for c in ("SQNR", "MSE")]
    lines = []
    for label, spec in SCHEMES:
        cells = [label, f"{bits_per_element(spec, (rows, cols)):.2f}"]
        for n in names:
            sqnr, mse = scheme_error(tensors[n], spec)
            cells += [f"{sqnr:.1f}", f"{mse:.2e}"]
        lines.append(cells)
    widths = [max(len(r[i]) for r in [head, *lines]) for i in range(len(head))]

    def fmt(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths)))

    title = (f"quantscope formats: min-max qparams on {rows}x{cols} float32 tensors "
             f"(seed {seed}); SQNR in dB (higher is better), MSE")
    return "\n".join([title, "", fmt(head), fmt(["-" * w for w in widths]),
                      *(fmt(r) for r in lines)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m quantscope.demo",
                                description=__doc__.split("\n")[0])
    p.add_argument("--formats", action="store_true",
                   help="print the synthetic format table (the only part for now)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", type=_size_arg("rows"), default=ROWS,
                   help=f"rows of each tensor, positive (default {ROWS})")
    p.add_argument("--cols", type=_size_arg("cols"), default=COLS,
                   help=f"columns of each tensor, a positive multiple of {COL_MULTIPLE} "
                   f"(default {COLS})")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    print(format_table(args.seed, args.rows, args.cols))
    print(f"\n{len(SCHEMES)} schemes x 3 tensors in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
