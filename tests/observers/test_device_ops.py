"""Off the CPU the observers call the ``quantscope::`` ops (issue 35 item 2: one op per hot
loop, Triton on CUDA), not a torch path of their own.

Without a GPU the ``meta`` device stands in for one: it is not the CPU, so the observers
take the device paths, and every op has a fake (meta) implementation, so a forward runs
through the ops' schemas and shapes. What the ops compute is proven elsewhere
(tests/kernels/test_triton_*.py: the Triton kernels bitwise against the torch path under
the interpreter); here the CPU runs the same device code path through the ops' CPU
implementations, which must give what the CPU observers give.
"""

from __future__ import annotations

import pytest
import torch
from op_names import OpNames

import quantscope
from quantscope import QuantSpec, presets
from quantscope.layout import Block, Channel, Group, Tensor, Tile, Token
from quantscope.stats import minmax, minmax_layouts

MINMAX = ["minmax", "memoryless_minmax", "moving_average_minmax"]
LAYOUTS = {
    "tensor": (QuantSpec("int8", Tensor()), (4, 16, 32)),
    "channel-0": (QuantSpec("int8", Channel(0)), (32, 64)),
    "channel-middle": (QuantSpec("int8", Channel(1)), (4, 16, 32)),
    "channel-last": (QuantSpec("int8", Channel(-1)), (4, 16, 32)),
    "group-32": (QuantSpec("int4", Group(32)), (8, 64)),
    "token": (QuantSpec("int8", Token()), (4, 16, 32)),
    "tile": (QuantSpec("int8", Tile(8, 16)), (2, 32, 64)),
    "tile-padded": (QuantSpec("int8", Tile(8, 16)), (30, 40)),
    "mxfp4": (presets.MXFP4, (8, 64)),
    "nvfp4": (presets.NVFP4, (8, 64)),
    "block-7": (QuantSpec("fp4_e2m1", Block(7), scale="fp8_e4m3"), (8, 63)),
}


def _x(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.rand(shape[-1], generator=g).add(0.1)).to(dtype)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_op_layout_minmax_is_the_units_minmax(layout, dtype):
    """The device path reads the units where they lie (a channel axis in the middle, tiles:
    as [U1, U2, E1, E2] views), in its own dtype, in the units' order: bitwise the min / max
    of the float32 units."""
    spec, shape = LAYOUTS[layout]
    x = _x(shape, dtype)
    lo, hi = minmax_layouts._op_layout_minmax(x, spec.layout)
    ref_lo, ref_hi = torch.aminmax(spec.layout.to_units(x.float()), dim=1)
    assert lo.dtype == torch.float32
    assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", MINMAX)
def test_minmax_observers_read_bf16_through_the_op(name, layout):
    """The min-max family off the CPU: a memoryless observer one ``quantscope::unit_minmax``,
    an accumulating one its whole step in ``quantscope::minmax_observe``
    (tests/observers/test_minmax_observe_op.py); no float32 copy of a bf16 input."""
    spec, shape = LAYOUTS[layout]
    obs = quantscope.get_observer(name, spec).to("meta")
    x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    obs(x)  # the first call sizes the state
    with OpNames() as seen:
        obs(x)
    padded = layout.endswith("-padded")  # forward takes the padding out before the update
    if obs.accumulates and not padded:
        assert "quantscope.minmax_observe" in seen.names
        assert not seen.names & {"quantscope.unit_minmax", "quantscope.minmax_update"}
    elif obs.accumulates:
        assert {"quantscope.unit_minmax", "quantscope.minmax_update"} <= seen.names
    else:
        assert {"quantscope.unit_minmax", "quantscope.record_non_finite"} <= seen.names
    # no float32 copy of the input, and the non-finite check and state update are one op each
    assert not seen.names & {"aten._to_copy", "aten.amin", "aten.isfinite", "aten.abs"}


