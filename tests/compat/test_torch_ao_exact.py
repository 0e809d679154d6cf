"""compat.torch_ao behaves as torch.ao.quantization 2.13 does (issue 34), each behaviour
checked against the installed torch.ao: no-data defaults, dtypes and code ranges,
float qparams, any bin count, is_dynamic, buffers kept in place, state_dict keys and
loading both ways, and TorchScript (script, save, load) of every class."""

from __future__ import annotations

import io

import pytest
import torch
from torch.ao import quantization as tq

from quantscope.compat import torch_ao as qa
from quantscope.estimators.l2 import l2_range
from quantscope.stats.histogram import Hist

CLASSES = ["MinMaxObserver", "MovingAverageMinMaxObserver", "PerChannelMinMaxObserver",
           "MovingAveragePerChannelMinMaxObserver", "HistogramObserver"]
PER_CHANNEL = {"PerChannelMinMaxObserver", "MovingAveragePerChannelMinMaxObserver"}


def pair(kind, **kw):
    return getattr(tq, kind)(**kw), getattr(qa, kind)(**kw)


def data(n=4, seed=0, shape=(4, 6, 5)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * (i + 1) + 0.4 * i for i in range(n)]


def same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
    assert torch.equal(a, b), (a, b)


def same_qparams(ref, ours):
    for a, b in zip(ref.calculate_qparams(), ours.calculate_qparams()):
        same(a, b)


def observe(observers, batches):
    for x in batches:
        for o in observers:
            assert o(x) is x


@pytest.mark.parametrize("kind", CLASSES)
def test_no_data_gives_torch_defaults_with_a_warning(kind):
    ref, ours = pair(kind)
    with pytest.warns(UserWarning, match="must run observer"):
        got = ours.calculate_qparams()
    with pytest.warns(UserWarning):
        want = ref.calculate_qparams()
    for a, b in zip(want, got):
        same(a, b)
    assert got[0].tolist() == [1.0] and got[1].tolist() == [0]


@pytest.mark.parametrize("dtype", [torch.qint32, torch.int32, torch.int16, torch.uint16,
                                   torch.qint8, torch.uint8])
@pytest.mark.parametrize("qscheme", [torch.per_tensor_affine, torch.per_tensor_symmetric])
@pytest.mark.parametrize("kind", ["MinMaxObserver", "MovingAverageMinMaxObserver"])
def test_dtypes_and_their_code_ranges(kind, dtype, qscheme):
    ref, ours = pair(kind, dtype=dtype, qscheme=qscheme)
    assert (ours.quant_min, ours.quant_max) == (ref.quant_min, ref.quant_max)
    observe((ref, ours), [x * 2 ** 16 for x in data()])
    same_qparams(ref, ours)


@pytest.mark.parametrize("dtype", [torch.qint8, torch.quint8, torch.int16, torch.uint16,
                                   torch.qint32])
@pytest.mark.parametrize("custom", [None, (-8, 7), (0, 15)])
def test_reduce_range_rules(dtype, custom):
    kw = {} if custom is None else dict(zip(("quant_min", "quant_max"), custom))
    if custom and custom[0] < 0 and dtype in (torch.quint8, torch.uint16):
        kw = {"quant_min": 0, "quant_max": 15}
    with pytest.warns(UserWarning, match="reduce_range"):
        ref, ours = pair("MinMaxObserver", dtype=dtype, reduce_range=True, **kw)
    assert (ours.quant_min, ours.quant_max) == (ref.quant_min, ref.quant_max)
    observe((ref, ours), data())
    same_qparams(ref, ours)


def test_symmetric_reduce_range_accepted_and_refused_as_torch():
    # torch refuses symmetric reduce_range for quint8 only, and accepts it for uint8
    for dtype in (torch.quint8,):
        for cls in (tq.MinMaxObserver, qa.MinMaxObserver):
            with pytest.raises(NotImplementedError):
                cls(dtype=dtype, qscheme=torch.per_tensor_symmetric, reduce_range=True)
    ref, ours = pair("MinMaxObserver", dtype=torch.uint8, qscheme=torch.per_tensor_symmetric,
                     reduce_range=True)
    observe((ref, ours), data())
    same_qparams(ref, ours)


