"""Bad arguments to the ``quantscope::`` ops raise ``ValueError`` naming the op and the
argument, in the real implementation and the fake (``meta``) one alike, before any kernel
runs and without a host read: histograms with no bins (the C kernel wrote bin -1, a heap
corruption) and the Python scalars (``min_scale``, ``qmin`` / ``qmax``, the averaging
constant ``c``, ``count``, ``histc``'s ``lo`` / ``hi``), which gave NaN or garbage."""

from __future__ import annotations

import math

import pytest
import torch

from quantscope import kernels
from quantscope import qparams as Q
from quantscope.kernels import ops
from quantscope.stats import ao_histogram as A
from quantscope.stats import hist_kernel, hist_ops, histogram
from quantscope.stats import minmax as M

NAN, INF = math.nan, math.inf
DEVICES = ["cpu", "meta"]  # meta: the fake implementation, as torch.compile traces it
INT4 = [-8.0, 7.0, 1e-8, 0.0, 0.0]  # kernels.qparams_consts' [qmin, qmax, min_scale, sym, zp]


def _consts(i, value):
    consts = list(INT4)
    consts[i] = value
    return consts


def _raises(call, op, name, forbid_host_sync):
    forbid_host_sync()  # the checks read nothing back from the device
    with pytest.raises(ValueError, match=rf"quantscope::{op}: {name}") as err:
        call()
    return err


# ---- histograms with no bins -------------------------------------------------------------------

class _NoKernel:
    """A kernel library whose every call fails the test (instead of writing out of bounds)."""

    def __getattr__(self, name):
        raise AssertionError(f"hist_kernel called the C kernel {name} with no bins")


def _binned(*args, **kwargs):
    raise AssertionError("hist_add reached histogram.bin_values with no bins")


@pytest.fixture
def no_c_kernel(monkeypatch):
    monkeypatch.setattr(hist_kernel, "_kernel", _NoKernel)
    monkeypatch.setattr(histogram, "bin_values", _binned)


def _hist_args(device, bins):
    int64 = torch.zeros(3, dtype=torch.int64, device=device)
    return torch.zeros(3, bins, dtype=torch.int64, device=device), int64, int64.clone()


@pytest.mark.parametrize("device", DEVICES)
def test_hist_add_refuses_counts_without_bins(device, forbid_host_sync, no_c_kernel):
    counts, exp, first = _hist_args(device, 0)
    units = torch.randn(3, 64).to(device)
    err = _raises(lambda: hist_ops.hist_add(counts, units, exp, first, False), "hist_add",
                  "counts", forbid_host_sync)
    assert "bins >= 1" in str(err.value) and "(3, 0)" in str(err.value)


@pytest.mark.parametrize("device", DEVICES)
def test_hist_regrid_refuses_counts_without_bins(device, forbid_host_sync, no_c_kernel):
    counts, exp, first = _hist_args(device, 0)
    f32 = torch.zeros(3, device=device)
    _raises(lambda: hist_ops.hist_regrid_(counts, exp, first, f32, f32, f32, f32 + 1, False),
            "hist_regrid_", "counts", forbid_host_sync)


def test_hist_kernel_does_not_apply_without_bins(no_c_kernel):
    counts, exp, first = _hist_args("cpu", 0)
    f32 = torch.zeros(3)
    assert hist_kernel.bin_values(counts, torch.randn(3, 64), exp, first, False) is False
    assert hist_kernel.regrid((counts, exp, first, f32, f32), f32, f32 + 1, False) is None
    one = (counts[:1], exp[:1], first[:1], f32[:1], f32[:1])
    assert hist_kernel.fused_update(one, torch.randn(1, 64), False) is None


def test_hist_add_with_one_bin_still_counts():
    counts, exp, first = _hist_args("cpu", 1)
    hist_ops.hist_add(counts, torch.zeros(3, 5), exp, first, False)
    assert counts.tolist() == [[5], [5], [5]]


