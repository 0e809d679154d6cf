"""The C kernels read only tensors with memory (kernels.real): FakeTensors, functorch-wrapped
tensors (vmap, grad), meta tensors and traces (torch.jit.trace, make_fx, torch.compile) take
the torch path, which works there; the host-read value checks of qdq are skipped where there
are no values; a meta observer's qparams raise a ValueError naming it."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import quantscope
from quantscope import QParams, QuantSpec, kernels, presets

needs_kernel = pytest.mark.skipif(not kernels.available("unit_minmax"),
                                  reason="no C kernel (no compiler or QUANTSCOPE_NO_KERNEL)")


def _dynamic_model(seed: int = 0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 128))
    calib = quantscope.calibrate(m, [torch.randn(8, 128) for _ in range(2)],
                                 quantscope.calibrate.preset("w8a8-dynamic"), progress=False)
    return m, calib


def test_the_rule_tells_tensors_with_memory_from_those_without():
    t, p = torch.zeros(4), torch.nn.Parameter(torch.zeros(4))
    assert kernels.real(t, p) and kernels.plain(t) and kernels.plain(p) and kernels.real()
    assert not kernels.real(torch.empty(4, device="meta"))
    with FakeTensorMode() as fm:
        fake = fm.from_tensor(t)
        assert not kernels.real() and not kernels.plain(t)  # fresh tensors here are fakes
    assert not kernels.plain(fake) and kernels.real()  # a fake outside its mode
    seen = []
    torch.func.vmap(lambda u: seen.append((kernels.real(u), kernels.real())) or u)(
        torch.zeros(2, 3))
    assert seen == [(False, False)]
    torch.jit.trace(lambda u: seen.append(kernels.real(u)) or u * 2, (t,), check_trace=False)
    assert seen[-1] is False
    with pytest.raises(ValueError, match="kernels.read / write"):
        kernels.read(fake)


_FAKE_CHILD = textwrap.dedent("""
    import warnings, torch, quantscope
    from torch._subclasses.fake_tensor import FakeTensorMode
    warnings.filterwarnings("ignore")
    names = ("static_minmax", "memoryless_minmax", "minmax", "histogram", "entropy", "mse")
    for name in names:
        for spec in (quantscope.QuantSpec("int8", "channel"), quantscope.QuantSpec("int8")):
            with FakeTensorMode(allow_non_fake_inputs=True) as fm:
                for shape in ((16, 64), (256, 512)):  # small (step kernel) and large
                    try:
                        quantscope.get_observer(name, spec)(fm.from_tensor(torch.randn(shape)))
                    except Exception:  # the MSE search's torch path has data-dependent
                        assert name == "mse"  # shapes: a Python error, not a crash
    fm = FakeTensorMode(allow_non_fake_inputs=True)
    outside = fm.from_tensor(torch.randn(16, 64))
    try:  # a fake outside its mode: a clear error, not a C read of no memory
        quantscope.get_observer("mse", quantscope.QuantSpec("int8", "channel"))(outside)
        raise SystemExit("no error for a fake outside its mode")
    except ValueError as e:
        assert "FakeTensor outside its FakeTensorMode" in str(e), e
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 128))
    calib = quantscope.calibrate(m, [torch.randn(8, 128)],
                                 quantscope.calibrate.preset("w8a8-dynamic"), progress=False)
    with calib.apply(m):
        with FakeTensorMode(allow_non_fake_inputs=True) as fm:
            y = m(fm.from_tensor(torch.randn(5, 128)))
    print("shape", tuple(y.shape), type(y).__name__)