@pytest.mark.parametrize("dtype", [torch.quint8, torch.quint4x2])
@pytest.mark.parametrize("kind", sorted(PER_CHANNEL))
@pytest.mark.parametrize("ch_axis", [0, 2])
def test_per_channel_affine_float_qparams(kind, dtype, ch_axis):
    ref, ours = pair(kind, dtype=dtype, qscheme=torch.per_channel_affine_float_qparams,
                     ch_axis=ch_axis)
    observe((ref, ours), data())
    _, zp = ours.calculate_qparams()
    assert zp.dtype == torch.float32
    same_qparams(ref, ours)


@pytest.mark.parametrize("bins", [1, 2, 3, 8, 10, 2048])
@pytest.mark.parametrize("qscheme", [torch.per_tensor_affine, torch.per_tensor_symmetric])
def test_histogram_any_bin_count(bins, qscheme):
    ref, ours = pair("HistogramObserver", bins=bins, qscheme=qscheme)
    observe((ref, ours), data(6, seed=bins))
    same(ref.histogram, ours.histogram)
    same_qparams(ref, ours)


@pytest.mark.parametrize("kind", CLASSES)
def test_is_dynamic_accepted_and_refused_as_torch(kind):
    kw = {"averaging_constant": 1} if kind == "MovingAverageMinMaxObserver" else {}
    try:
        ref = getattr(tq, kind)(is_dynamic=True, **kw)
    except NotImplementedError:
        with pytest.raises(NotImplementedError):
            getattr(qa, kind)(is_dynamic=True, **kw)
        return
    ours = getattr(qa, kind)(is_dynamic=True, **kw)
    assert ours.is_dynamic and ref.is_dynamic
    observe((ref, ours), data())
    same_qparams(ref, ours)


@pytest.mark.parametrize("kind", CLASSES)
@pytest.mark.parametrize("extra", [{}, {"is_dynamic": True},
                                   {"qscheme": torch.per_channel_affine},
                                   {"qscheme": torch.per_tensor_affine}])
def test_several_wrong_arguments_raise_what_torch_raises_first(kind, extra):
    """torch.ao checks the qscheme, then ``is_dynamic``, then the dtype: with several wrong,
    the first one's exception type is torch's. A wrong dtype is an ``AssertionError`` as
    torch's and a ``ValueError`` as quantscope's."""
    kw = {"dtype": torch.float16, **extra}
    with pytest.raises(Exception) as want:
        getattr(tq, kind)(**kw)
    with pytest.raises(want.type) as got:
        getattr(qa, kind)(**kw)
    if want.type is AssertionError:
        assert isinstance(got.value, ValueError) and "dtype must be one of" in str(got.value)


@pytest.mark.parametrize("dtype", [torch.qint32, torch.int32])
@pytest.mark.parametrize("qscheme", [torch.per_tensor_affine, torch.per_tensor_symmetric])
def test_histogram_of_int32_codes_equals_torch(dtype, qscheme):
    """int32 codes search with ``dst_nbins = 2 ** 32`` (torch.ao's ``2 ** bits``), on the C
    walk (the class's) and on the torch path."""
    ref, ours = pair("HistogramObserver", dtype=dtype, qscheme=qscheme)
    observe((ref, ours), [x ** 3 for x in data(3, seed=5)])
    assert ours.dst_nbins == 2 ** 32
    same_qparams(ref, ours)
    hist = Hist(ours.histogram[None], ours.min_val.reshape(1), ours.max_val.reshape(1))
    for a, b in zip(ref._non_linear_param_search(), l2_range(hist, 2 ** 32, backend="torch")):
        same(a.reshape(1), b)


@pytest.mark.parametrize("kind", CLASSES)
def test_buffers_modified_in_place(kind):
    ours = getattr(qa, kind)(dtype=torch.qint8)
    before = [id(v) for v in ours._buffers.values()]
    observe((ours,), data(5, shape=(4, 4, 4)) + [torch.randn(4, 4, 4) * 100])
    assert [id(v) for v in ours._buffers.values()] == before


