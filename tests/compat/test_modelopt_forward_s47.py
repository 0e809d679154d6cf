"""ModelOpt's MaxCalibrator reached through ``forward`` (the native observer path, ``o(x)``)
keeps what ``collect`` keeps (s47): its amax is ModelOpt's ``max |x|`` over the axes not kept,
and a copy, a pickle and ``torch.load(weights_only=True)`` of it take it (they refused a
state with data and no amax shape)."""

import copy
import io
import pickle

import pytest
import torch

from quantscope.compat.modelopt import HistogramCalibrator, MaxCalibrator

AXES = [None, 0, -1, 1, (0, 1), (0, 2), (0, 1, 2)]


def _batches(n=3, shape=(4, 6, 5)):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(*shape, generator=g) * (i + 1) for i in range(n)]


def _amax(xs, axis) -> torch.Tensor:
    """ModelOpt's definition from first principles: ``max |x|`` over every batch and the axes
    not kept (kept ones keep their size, the others 1; one value: 0-d)."""
    a = torch.stack(xs).abs().amax(0)
    nd = a.dim()
    kept = {k % nd for k in (axis if isinstance(axis, tuple) else (axis,))} \
        if axis is not None else set()
    if len(kept) == nd:  # torch's amax over no dim reduces every one, as ModelOpt's
        kept = set()
    drop = [i for i in range(nd) if i not in kept]
    a = a.amax(dim=drop, keepdim=True) if drop else a
    return a.reshape(()) if a.numel() == 1 else a


def _transports():
    def saved(o):
        buf = io.BytesIO()
        torch.save(o, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)
    return {"deepcopy": copy.deepcopy, "pickle": lambda o: pickle.loads(pickle.dumps(o)),
            "torch.save": saved}


@pytest.mark.parametrize("axis", AXES)
def test_forward_keeps_modelopts_amax_as_collect(axis):
    xs = _batches()
    fwd, col = MaxCalibrator(axis=axis), MaxCalibrator(axis=axis)
    for x in xs:
        assert fwd(x) is x
        col.collect(x)
    want = _amax(xs, axis)
    got = fwd.compute_amax()
    assert got is not None and got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(fwd._calib_amax, want) and torch.equal(col.compute_amax(), want)
    assert torch.equal(fwd.qparams().scale, col.qparams().scale)


@pytest.mark.parametrize("axis", [None, 0, (0, 2)])
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_forward_state_copies_pickles_and_reloads(axis, how):
    xs = _batches(4)
    o = MaxCalibrator(axis=axis)
    o(xs[0])
    o(xs[1])
    c = _transports()[how](o)
    assert torch.equal(c.compute_amax(), _amax(xs[:2], axis))
    c(xs[2])  # goes on from there, as the original does
    o.collect(xs[2])
    assert torch.equal(c.compute_amax(), o.compute_amax())
    assert torch.equal(c.compute_amax(), _amax(xs[:3], axis))


def test_forward_mixes_with_collect_and_keeps_the_dtype_and_shape_rules():
    o = MaxCalibrator(axis=0)
    o(torch.tensor([[1.0, -3.0], [2.0, 0.5]], dtype=torch.float16))
    o.collect(torch.tensor([[0.5, 0.5], [-4.0, 1.0]]))  # float32 after fp16: float32
    want = torch.tensor([[3.0], [4.0]])
    assert o.compute_amax().dtype == torch.float32 and torch.equal(o.compute_amax(), want)
    with pytest.raises(RuntimeError, match="amax shape changed"):
        o(torch.ones(3, 2))  # another amax shape: ModelOpt's error, as at collect


def test_forward_tracks_amaxs_and_reports_nan_at_compute_amax():
    o = MaxCalibrator(axis=0, track_amax=True)
    o(torch.tensor([[1.0, -2.0], [3.0, 0.0]]))
    assert len(o.amaxs) == 1 and o.amaxs[0].tolist() == [[2.0], [3.0]]
    o(torch.tensor([[float("nan"), 1.0], [1.0, 1.0]]))  # recorded, no host read in forward
    with pytest.raises(ValueError, match="NaN or inf"):
        o.compute_amax()


def test_histogram_forward_and_collect_reach_one_state():
    # the histogram's forward already shared collect's state: pinned beside the max's
    xs = [x.flatten() for x in _batches()]
    fwd, col = HistogramCalibrator(num_bins=256), HistogramCalibrator(num_bins=256)
    for x in xs:
        fwd(x)
        col.collect(x)
    for move in _transports().values():
        moved = move(fwd)
        for m in ("entropy", "percentile", "mse"):
            assert torch.equal(moved.compute_amax(m), col.compute_amax(m))


@pytest.mark.peers
@pytest.mark.parametrize("axis", AXES)
def test_forward_amax_is_modelopts_collect(axis):
    calib = pytest.importorskip("modelopt.torch.quantization.calib")
    xs = _batches()
    ref, ours = calib.MaxCalibrator(axis=axis), MaxCalibrator(axis=axis)
    for x in xs:
        ref.collect(x)
        ours(x)
    want, got = ref.compute_amax(), copy.deepcopy(ours).compute_amax()
    assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)


def test_forward_tracks_the_amax_of_a_weight_that_requires_grad():
    """s48 review: ``track_amax=True`` through forward read numpy from a tensor that requires
    grad (every ``nn.Parameter``) and raised; collect (no_grad) took the same weight."""
    w = torch.nn.Parameter(torch.randn(8, 32))
    by_forward, by_collect = MaxCalibrator(axis=0, track_amax=True), \
        MaxCalibrator(axis=0, track_amax=True)
    by_forward(w)
    by_collect.collect(w)
    assert torch.equal(by_forward.compute_amax(), by_collect.compute_amax())
    assert len(by_forward.amaxs) == 1
    assert (by_forward.amaxs[0] == w.detach().abs().amax(1, keepdim=True).numpy()).all()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float16])
def test_forward_returns_its_input(dtype):
    """s48 review: forward returned its float32 upcast, not the input it documents."""
    x = torch.randn(4, 64).to(dtype)
    o = MaxCalibrator(axis=0)
    assert o(x) is x
    amax = o.compute_amax()  # ModelOpt's: the batch's dtype (fp8: float32), axis 0 kept
    assert torch.equal(amax, x.float().abs().amax(1, keepdim=True).to(amax.dtype))