@pytest.mark.parametrize("kernel", [True, False])
def test_hist_add_refuses_inference_counts_outside_inference_mode(kernel, monkeypatch):
    """Found by probing: the C kernel wrote through ``data_ptr()`` into counts made under
    ``torch.inference_mode``, where the torch path (and torch) refuse the in-place update."""
    if kernel and not kernels.available("hist_kernel"):
        pytest.skip("no C kernel")
    if not kernel:
        monkeypatch.setattr(hist_kernel, "_kernel", lambda: None)
    with torch.inference_mode():
        counts = torch.zeros(3, 8, dtype=torch.int64)
    exp, first = torch.full((3,), -3), torch.full((3,), -8)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        hist_ops.hist_add(counts, torch.randn(3, 5), exp, first, False)
    # (torch, too, raises after its in-place op wrote: counts are not asserted untouched)
    with torch.inference_mode():  # inside it, the write is the caller's to make
        before = counts.sum()
        hist_ops.hist_add(counts, torch.randn(3, 5), exp, first, False)
        assert counts.sum() == before + 15


# ---- int_qparams / nvfp4_qparams ---------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("i", "value", "name"), [
    (2, NAN, "min_scale"), (2, -1.0, "min_scale"), (2, 0.0, "min_scale"), (2, INF, "min_scale"),
    (2, 1e39, "min_scale"), (1, INF, "qmax"), (0, -INF, "qmin"),
    (4, NAN, "the symmetric zero point"),
    (4, 100.0, "the symmetric zero point"),
    # found by probing: fractional codes, codes past int32 (every zero point came back
    # INT32_MIN) or past float32 (a RuntimeError, or a Triton dtype error) were taken
    (0, -8.5, "qmin"), (1, 7.5, "qmax"), (0, -3e9, "qmin"), (1, 3e9, "qmax"),
    (0, -1e39, "qmin"), (4, 0.5, "the symmetric zero point")])
def test_int_qparams_refuses_bad_consts(device, i, value, name, forbid_host_sync):
    lo, hi = -torch.ones(4, device=device), torch.ones(4, device=device)
    _raises(lambda: Q.int_qparams_op(lo, hi, _consts(i, value)), "int_qparams",
            rf"consts\[{i}\] \({name}", forbid_host_sync)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flag", [0.5, 2.0, -1.0, NAN])
def test_int_qparams_refuses_a_symmetric_flag_not_0_or_1(device, flag, forbid_host_sync):
    """consts[3] is qparams_consts' 0.0 / 1.0: any other value (which the torch branch's
    ``if symmetric`` and Triton's ``bool`` would take as true) is refused, not guessed."""
    lo, hi = -torch.ones(4, device=device), torch.ones(4, device=device)
    _raises(lambda: Q.int_qparams_op(lo, hi, _consts(3, flag)), "int_qparams",
            r"consts must be kernels.qparams_consts' \[qmin, qmax, min_scale, symmetric",
            forbid_host_sync)


def test_int_qparams_takes_what_qparams_consts_gives():
    from quantscope import QuantSpec, kernels

    for spec in (QuantSpec("int8"), QuantSpec("uint8"), QuantSpec("int4", symmetric=False),
                 QuantSpec("int8", quant_min=-127, quant_max=127),
                 QuantSpec("uint8", quant_max=127, eps=1e-30)):
        scale, _ = Q.int_qparams_op(-torch.ones(2), torch.ones(2), kernels.qparams_consts(spec))
        assert scale.gt(0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("min_scale", [NAN, -1.0, INF, 1e39])
def test_nvfp4_qparams_refuses_bad_min_scale(device, min_scale, forbid_host_sync):
    lo, hi = -torch.ones(4, device=device), torch.ones(4, device=device)
    _raises(lambda: Q.nvfp4_qparams_op(lo, hi, None, "fp4", min_scale), "nvfp4_qparams",
            "min_scale", forbid_host_sync)


# ---- minmax_update / minmax_observe ------------------------------------------------------------

EMA, MIN = M.UPDATES["ema"], M.UPDATES["min"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kind", "c"), [(EMA, NAN), (EMA, 5.0), (EMA, 0.0), (EMA, -0.5),
                                         (M.UPDATES["ema_lerp"], INF), (MIN, NAN)])