@pytest.mark.parametrize("kind", CLASSES)
def test_state_dict_keys_and_loading_both_ways_bitwise(kind):
    keys = ["eps", "min_val", "max_val"] if kind != "HistogramObserver" else \
        ["eps", "histogram", "min_val", "max_val"]
    ref, ours = pair(kind)
    assert sorted(ours.state_dict()) == sorted(keys) == sorted(ref.state_dict())
    observe((ref, ours), data())
    for src, dst_cls in ((ref, getattr(qa, kind)), (ours, getattr(tq, kind))):
        buf = io.BytesIO()
        torch.save(src.state_dict(), buf)
        buf.seek(0)
        dst = dst_cls()
        dst.load_state_dict(torch.load(buf))
        for k in keys:
            same(src.state_dict()[k], dst.state_dict()[k])
        same_qparams(src, dst)
    observe((ref, ours), data(2, seed=3))  # and both go on alike
    same_qparams(ref, ours)


@pytest.mark.parametrize("kind", CLASSES)
@pytest.mark.parametrize("qscheme", ["affine", "symmetric"])
def test_scripted_saved_and_loaded_equals_eager_and_torch(kind, qscheme):
    prefix = "per_channel_" if kind in PER_CHANNEL else "per_tensor_"
    kw = {"qscheme": getattr(torch, prefix + qscheme), "dtype": torch.qint8}
    ref, eager = pair(kind, **kw)
    scripted = torch.jit.script(getattr(qa, kind)(**kw))
    batches = data(4, shape=(3, 8, 5))
    observe((ref, eager, scripted), batches)
    buf = io.BytesIO()
    torch.jit.save(scripted, buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    for o in (eager, scripted, loaded):
        same_qparams(ref, o)
        same(ref.min_val, o.min_val)
    if kind == "HistogramObserver":
        same(ref.histogram, scripted.histogram)
        loaded(batches[0] * 3)  # the loaded module runs quantscope's op too
        ref(batches[0] * 3)
        same(ref.histogram, loaded.histogram)
        same_qparams(ref, loaded)


def test_scripted_observers_are_found_by_torch_ao_prepare_jit():
    # torch.ao finds scripted observers by the words "quantization.observer" in their name
    for kind in CLASSES:
        s = torch.jit.script(getattr(qa, kind)())
        assert tq.observer._is_activation_post_process(s)
        assert tq.observer._is_per_channel_script_obs_instance(s) == (kind in PER_CHANNEL)


@pytest.mark.parametrize("inf", [float("inf"), float("-inf")])
def test_non_finite_as_torch(inf):
    """torch.ao drops both infinities (``x.abs() != inf``): the batch's other values are
    binned, and its min is theirs (-7), not -inf; a NaN is refused."""
    ref, ours = pair("HistogramObserver")
    observe((ref, ours), data(2))
    x = torch.tensor([1.0, inf, -7.0])
    for o in (ref, ours):
        with pytest.warns(UserWarning, match="torch.inf detected"):
            o(x)
    same(ref.histogram, ours.histogram)
    assert float(ref.min_val) == float(ours.min_val) == -7.0
    for o in (ref, ours):
        with pytest.raises(RuntimeError, match="not finite"):
            o(torch.tensor([float("nan"), 1.0]))
    same(ref.histogram, ours.histogram)
    same_qparams(ref, ours)


def test_reset_restores_the_new_state_in_place():
    for kind in CLASSES:
        fresh, ours = getattr(qa, kind)(), getattr(qa, kind)()
        ids = [id(v) for v in ours._buffers.values()]
        observe((ours,), data(2))
        ours.reset()
        assert not ours.has_observed and [id(v) for v in ours._buffers.values()] == ids
        for k, v in fresh.state_dict().items():
            same(v, ours.state_dict()[k])


def test_spec_translates_torch_arguments():
    from quantscope import Channel

    o = qa.PerChannelMinMaxObserver(ch_axis=1, dtype=torch.qint8, reduce_range=True)
    assert o.spec.layout == Channel(1) and (o.spec.qmin, o.spec.qmax) == (-64, 63)
    for dtype, custom in ((torch.qint8, (-20, 30)), (torch.int16, None), (torch.uint16, None)):
        kw = dict(zip(("quant_min", "quant_max"), custom)) if custom else {}
        o = qa.MinMaxObserver(dtype=dtype, reduce_range=True, **kw)
        assert (o.spec.qmin, o.spec.qmax) == (o.quant_min, o.quant_max)
        assert o.spec == qa.torch_ao_spec(dtype, reduce_range=True, **kw)
    with pytest.raises(ValueError, match="16 bits"):
        _ = qa.MinMaxObserver(dtype=torch.qint32).spec


@pytest.mark.parametrize("kind", CLASSES)
def test_qparams_is_calculate_qparams_as_quantscope_qparams(kind):
    from quantscope import fake_quantize

    ours = getattr(qa, kind)(dtype=torch.qint8)
    with pytest.raises(ValueError, match="before any tensor"):
        ours.qparams()
    x = data(1)[0]
    ours(x)
    qp = ours.qparams()
    scale, zp = ours.calculate_qparams()
    same(qp.scale, scale.float())
    same(qp.zero_point, zp.to(torch.int32))
    assert torch.isfinite(fake_quantize(x, qp, ours.spec)).all()


@pytest.mark.parametrize("kind", sorted(set(CLASSES) - {"HistogramObserver"}))
def test_min_max_classes_record_non_finite_as_torch_and_qparams_refuses_it(kind):
    ref, ours = pair(kind)
    x = torch.tensor([[1.0, float("inf")], [float("nan"), 2.0]])
    observe((ref, ours), [x])
    assert torch.equal(ref.min_val.isnan(), ours.min_val.isnan())
    with pytest.raises(ValueError, match="NaN or inf"):
        ours.qparams()


@pytest.mark.parametrize("kind", CLASSES)
def test_qparams_refuses_a_finite_range_whose_scale_overflows(kind):
    # probing: [-3e38, 3e38] is finite, but its asymmetric scale is inf (NaN for the
    # histogram); torch.ao's calculate_qparams returns it, quantscope's qparams() returned it
    # too, and fake_quantize with it gave NaN
    ref, ours = pair(kind)
    x = torch.tensor([[3.0e38, -3.0e38], [1.0, 2.0]])
    observe((ref, ours), [x])
    for a, b in zip(ref.calculate_qparams(), ours.calculate_qparams()):
        assert a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num())  # torch.ao's
    with pytest.raises(ValueError, match=r"gives a scale float32 cannot hold"):
        ours.qparams()


