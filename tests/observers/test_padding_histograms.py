"""Histogram observers on zero-padded Block / Tile units: the padding is no data.

layout.py pads a ragged last block / edge tile with zeros ("padding never moves a range or
adds error"). Every histogram observer must therefore give a padded unit the same state and
qparams, bitwise, as an observer that sees that unit's real values alone (``Tensor()``
layout), batch after batch: the reference values here are sliced out of ``x`` directly.
"""

import pytest
import torch
from tiers import each_value

import quantscope
from quantscope import Block, QuantSpec, Tensor, Tile, get_observer

OBSERVERS = [
    ("percentile", {}),
    ("percentile", {"percentile": 99.0}),
    ("percentile", {"percentile": 99.0, "convention": "lower"}),
    ("histogram_mse", {}),
    ("entropy", {}),
    ("entropy", {"copy_zero_bin": False}),
    ("histogram", {}),
    ("mix", {}),
    ("percentile", {"grid": "first", "percentile": 99.0}),  # the compat classes' grid
    ("percentile", {"skip_zeros": True, "percentile": 99.0}),  # Quark's percentile
    ("percentile", {"averaging_constant": 0.5, "percentile": 99.0}),  # Horizon's EMA
]

# (layout, shape of every batch): ragged last blocks, edge tiles with leading dims, and one
# unit that is mostly padding (the fused one-unit path)
LAYOUTS = [
    (Block(256), (4, 300)),
    (Block(64, axis=0), (100, 3)),
    (Tile(64, 64), (2, 65, 100)),
    (Tile(16, 512), (3, 300)),
    (Block(4096), (1, 300)),
    (Tile(128, 128), (3, 1, 300)),  # decode-shaped: a tile cut to the one row
]


def real_units(x, layout):
    """Each unit's real values, in the layout's unit order, sliced from ``x`` itself."""
    if isinstance(layout, Block):
        lines = x.movedim(layout.axis, -1).reshape(-1, x.shape[layout.axis])
        n = lines.shape[1]
        return [line[s:s + layout.size] for line in lines for s in range(0, n, layout.size)]
    R, C = x.shape[-2:]
    return [m[r:r + layout.rows, c:c + layout.cols].reshape(-1)
            for m in x.reshape(-1, R, C) for r in range(0, R, layout.rows)
            for c in range(0, C, layout.cols)]


def batches(shape, several, signed):
    torch.manual_seed(0)
    # growing, then shrinking ranges: the grid coarsens (exact re-binning) between batches
    scales = (1.0, 3.0, 0.25) if several else (1.0,)
    out = []
    for s in scales:
        if signed:
            x = torch.randn(shape) * s
            x.view(-1)[::7] = 0.0  # real zeros, which skip_zeros drops and the rest count
        else:  # a unit's real min is > 0, its padding's 0 is not
            x = torch.rand(shape) * s + s
        out.append(x)
    return out


def check_padded_units_match(name, opts, layout, shape, several, symmetric, signed):
    spec = QuantSpec("int8", layout, symmetric=symmetric)
    data = batches(shape, several, signed)
    obs = get_observer(name, spec, **opts)
    for x in data:
        obs(x)
    qp = obs.calculate_qparams()
    scale, zp = qp.scale.reshape(-1), qp.zero_point.reshape(-1)
    units = [real_units(x, layout) for x in data]
    assert len(units[0]) == scale.numel()
    for k in range(scale.numel()):
        alone = get_observer(name, spec.replace(layout=Tensor()), **opts)
        for u in units:
            alone(u[k])
        for buf in ("hist_counts", "hist_exp", "hist_first", "min_vals", "max_vals"):
            assert torch.equal(getattr(obs, buf)[k], getattr(alone, buf)[0]), (k, buf)
        ref = alone.calculate_qparams()
        assert scale[k] == ref.scale.reshape(-1)[0] and zp[k] == ref.zero_point.reshape(-1)[0], k


