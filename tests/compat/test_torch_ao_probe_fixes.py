"""compat.torch_ao's HistogramObserver against torch.ao 2.13's, on the torchao2 probe's cases:
a ``.half()`` / ``.bfloat16()`` / ``.double()`` state re-bins in its own dtype, a range that
rounds to the state's max is stored (only one that rounds to inf is refused), a scripted
observer honours ``bins`` set before its first batch, a sparse / mkldnn / nested batch fails
as torch.ao's does, and ``l2_range`` refuses a histogram without bins."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.ao.quantization import observer as ao

from quantscope.compat import torch_ao as qa
from quantscope.estimators.l2 import l2_range
from quantscope.stats.histogram import Hist

F32_MAX = torch.finfo(torch.float32).max


def _both(prep, batches, bins=2048):
    """(ours, torch.ao's) observers after ``batches``, each made by ``prep``."""
    out = []
    for mod in (qa, ao):
        o = prep(mod.HistogramObserver(bins=bins))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for b in batches:
                o(b)
        out.append(o)
    return out


def _assert_same_state(ours, theirs):
    for name in ("histogram", "min_val", "max_val"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), (name, a, b)


# ------------------------------------------------------------------ 1: state dtypes
@pytest.mark.parametrize("cast", ["bfloat16", "half"])
def test_low_precision_state_rebins_as_torch_ao(cast):
    """Growing float32 batches into a bf16 / fp16 state: torch.ao computes the re-binning's
    piece width in the state's dtype (the probe: 22 of 50 bf16 trials differed)."""
    torch.manual_seed(0)
    for _ in range(50):
        batches = [torch.randn(200) * (1.9 ** k) + 0.3 * k for k in range(5)]
        _assert_same_state(*_both(lambda o: getattr(o, cast)(), batches))


def test_bf16_state_qparams_as_torch_ao():
    """The probe's trial whose qparams differed (scale 0.234375 / 132 vs 0.24609375 / 126)."""
    torch.manual_seed(0)
    for _ in range(44):
        batches = [torch.randn(200) * (1.9 ** k) + 0.3 * k for k in range(5)]
    ours, theirs = _both(lambda o: o.bfloat16(), batches)
    _assert_same_state(ours, theirs)
    for a, b in zip(ours.calculate_qparams(), theirs.calculate_qparams()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cast, c, lo, hi, bins", [
    ("double", 5 - 1e-10, 0.0, 10.0, 10),  # float32(c) is 5.0: the next bin
    ("half", 0.0, -4.87, 2.0, 2048),
    ("bfloat16", 0.0, -3.1, 5.3, 971),
    ("half", -0.44372034072875977, -4.869864284992218, 1.9985339045524597, 1745),
])
def test_one_value_state_moves_in_its_dtype(cast, c, lo, hi, bins):
    """A first batch of one value, then a wider one: torch.ao bins the old value (its
    ``min_val``) with histc in the state's dtype."""
    dt = torch.float64 if cast == "double" else torch.float32
    batches = [torch.full((7,), c, dtype=dt), torch.tensor([lo, hi], dtype=dt)]
    _assert_same_state(*_both(lambda o: getattr(o, cast)(), batches, bins))


def test_double_state_keeps_float64_ends_on_a_float32_batch():
    """A float64 state (float64 ends) and then a float32 batch inside it: its ends are
    compared and kept in float64, as torch.ao's (they were rounded to float32 and stored)."""
    batches = [torch.tensor([0.1, 0.3], dtype=torch.float64), torch.tensor([0.2])]
    ours, theirs = _both(lambda o: o.double(), batches, 16)
    _assert_same_state(ours, theirs)
    assert ours.min_val.item() == 0.1


# ------------------------------------------------------------------ 2: the state's max
_ROUNDS_TO_MAX = {
    "half_first": (lambda o: o.half(), [torch.tensor([0.0, 65510.0])]),
    "half_second": (lambda o: o.half(), [torch.tensor([0.0, 1.0]), torch.tensor([0.0, 65510.0])]),
    "half_negative": (lambda o: o.half(), [torch.tensor([-65519.0, 3.0])]),
    "f32_f64_batch": (lambda o: o, [torch.tensor([0.0, F32_MAX * (1 + 2 ** -26)],
                                                 dtype=torch.float64)]),
    "bf16": (lambda o: o.bfloat16(), [torch.tensor([0.0, 3.39e38])]),
}