def test_a_batch_of_only_plus_inf_is_observed_non_finite_data():
    # it left min_val at +inf, and qparams() said nothing was observed
    ours = qa.MinMaxObserver()
    ours(torch.tensor([float("inf"), float("inf")]))
    assert ours.has_observed
    with pytest.raises(ValueError, match="observed NaN or inf"):
        ours.qparams()


def test_histogram_nan_batch_is_a_runtime_error_as_torch_and_a_value_error():
    ours = qa.HistogramObserver()
    ours(torch.randn(100))
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    for kind in (RuntimeError, ValueError):
        with pytest.raises(kind, match="NaN"):
            ours(torch.tensor([1.0, float("nan")]))
    for k, v in ours.state_dict().items():  # left as it was (torch.ao writes NaN into it)
        same(state[k], v)


def test_the_torchscript_ops_pass_torch_library_opcheck():
    hist, lo, hi = torch.zeros(64), torch.tensor(float("inf")), torch.tensor(float("-inf"))
    x = torch.randn(300)
    torch.library.opcheck(torch.ops.quantscope.ao_histogram_observe.default, (x, hist, lo, hi))
    torch.ops.quantscope.ao_histogram_observe(x, hist, lo, hi)
    ref = tq.HistogramObserver(bins=64)
    ref(x)
    same(ref.histogram, hist)
    torch.library.opcheck(torch.ops.quantscope.ao_histogram_search.default, (hist, lo, hi, 256))
    for a, b in zip(torch.ops.quantscope.ao_histogram_search(hist, lo, hi, 256),
                    ref._non_linear_param_search()):
        same(a, b)