def test_minmax_update_refuses_bad_c(device, kind, c, forbid_host_sync):
    lo, hi = -torch.ones(4, device=device), torch.ones(4, device=device)
    state = torch.zeros(4, device=device), torch.zeros(4, device=device)
    _raises(lambda: M.minmax_update(lo, hi, *state, kind, c), "minmax_update", r"c\b",
            forbid_host_sync)


def _observe_args(device):
    return (torch.randn(4, 8).to(device), torch.zeros(4, device=device),
            torch.zeros(4, device=device), torch.zeros(1, dtype=torch.bool, device=device),
            torch.zeros(1, dtype=torch.int64, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("c", "count", "name"), [(NAN, 8, r"c\b"), (1.5, 8, r"c\b"),
                                                  (0.5, -1, "count")])
def test_minmax_observe_refuses_bad_scalars(device, c, count, name, forbid_host_sync):
    args = _observe_args(device)
    _raises(lambda: M.minmax_observe(*args, EMA, c, count), "minmax_observe", name,
            forbid_host_sync)


def test_minmax_ops_take_the_observers_constants():
    """The observers pass 0.0 as ``c`` for ``"min"`` and their averaging constant (0, 1]."""
    args = _observe_args("cpu")
    M.minmax_observe(*args, MIN, 0.0, 8)
    M.minmax_observe(*args, EMA, 1.0, 0)
    assert args[4].item() == 8
    M.minmax_update(-torch.ones(4), torch.ones(4), args[1], args[2], EMA, 0.01)


# ---- fake_quant_int ----------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("qmin", "qmax", "name"), [(-INF, 7.0, "qmin"), (NAN, 7.0, "qmin"),
                                                    (-8.0, INF, "qmax"), (-8.0, NAN, "qmax")])
def test_fake_quant_int_refuses_bad_bounds(device, qmin, qmax, name, forbid_host_sync):
    units = torch.randn(4, 8).to(device)
    scale, zp = torch.ones(4, device=device), torch.zeros(4, device=device)
    _raises(lambda: ops.fake_quant_int(units, scale, zp, qmin, qmax), "fake_quant_int", name,
            forbid_host_sync)


# probing: fractional bounds were taken, and gave codes that are not integers (3.5, 7.25)
FRACTIONAL = [(-3.5, 3.5, "qmin must be an integer code"), (-8.0, 7.25, "qmax must be an integer"),
              (-8.0, 7.0 + 2**-40, "qmax must be an integer")]
# probing: whole numbers past float32's range failed inside torch.clamp on the CPU and turned
# inf in the Triton kernels
PAST_FLOAT32 = [(-8.0, 1e39, "qmax must be a finite number in"),
                (-1e39, 7.0, "qmin must be a finite number in")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("qmin", "qmax", "name"), [*FRACTIONAL, *PAST_FLOAT32])
def test_fake_quant_int_refuses_fractional_bounds(device, qmin, qmax, name, forbid_host_sync):
    units = torch.randn(4, 8).to(device)
    scale, zp = torch.ones(4, device=device), torch.zeros(4, device=device)
    _raises(lambda: ops.fake_quant_int(units, scale, zp, qmin, qmax), "fake_quant_int", name,
            forbid_host_sync)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("qmin", "qmax", "name"),
                         [*FRACTIONAL, *PAST_FLOAT32, (-INF, 7.0, "qmin must be a finite"),
                          (-8.0, NAN, "qmax")])
def test_mse_price_int_refuses_bad_bounds(device, qmin, qmax, name, forbid_host_sync):
    units = torch.randn(4, 8).to(device)
    scale = torch.ones(2, 4, device=device)
    zp = torch.zeros(2, 4, dtype=torch.int32, device=device)
    _raises(lambda: ops.mse_price_int(units, scale, zp, qmin, qmax), "mse_price_int", name,
            forbid_host_sync)