""")


@needs_kernel
def test_observers_and_an_applied_model_on_fake_tensors_run_the_torch_path():
    # a child process: the old code died of SIGSEGV (the kernels wrote to a fake's data_ptr)
    r = subprocess.run([sys.executable, "-c", _FAKE_CHILD], capture_output=True, text=True,
                       check=False, timeout=600)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "shape (5, 128) FakeTensor" in r.stdout


def test_vmap_and_jacrev_over_a_dynamic_model():
    m, calib = _dynamic_model()
    xs = torch.randn(3, 5, 128)
    with calib.apply(m):
        loop = torch.stack([m(x) for x in xs])
        batched = torch.func.vmap(m)(xs)  # the old code: "Cannot access data pointer"
        jac = torch.func.jacrev(m)(xs[0, :2])
    # (vmap's batched matmul rounds its own way: an ulp or so off the loop's)
    torch.testing.assert_close(batched, loop, rtol=0, atol=1e-5)
    assert jac.shape == (2, 128, 2, 128) and torch.isfinite(jac).all()


def test_jit_trace_of_a_dynamic_model_equals_eager_on_a_new_input():
    m, calib = _dynamic_model()
    x, x2 = torch.randn(5, 128), torch.randn(5, 128) * 3
    with calib.apply(m):
        with pytest.warns(torch.jit.TracerWarning):  # (its own host reads of flags)
            traced = torch.jit.trace(m, (x,), check_trace=False)
        eager = m(x2)
        got = traced(x2)
    # the old trace recorded the kernel's scratch as constants: NaN / far off here
    assert torch.equal(got, eager)


@pytest.mark.parametrize("spec", [QuantSpec("int8", "channel"), QuantSpec("int4", "group:32"),
                                  presets.NVFP4, QuantSpec("fp8_e4m3", "tensor")],
                         ids=str)
@pytest.mark.parametrize("fake_qparams", [False, True])
def test_fake_quantize_and_quantize_on_fakes_skip_the_value_checks(spec, fake_qparams):
    x = torch.randn(16, 64)
    obs = quantscope.get_observer("memoryless_minmax", spec)
    obs(x)
    qp = obs.calculate_qparams()
    refs = quantscope.fake_quantize(x, qp, spec), quantscope.quantize(x, qp, spec)
    with FakeTensorMode(allow_non_fake_inputs=True) as fm:
        if fake_qparams:
            gs = qp.global_scale
            qp = QParams(fm.from_tensor(qp.scale), fm.from_tensor(qp.zero_point),
                         None if gs is None else fm.from_tensor(gs))
        # the old code: DataDependentOutputException from the checks' host read
        got = (quantscope.fake_quantize(fm.from_tensor(x), qp, spec),
               quantscope.quantize(fm.from_tensor(x), qp, spec))
        if qp.scale.numel() > 1:  # the shapes are still checked
            with pytest.raises(ValueError, match="units"):
                quantscope.fake_quantize(fm.from_tensor(torch.randn(8, 64)), qp, spec)
    for g, r in zip(got, refs):
        assert (g.shape, g.dtype, g.stride()) == (r.shape, r.dtype, r.stride())


def test_a_meta_observers_qparams_raise_naming_it():
    o = quantscope.get_observer("memoryless_minmax", QuantSpec("int8", "channel")).to("meta")
    o(torch.empty(16, 64, device="meta"))
    with pytest.raises(ValueError, match=r"MemorylessMinMaxObserver\(.*meta device.*no "
                                         r"statistics"):
        o.calculate_qparams()


@needs_kernel
def test_eager_cpu_tensors_still_take_the_kernels():
    assert kernels.lib("unit_minmax") is not None
    count = torch.zeros((), dtype=torch.int64)
    assert kernels.add(count, 5) and int(count) == 5 and count._version == 1
    assert not kernels.add(torch.zeros(1), 1)  # float32: the caller adds with a torch op


@needs_kernel
@pytest.mark.parametrize("threads", [1, 3])
def test_the_minmax_kernels_return_zero_as_declared(threads):
    """qs_unit_minmax / qs_col_minmax are typed as every kernel is (int64 return,
    kernels.SIGNATURES): they return 0, not whatever the return register held (they were
    void), and their ranges are torch.aminmax's."""
    lib = kernels.lib("unit_minmax")
    torch.manual_seed(0)
    for U in (1, 5):  # one unit: its elements split over the threads
        x = torch.randn(U, 4099) * 1e3
        lo, hi, ends = torch.empty(U), torch.empty(U), torch.empty(2)
        rc = lib.qs_unit_minmax(x.data_ptr(), U, x.shape[1], lo.data_ptr(), hi.data_ptr(),
                                ends.data_ptr(), threads, 0, 0.0, None, None, 0)
        ref = torch.aminmax(x, dim=1)
        assert rc == 0
        assert torch.equal(lo, ref.min) and torch.equal(hi, ref.max)
        assert ends.tolist() == [ref.min.min().item(), ref.max.max().item()]
    m = torch.randn(257, 33)
    lo, hi, work = torch.empty(33), torch.empty(33), torch.empty(threads * 5 * 33)
    rc = lib.qs_col_minmax(m.data_ptr(), 1, 257, 33, lo.data_ptr(), hi.data_ptr(),
                           work.data_ptr(), threads, threads, 1, 0)
    ref = torch.aminmax(m, dim=0)
    assert rc == 0
    assert torch.equal(lo, ref.min) and torch.equal(hi, ref.max)