@pytest.mark.parametrize("name, spec, ops", [
    ("histogram", QuantSpec("int8"), {"quantscope.unit_minmax", "quantscope.hist_add"}),
    ("percentile", QuantSpec("int8", Channel(0)),
     {"quantscope.unit_minmax", "quantscope.hist_add"}),
    ("mse", QuantSpec("int4", Group(16)),
     {"quantscope.unit_minmax", "quantscope.mse_price_int", "quantscope.mse_select"}),
    ("mse", presets.NVFP4, {"quantscope.nvfp4_mse"}),  # fused: pricing and selection
    ("nvfp4_expanded_mse", presets.NVFP4, {"quantscope.nvfp4_search"}),  # fused: no patience
    ("mse", presets.MXFP4, {"quantscope.mx_mse"}),  # fused: each block's E8M0 scales once
    ("memoryless_mse", presets.MXINT8, {"quantscope.mx_mse"}),  # integer elements too
    # the importance-weighted search: the same engine, weights priced in the same ops
    ("imatrix_mse", presets.NVFP4, {"quantscope.nvfp4_search"}),
    ("imatrix_mse", presets.MXFP4, {"quantscope.mx_mse"}),
    ("imatrix_mse", QuantSpec("int4", Group(16)),
     {"quantscope.mse_price_int", "quantscope.mse_select"}),
])
def test_histogram_and_search_observers_call_the_ops(name, spec, ops):
    obs = quantscope.get_observer(name, spec).to("meta")
    with OpNames() as seen:
        obs(torch.empty(8, 64, device="meta"))
    assert ops <= seen.names


def _state_args(kind):
    g = torch.Generator().manual_seed(kind)
    lo = torch.randn(40, generator=g)
    hi = lo + 1
    lo[3] = float("nan")
    return lo, hi, torch.randn(40, generator=g), torch.randn(40, generator=g) + 3


@pytest.mark.parametrize("kind", [1, 2, 3])
def test_minmax_update_op(kind):
    """``quantscope::minmax_update``: schema, fake and in-place state (opcheck); its CPU
    implementation is ``update_state``'s torch path, bit for bit."""
    lo, hi, slo, shi = _state_args(kind)
    torch.library.opcheck(minmax.minmax_update, (lo, hi, slo.clone(), shi.clone(), kind, 0.25))
    names = {v: k for k, v in minmax.UPDATES.items()}
    want = (slo.clone(), shi.clone())
    minmax._update_state(names[kind], 0.25, *want, lo.clone(), hi.clone())
    got = (slo.clone(), shi.clone())
    minmax.minmax_update(lo, hi, *got, kind, 0.25)
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_record_non_finite_op():
    lo, hi, _, _ = _state_args(1)
    seen = torch.zeros((), dtype=torch.bool)
    torch.library.opcheck(minmax.record_non_finite, (lo, hi, seen.clone()))
    minmax.record_non_finite(lo, hi, seen)
    assert bool(seen)
    clean = torch.zeros((), dtype=torch.bool)
    minmax.record_non_finite(hi.nan_to_num(), hi.nan_to_num(), clean)
    assert not bool(clean)
    with pytest.raises(ValueError, match="seen must be one bool"):
        minmax.record_non_finite(lo, hi, torch.zeros(2))
    with pytest.raises(ValueError, match="kind must be one of"):
        minmax.minmax_update(lo, hi, lo.clone(), hi.clone(), 7, 0.1)


@pytest.mark.parametrize("layout", ["channel-middle", "tile", "nvfp4", "group-32"])
def test_device_path_qparams_equal_the_cpu_observer(layout, monkeypatch):
    """The device code path, run on the CPU through the ops' CPU implementations, gives the
    CPU observer's qparams bit for bit."""
    spec, shape = LAYOUTS[layout]
    x = _x(shape, torch.bfloat16, seed=3)
    cpu = quantscope.get_observer("minmax", spec)
    cpu(x)
    off_cpu = lambda t, lay, *_: minmax_layouts._op_layout_minmax(t, lay)
    monkeypatch.setattr(minmax_layouts, "layout_minmax", off_cpu)
    monkeypatch.setattr(quantscope.observers.base, "layout_minmax", off_cpu)
    dev = quantscope.get_observer("minmax", spec)
    dev(x)
    a, b = cpu.calculate_qparams(), dev.calculate_qparams()
    assert torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)