@pytest.mark.parametrize(("name", "opts", "layout", "shape", "several"), each_value(
    OBSERVERS, LAYOUTS, [False, True], ids=lambda v: str(v).replace(" ", "")))
def test_padded_unit_equals_its_real_values_alone(name, opts, layout, shape, several):
    check_padded_units_match(name, opts, layout, shape, several, symmetric=True, signed=True)


@pytest.mark.parametrize(("name", "opts", "layout", "shape", "signed"), each_value(
    OBSERVERS, LAYOUTS[:3], [False, True], ids=lambda v: str(v).replace(" ", "")))
def test_padded_unit_equals_alone_asymmetric(name, opts, layout, shape, signed):
    # signed histograms; all-positive data: a padded unit's min stays its real min, not 0
    check_padded_units_match(name, opts, layout, shape, True, symmetric=False, signed=signed)


@pytest.mark.parametrize("layout,shape", LAYOUTS, ids=lambda v: str(v).replace(" ", ""))
def test_padding_torch_path_equals_kernels(layout, shape, monkeypatch):
    # the C kernels (binning, fused one-unit pass, min / max) and the torch reference path
    # take the padding out alike, bitwise
    def run():
        obs = get_observer("percentile", QuantSpec("int8", layout), percentile=99.0)
        for x in batches(shape, True, True):
            obs(x)
        return obs.hist_counts.clone(), obs.min_vals.clone(), obs.calculate_qparams().scale

    with_kernels = run()
    monkeypatch.setattr(quantscope.kernels, "lib", lambda name: None)
    for a, b in zip(with_kernels, run()):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout,shape", LAYOUTS, ids=lambda v: str(v).replace(" ", ""))
def test_padding_on_cuda_equals_cpu(layout, shape, dtype):
    # the Triton binning / min-max ops (bf16 units read as they are) and the CPU path agree
    def run(device):
        obs = get_observer("percentile", QuantSpec("int8", layout, symmetric=False),
                           percentile=99.0).to(device)
        for x in batches(shape, True, False):
            obs(x.to(dtype).to(device))
        return obs.hist_counts.cpu(), obs.min_vals.cpu(), obs.calculate_qparams().scale.cpu()

    for a, b in zip(run("cpu"), run("cuda")):
        assert torch.equal(a, b)


def test_repro_percentile_range_not_pulled_in_by_tile_padding():
    # one row of 300 values in [1, 2) in a 128 x 4096 tile: 99.99 % of the real values lie
    # below the percentile, so the range ends near x.max, as for the row observed alone
    torch.manual_seed(0)
    x = torch.rand(1, 300) + 1.0
    tile = get_observer("percentile", QuantSpec("int8", Tile(128, 4096)))
    tile(x)
    alone = get_observer("percentile", QuantSpec("int8"))
    alone(x)
    assert torch.equal(tile.calculate_qparams().scale.reshape(-1), alone.calculate_qparams().scale)
    assert tile.hist_counts.sum() == 300


@pytest.mark.parametrize("layout,shape,groups", [
    (Block(32), (3, 70), [(3, 6)]),  # the last block of each of 3 lines: 70 - 64 real values
    (Block(32), (3, 64), []),
    # 2 matrices of 6 x 10 in 4 x 8 tiles: corners 2 x 2, right column 4 x 2, bottom row 2 x 8
    (Tile(4, 8), (2, 6, 10), [(2, 4), (2, 8), (2, 16)]),
    (Tile(4, 8), (8, 16), []),
])
def test_padded_parts_name_the_padded_units(layout, shape, groups):
    # values 1..n: every zero in a unit is padding
    x = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    units = layout.to_units(x)
    parts = layout.padded_parts(units, x.shape)
    assert [(len(i), v.shape[1]) for i, v in parts] == groups
    named = {i: v for idx, vals in parts for i, v in zip(idx.tolist(), vals)}
    for i, u in enumerate(units):
        assert torch.equal(named.get(i, u), u[u != 0])  # the real values, in unit order