def test_float64_state_searches_in_float64_as_torch():
    """After ``.double()`` torch.ao compares and prices its search in float64: the eager
    class, a scripted one (quantscope::ao_histogram_search) and the op equal it bitwise,
    and the op's fake gives the real output's dtype (opcheck)."""
    ref, ours = (o.double() for o in pair("HistogramObserver", bins=64))
    scripted = torch.jit.script(qa.HistogramObserver(bins=64)).double()
    observe((ref, ours, scripted), [x.double() for x in data(3, seed=11, shape=(16, 16))])
    for o in (ours, scripted):
        same(ref.histogram, o.histogram)
        for a, b in zip(ref._non_linear_param_search(), o._non_linear_param_search()):
            same(a, b)
        same_qparams(ref, o)
    args = (ours.histogram, ours.min_val, ours.max_val, ours.dst_nbins)
    torch.library.opcheck(torch.ops.quantscope.ao_histogram_search.default, args)
    assert torch.ops.quantscope.ao_histogram_search(*args)[0].dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_and_bfloat16_state_searches_as_torch(dtype):
    """``model.half()`` / ``.bfloat16()`` with the observer attached casts torch.ao's
    buffers: torch.ao then searches in that dtype; the eager and scripted classes equal it
    bitwise (float32 batches, before and after the cast)."""
    ref, ours = pair("HistogramObserver", bins=256)
    scripted = torch.jit.script(qa.HistogramObserver(bins=256))
    first, *rest = data(3, seed=5, shape=(64, 64))
    observe((ref, ours, scripted), [first])
    for o in (ref, ours, scripted):
        o.to(dtype)  # what .half() / .bfloat16() do (a ScriptModule has only .to)
    for batches in ([], rest):  # right after the cast, then after more batches
        observe((ref, ours, scripted), batches)
        for o in (ours, scripted):
            same(ref.histogram, o.histogram)
            same(ref.min_val, o.min_val)
            same_qparams(ref, o)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_histogram_of_other_float_dtypes_equals_torch(dtype):
    """float64 batches are binned as torch.ao bins them; bfloat16 / float16 ones as torch.ao
    bins their float32 values (the class's one deliberate difference)."""
    ref, ours = pair("HistogramObserver")
    for i, x in enumerate(data(4, seed=7, shape=(40, 50))):
        x = x.to(dtype) * (1.5 if i % 2 else 0.7)
        ref(x if dtype == torch.float64 else x.float())
        ours(x)
        same(ref.histogram, ours.histogram)
        same(ref.min_val, ours.min_val)
    same_qparams(ref, ours)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_batches_lose_no_counts(dtype):
    """torch.ao bins a bfloat16 / float16 batch in that dtype: ``histc``'s positions and
    counts round there, so a bin stops counting near 256 (bfloat16) or 2048 (float16) values
    (most of these batches lost in bfloat16, a few counts off in float16). The compat class
    counts every value."""
    ref, ours = pair("HistogramObserver")
    batches = [x.to(dtype) for x in data(4, seed=3, shape=(16, 256, 256))]
    for x in batches:
        ref(x)
        ours(x)
    total = sum(x.numel() for x in batches)
    assert float(ours.histogram.sum()) == total
    # if this fails, torch.ao counts every value now: the class's difference can go
    assert float(ref.histogram.sum()) != total
    if dtype == torch.bfloat16:
        assert float(ref.histogram.sum()) < 0.5 * total


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_histogram_on_cuda_equals_torch_on_cuda(dtype):
    """On CUDA the histc is torch's of float32 copies of ``2 ** 24`` values at a time
    (``quantscope::ao_histc``): torch.ao's CUDA histogram of the float32 values, bitwise.
    The range is set by the first batch (a widening one would move the old bins with
    torch.bincount's float atomics, in an order neither side controls)."""
    ref, ours = pair("HistogramObserver")
    ref, ours = ref.cuda(), ours.cuda()
    for i, x in enumerate(data(4, seed=5, shape=(64, 512))):
        x = (x * (1.0 if i == 0 else 0.3)).clamp(-5, 5).cuda()
        x[0, 0], x[0, 1] = -5.0, 5.0
        ref(x.float() if dtype == torch.float32 else x.to(dtype).float())
        ours(x.to(dtype))
        same(ref.histogram, ours.histogram)
        same(ref.min_val, ours.min_val)
    same_qparams(ref, ours)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_widening_histogram_on_cuda_matches_torch_on_cuda():
    """Batches that widen the range move the old bins on the device (linspaces on the
    state's device, as torch.ao's): the ends equal torch.ao's, the counts to the rounding
    order of torch.bincount's float atomics, which neither side controls."""
    ref, ours = pair("HistogramObserver")
    ref, ours = ref.cuda(), ours.cuda()
    for x in data(4, seed=6, shape=(64, 512)):
        ref(x.cuda())
        ours(x.cuda())
        same(ref.min_val, ours.min_val)
        same(ref.max_val, ours.max_val)
        torch.testing.assert_close(ours.histogram, ref.histogram, rtol=1e-5, atol=1e-3)