@pytest.mark.parametrize("case", sorted(_ROUNDS_TO_MAX))
def test_range_rounding_to_the_state_max_is_stored(case):
    """torch.ao stores the rounded value (the state's max) and gives finite qparams."""
    prep, batches = _ROUNDS_TO_MAX[case]
    ours, theirs = _both(prep, batches)
    _assert_same_state(ours, theirs)
    assert bool(torch.isfinite(theirs.max_val) & torch.isfinite(theirs.min_val))
    for a, b in zip(ours.calculate_qparams(), theirs.calculate_qparams()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("prep, x", [
    (lambda o: o.half(), torch.tensor([0.0, 65520.0])),
    # float64 reaches float16 through float32, which rounds this one up to 65520
    (lambda o: o.half(), torch.tensor([0.0, 65519.999], dtype=torch.float64)),
    (lambda o: o, torch.tensor([-2 * F32_MAX, 0.0], dtype=torch.float64)),
    (lambda o: o.bfloat16(), torch.tensor([0.0, F32_MAX])),
])
def test_range_rounding_to_inf_is_refused(prep, x):
    """Where torch.ao would store inf: a clear ValueError, the state left as it was."""
    ours, theirs = prep(qa.HistogramObserver()), prep(ao.HistogramObserver())
    theirs(x)
    assert torch.isinf(theirs.max_val) or torch.isinf(theirs.min_val)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(ValueError, match="rounds to inf"):
        ours(x)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, before[k]), k


# ------------------------------------------------------------------ 3: scripted bins
def test_scripted_observer_honours_bins_set_before_the_first_batch():
    torch.manual_seed(0)
    x = torch.randn(1000)
    got = []
    for mod in (qa, ao):
        o = mod.HistogramObserver()
        o.bins = 256  # after construction, before any batch
        s = torch.jit.script(o)
        s(torch.empty(0))  # an empty batch changes nothing, as torch.ao's
        assert s.histogram.shape == (2048,)
        s(x)
        got.append((s.histogram.clone(), *s.calculate_qparams()))
    assert got[0][0].shape == (256,)
    for a, b in zip(*got):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ 4: layouts
def _jagged():
    return torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.jagged)


_LAYOUTS = {
    "sparse_coo": lambda: torch.randn(2, 3).to_sparse(),
    "sparse_csr": lambda: torch.randn(2, 3).to_sparse_csr(),
    "mkldnn": lambda: torch.randn(2, 3).to_mkldnn(),
    "nested_strided": lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
}


def _error(obs, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's beta-layout warnings
        try:
            obs(x)
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            return e
    return None


@pytest.mark.parametrize("scripted", [False, True])
@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_non_dense_batch_fails_as_torch_ao(layout, scripted):
    make = torch.jit.script if scripted else (lambda o: o)
    x = _LAYOUTS[layout]()
    theirs = _error(ao.HistogramObserver(), x)
    assert theirs is not None
    ours = _error(make(qa.HistogramObserver()), x)
    if scripted:  # TorchScript turns the op's Python error into a RuntimeError (and a
        # nested tensor does not reach the op's Python): the eager run checks the type
        assert isinstance(ours, RuntimeError)
        assert layout == "nested_strided" or "x must be a dense (strided)" in str(ours)
    else:
        assert type(ours) is type(theirs), (ours, theirs)
        assert "x must be a dense (strided) tensor" in str(ours)


def test_jagged_batch_fails_as_torch_ao():
    """Before the fix the C path read the jagged tensor's memory and crashed the interpreter
    (under make test's workers a crash still fails the test: pytest-xdist reports it)."""
    ours, theirs = _error(qa.HistogramObserver(), _jagged()), _error(ao.HistogramObserver(),
                                                                     _jagged())
    assert isinstance(ours, NotImplementedError) and isinstance(theirs, NotImplementedError)
    assert "HistogramObserver: x must be a dense" in str(ours)


# ------------------------------------------------------------------ 5: l2_range
@pytest.mark.parametrize("backend", [None, "torch"])
def test_l2_range_refuses_a_histogram_without_bins(backend):
    h = Hist(torch.zeros((2, 0), dtype=torch.long), torch.tensor([-1.0, 0.0]),
             torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="at least one bin"):
        l2_range(h, 256, backend=backend)