CUDA = torch.cuda.is_available()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name, layout", [("minmax", "channel-middle"), ("minmax", "tile"),
                                          ("memoryless_minmax", "mxfp4"),
                                          ("memoryless_minmax", "nvfp4"),
                                          ("moving_average_minmax", "group-32"),
                                          ("mse", "group-32"), ("mse", "nvfp4"),
                                          ("imatrix_mse", "nvfp4"), ("imatrix_mse", "mxfp4")])
def test_cuda_observers_give_the_cpu_qparams(name, layout):
    """On CUDA (the Triton ops) the observers' qparams equal the CPU observers' (the MSE
    searches, importance-weighted too: near ties may fall otherwise, the float64 sums
    running in another order)."""
    spec, shape = LAYOUTS[layout]
    batches = [_x(shape, torch.bfloat16, seed=s) for s in range(2)]
    qps = []
    for device in ("cpu", "cuda"):
        obs = quantscope.get_observer(name, spec).to(device)
        for b in batches:
            obs(b.to(device))
        qps.append(obs.calculate_qparams())
    if name.endswith("mse"):
        assert (qps[0].scale == qps[1].scale.cpu()).float().mean() > 0.95
    else:
        assert torch.equal(qps[0].scale, qps[1].scale.cpu())
        assert torch.equal(qps[0].zero_point, qps[1].zero_point.cpu())


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("kind", [1, 2, 3])
def test_cuda_state_ops_equal_the_cpu(kind):
    lo, hi, slo, shi = _state_args(kind)
    cpu, cuda = (slo.clone(), shi.clone()), (slo.cuda(), shi.cuda())
    minmax.minmax_update(lo, hi, *cpu, kind, 0.01)
    minmax.minmax_update(lo.cuda(), hi.cuda(), *cuda, kind, 0.01)
    for a, b in zip(cuda, cpu):
        a = a.cpu()
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    seen = torch.zeros((), dtype=torch.bool, device="cuda")
    minmax.record_non_finite(lo.cuda(), hi.cuda(), seen)
    assert bool(seen)


def _graphed_and_eager(name, spec, shape, grow=1.0):
    """Two observers ``name``: one's forward captured once in a CUDA graph and replayed on
    three new batches (each ``grow`` times the last's range), the other called eagerly."""
    x = _x(shape, torch.bfloat16).cuda()
    graphed, eager = (quantscope.get_observer(name, spec).cuda() for _ in range(2))
    for obs in (graphed, eager):
        obs(x)  # the first call sizes the state (and compiles the kernels) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed(x)
    for s in range(3):
        x.copy_(_x(shape, torch.bfloat16, seed=10 + s).cuda() * grow ** (s + 1))
        graph.replay()
        eager(x)
    torch.cuda.synchronize()
    return graphed, eager


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", MINMAX)
def test_cuda_minmax_forward_replays_in_a_cuda_graph(name):
    """An activation observer's forward captured once in a CUDA graph and replayed on new
    data: no host read inside, the eager observer's state."""
    graphed, eager = _graphed_and_eager(name, *LAYOUTS["channel-last"])
    assert torch.equal(graphed.min_vals, eager.min_vals)
    assert torch.equal(graphed.max_vals, eager.max_vals)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["percentile", "histogram", "entropy"])
def test_cuda_histogram_forward_replays_in_a_cuda_graph(name):
    """A histogram observer's forward captured once in a CUDA graph and replayed on batches
    whose range grows (each replay re-bins on the device): no host read inside, the state
    written into the captured buffers (``Observer._store``), the eager observer's qparams."""
    graphed, eager = _graphed_and_eager(name, QuantSpec("int8"), (4, 16, 32), grow=1.5)
    for key, value in eager.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(graphed.state_dict()[key], value), key
    ours, theirs = graphed.calculate_qparams(), eager.calculate_qparams()
    assert torch.equal(ours.scale, theirs.scale)
    assert torch.equal(ours.zero_point, theirs.zero_point)