def test_whole_float_bounds_stay_accepted():
    """The callers pass ``float(spec.qmin)``: whole floats are integer codes."""
    units = torch.tensor([[10.0, -10.0, 0.26]])
    out = ops.fake_quant_int(units, torch.ones(1), torch.zeros(1), -4.0, 3.0)
    assert out.tolist() == [[3.0, -4.0, 0.0]]
    err = ops.mse_price_int(units, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32),
                            -4.0, 3.0)
    assert err.shape == (1, 1)


# ---- ao_histc ----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("lo", "hi", "name"), [(1.0, 0.0, "hi"), (NAN, 1.0, "lo"),
                                                (0.0, NAN, "hi"), (-INF, 0.0, "lo"),
                                                (0.0, INF, "hi"), (0.0, 1e39, "hi")])
def test_ao_histc_refuses_what_torch_histc_refuses(device, lo, hi, name, forbid_host_sync):
    with pytest.raises(RuntimeError):  # torch.histc's own refusal: the fake now agrees
        torch.histc(torch.ones(3), 8, lo, hi)
    x = torch.ones(3, device=device)
    _raises(lambda: A.ao_histc(x, 8, lo, hi), "ao_histc", f"{name} must be",
            forbid_host_sync)


def test_ao_histc_takes_an_empty_range_as_torch_histc_does():
    x = torch.tensor([1.0, 1.0, 2.0])
    assert torch.equal(A.ao_histc(x, 4, 1.0, 1.0), torch.histc(x, 4, 1.0, 1.0))
    assert A.ao_histc(x.to("meta"), 4, 1.0, 1.0).shape == (4,)


# ---- nvfp4_mse / nvfp4_search: their CUDA paths launch Triton without nvfp4_qparams' check ---

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["nvfp4_mse", "nvfp4_search"])
@pytest.mark.parametrize("min_scale", [NAN, -1.0, INF])
def test_nvfp4_searches_refuse_bad_min_scale(device, op, min_scale, forbid_host_sync):
    units = torch.randn(4, 16).to(device)
    lo, hi = units.amin(1), units.amax(1)
    factors, ga = torch.ones(3, device=device), torch.ones(1, device=device)
    args = (units, lo, hi, factors, lo, hi, ga, "fp4_e2m1", min_scale)
    call = (lambda: ops.nvfp4_mse(*args, 3, -1, False, False, False)) if op == "nvfp4_mse" \
        else (lambda: ops.nvfp4_search(*args))
    _raises(call, op, "min_scale", forbid_host_sync)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["uint8", "uint4"])
def test_mx_mse_refuses_unsigned_integer_elements(device, fmt, forbid_host_sync):
    """Pin (s61 mutation): MX's element formats are float or signed integer ones (MXINT8,
    BFP: E8M0 block scales with codes around 0); an unsigned one is refused naming it, on
    the CPU and in the fake alike, where a search over it returned a result."""
    units = torch.randn(3, 16).to(device)
    lo, hi = units.amin(1), units.amax(1)
    factors = torch.tensor([1.0, 0.9, 0.8], device=device)
    err = _raises(lambda: ops.mx_mse(units, lo, hi, factors, lo, hi, fmt, "floor", 3, -1,
                                     False, False, False), "mx_mse", "format", forbid_host_sync)
    assert str(err.value).endswith(f"format must be a float or a signed integer format, got "
                                   f"{fmt!r}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dst_nbins", [0, 1, -3])
def test_ao_histogram_search_refuses_bad_dst_nbins(device, dst_nbins, forbid_host_sync):
    """Found by probing (s35): the fake took 0 bins (tracing passed), the real op raised
    under l2_range's name."""
    from quantscope.compat import torch_ao_steps  # noqa: F401 (registers the op)

    hist = torch.ones(8, device=device)
    lo, hi = torch.tensor(-1.0, device=device), torch.tensor(1.0, device=device)
    _raises(lambda: torch.ops.quantscope.ao_histogram_search(hist, lo, hi, dst_nbins),
            "ao_histogram_search", "dst_nbins", forbid_host_sync)