def test_histogram_tensor_path_reads_back_once_a_batch(monkeypatch):
    """The torch path (other devices; float64 here) takes its decisions on the batch's and
    the state's ends read back in one transfer, where torch.ao reads a flag back for each:
    on a GPU each read waits for the device."""
    reads = []
    for name in ("__bool__", "item", "__float__", "tolist", "__int__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _real=real, _n=name: reads.append(_n) or _real(self, *a))
    ref, ours = pair("HistogramObserver")
    batches = [x.double() for x in data(3, seed=9, shape=(40, 50))]  # the last two widen
    for x in batches:
        reads.clear()
        ours(x)
        assert reads == ["tolist"], reads
    monkeypatch.undo()
    for x in batches:
        ref(x)
    same(ref.histogram, ours.histogram)
    same_qparams(ref, ours)


def test_compiled_histogram_observer_is_torch_aos_bit_for_bit():
    """dynamo skips torch.ao's observers (they run eagerly); ours was traced, and inductor's
    linspace in the re-binning of a widened range moved counts (2 bins of 2048 off)."""
    torch.manual_seed(8)
    batches = [torch.randn(512) * float(torch.rand(1) * 10) + float(torch.randn(1) * 3)
               for _ in range(2)]
    ours, ref = qa.HistogramObserver(), tq.HistogramObserver()
    compiled = torch.compile(ours)
    for x in batches:
        compiled(x)
        ref(x)
    for name in ("histogram", "min_val", "max_val"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    assert all(torch.equal(a, b) for a, b in zip(ours.calculate_qparams(),
                                                 ref.calculate_qparams(), strict=True))


@pytest.mark.parametrize("kind", ["HistogramObserver", "MinMaxObserver"])
def test_state_made_in_inference_mode_refuses_updates_outside_it_as_torch(kind):
    for cls in (getattr(tq, kind), getattr(qa, kind)):
        with torch.inference_mode():
            obs = cls()
            obs(torch.randn(64))
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
            obs(torch.randn(64) * 3)


def test_histogram_refuses_a_float64_batch_past_its_float32_state():
    """torch.ao stores +inf (and later returns a NaN scale); the compat class raised torch's
    'cannot be converted to type float without overflow' with the histogram and min_val
    already written. Now a ValueError naming the range, and the state left as it was."""
    obs = qa.HistogramObserver()
    obs(torch.tensor([-2.0, 3.0]))
    before = {k: v.clone() for k, v in obs.state_dict().items()}
    with pytest.raises(ValueError, match=r"range \[-1, 4e\+38\] exceeds the observer's "
                                         r"torch.float32 state"):
        obs(torch.tensor([-1.0, 4e38], dtype=torch.float64))
    for k, v in obs.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_histogram_bins_set_before_the_first_batch_as_torch_ao():
    """torch.ao's forward bins into ``self.bins``: set after construction, it sizes the
    histogram (quantscope's kept 2048 bins and its qparams raised torch.ao's bins check)."""
    xs = [torch.randn(500, generator=torch.Generator().manual_seed(s)) * (1 + 2 * s)
          for s in range(2)]
    theirs, ours = tq.HistogramObserver(), qa.HistogramObserver()
    for o in (theirs, ours):
        o.bins = 128
        for x in xs:
            o(x)
    assert ours.histogram.shape == theirs.histogram.shape == (128,)
    assert torch.equal(ours.histogram, theirs.histogram)
    for a, b in zip(ours.calculate_qparams(), theirs.calculate_qparams(), strict=True):
        assert torch.equal(a, b)