@pytest.mark.parametrize("spec", [QuantSpec("uint8", symmetric=False), QuantSpec("int8"),
                                  QuantSpec("int8", Channel(0))], ids=str)
def test_histogram_grid_change_is_one_op(spec):
    """Off the CPU the histogram's grid change is ``quantscope::hist_regrid_`` (one Triton
    launch on CUDA), not the torch reference's some hundred one-element ops (log2, frexp,
    floor, scatter_add, ...): a forward dispatches a handful of ops."""
    obs = quantscope.get_observer("histogram", spec).to("meta")
    x = torch.empty(8, 64, device="meta")
    obs(x)  # the first call sizes the state
    with OpNames() as seen:
        obs(x)
    assert seen.calls.get("quantscope.hist_regrid_") == 1
    assert seen.calls.get("quantscope.hist_add") == 1
    assert not seen.calls.keys() & {"aten.log2", "aten.frexp", "aten.scatter_add",
                                    "aten.floor", "aten.ceil"}
    assert sum(seen.calls.values()) <= 8, seen.calls  # the torch grid change: ~120
    # the op writes the state in place: no fresh state copied back into the buffers
    assert not seen.calls.keys() & {"aten._foreach_copy_", "aten.copy_", "aten.empty_like"}


@pytest.mark.parametrize("inplace", [False, True])
def test_histogram_update_off_the_cpu_leaves_the_state_unless_inplace(inplace):
    """Off the CPU the grid change writes the state it is given (``hist_regrid_``): without
    ``inplace`` that is a copy, so the caller's state is not modified (its tensors are not
    the ones returned, nor written); with it, the state's own tensors come back."""
    from quantscope.stats import histogram as H

    state = H.empty_state(3, 16, device="meta")
    units = torch.empty(3, 10, device="meta")
    lo, hi = torch.empty(3, device="meta"), torch.empty(3, device="meta")
    with OpNames() as seen:
        new = H.update(state, units, lo, hi, inplace=inplace)
    assert [a is b for a, b in zip(new, state, strict=True)] == [inplace] * 5
    assert seen.calls["quantscope.hist_regrid_"] == 1
    assert seen.calls.get("aten.clone", 0) == (0 if inplace else 5)


@pytest.mark.parametrize("name", ["histogram", "percentile", "kl"])
def test_histogram_reads_bf16_units_as_they_are(name):
    """Off the CPU the native grid's ops read bf16 units exactly: no float32 copy of the
    batch. (The linear ``grid="first"`` computes in the units' dtype and keeps the copy.)"""
    obs = quantscope.get_observer(name, QuantSpec("int8", Channel(0))).to("meta")
    assert obs.units_in_input_dtype
    assert not quantscope.get_observer(name, grid="first").units_in_input_dtype
    x = torch.empty(16, 64, dtype=torch.bfloat16, device="meta")
    obs(x)
    with OpNames() as seen:
        obs(x)
    assert "quantscope.hist_add" in seen.names and "aten._to_copy" not in seen.names


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", [QuantSpec("uint8", symmetric=False),
                                  QuantSpec("int8", Channel(0))], ids=str)
def test_cuda_histogram_state_equals_the_cpu(spec, dtype):
    """Three growing batches: the CUDA observer's histogram state (the Triton grid change
    and binning, bf16 read as it is) is the CPU observer's, bit for bit."""
    batches = [(_x((32, 64), seed=s) * 4.0 ** s).to(dtype) for s in range(3)]
    states = []
    for device in ("cpu", "cuda"):
        obs = quantscope.get_observer("histogram", spec).to(device)
        for b in batches:
            obs(b.to(device))
        states.append([getattr(obs, n).cpu() for n in ("hist_counts", "hist_exp",
                                                       "hist_first", "hist_lo", "hist_hi")])
    for a, b in zip(*states, strict=True):
        assert torch.equal(a, b)