def test_the_code_range_limit_is_float32s_whatever_the_default_dtype():
    """Found by review (s35): the limit was torch.finfo() of the default dtype when
    quantscope was imported, so under float64 codes past float32's range passed."""
    import subprocess
    import sys

    code = ("import torch; torch.set_default_dtype(torch.float64)\n"
            "from quantscope._checks import check_code_range\n"
            "try:\n    check_code_range('w', -1e300, 1e300)\nexcept ValueError:\n    print('refused')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "refused"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mbits", [0, 3, 23])
def test_mse_price_fp_takes_min_exp_down_to_a_normal_rounding_step(device, mbits,
                                                                    forbid_host_sync):
    """Pin (s62 mutation P3): ``min_exp`` runs down to ``mbits - 126``, where the rounding
    step ``2 ** (min_exp - mbits)`` is float32's least normal ``2 ** -126``; one lower makes
    it subnormal and is refused naming ``min_exp``, on the CPU and in the fake alike (a
    mutant bounded it at ``mbits - 127`` and priced it)."""
    units = torch.randn(2, 8).to(device)
    scale = torch.ones(3, 2, device=device)
    err = ops.mse_price_fp(units, scale, 448.0, mbits - 126, mbits)
    assert err.shape == (3, 2) and err.dtype == torch.float64
    _raises(lambda: ops.mse_price_fp(units, scale, 448.0, mbits - 127, mbits), "mse_price_fp",
            "min_exp", forbid_host_sync)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["nvfp4_mse", "nvfp4_search", "mx_mse"])
def test_block_searches_refuse_no_factors(device, op, forbid_host_sync):
    """Pin (s62 mutation B4): a block search over no candidate factors is refused naming
    ``factors`` ("a non-empty 1-D float32 tensor"), on the CPU and in the fake alike; a
    mutant that took them returned every unit's incumbent (index -1) as if searched."""
    units = torch.randn(3, 16).to(device)
    lo, hi = units.amin(1), units.amax(1)
    factors, ga = torch.ones(0, device=device), torch.ones(1, device=device)
    nvfp4 = (units, lo, hi, factors, lo, hi, ga, "fp4_e2m1", 1e-8)
    call = {"nvfp4_mse": lambda: ops.nvfp4_mse(*nvfp4, 0, -1, False, False, False),
            "nvfp4_search": lambda: ops.nvfp4_search(*nvfp4),
            "mx_mse": lambda: ops.mx_mse(units, lo, hi, factors, lo, hi, "fp8_e4m3", "floor", 0,
                                         -1, False, False, False)}[op]
    _raises(call, op, "factors", forbid_host_sync)


@pytest.mark.parametrize("device", DEVICES)
def test_unit_minmax_of_4d_units_takes_no_units_in_the_second_dim(device):
    """Pin (s62 mutation O1): 4-D ``[U1, U2, E1, E2]`` units need elements (``E1 * E2 > 0``),
    not units: ``U2 == 0`` is ``U1 * U2 = 0`` units and two empty ranges, as for 2-D units
    with no rows; a mutant tested ``shape[1:]`` and refused it as "no element per unit"."""
    units = torch.empty(2, 0, 3, 4, device=device)
    lo, hi = ops.unit_minmax(units)
    assert lo.shape == hi.shape == (0,) and lo.dtype == hi.dtype == torch.float32
    with pytest.raises(ValueError, match="at least one element per unit"):
        ops.unit_minmax(torch.empty(2, 3, 0, 4, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_unit_minmax_refuses_a_tensor_without_elements_under_its_name(
        device, forbid_host_sync):
    """Pin (s62 mutation O3): a ``[U, 0]`` tensor in the group is refused by the group's
    check, naming ``units[i]``, on the CPU and in the fake alike; a mutant without the test
    raised ``unit_minmax``'s error on the CPU and traced it (the fake) to two empty results."""
    units = [torch.randn(2, 4, device=device), torch.empty(3, 0, device=device)]
    _raises(lambda: ops.grouped_unit_minmax(units), "grouped_unit_minmax", r"units\[1\]",
            forbid_host_sync)
