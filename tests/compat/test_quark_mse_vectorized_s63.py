"""``PerTensorMSEObserver``'s MSE search prices its candidates in chunks (compat/quark_mse.py),
where Quark's loop prices one at a time. Its answer must be the loop's bit for bit: every
candidate's float32-rounded error the same, the first least one picked (Quark's argmin), over
the dtypes Quark's search takes, symmetric or not, float16 / bfloat16 / float32 / float64
histograms and eps buffers (module casts), scale_type, stride / start_bin, rows ``[U, B]``,
and ties (constant counts, many empty bins, one non-empty bin, none)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantscope.compat import quark, quark_mse

DTYPES = ["int4", "uint4", "int8", "uint8", "fp8_e4m3", "fp8_e5m2"]
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def quark_loop(obs, calib_hist, calib_bin_edges, stride=1, start_bin=2045):
    """Quark's ``get_min_max_by_mse`` as Quark writes it, row by row: one candidate at a time,
    ``((q(center) - center) ** 2 * calib_hist).mean()``, the first least error; the start bin
    held to the last centre (quantscope's rule for short grids). Returns (best, errors)."""
    hist = calib_hist if calib_hist.is_floating_point() else calib_hist.float()
    best, errors = [], []
    for h, e in zip(hist.reshape(-1, hist.shape[-1]),
                    calib_bin_edges.reshape(-1, calib_bin_edges.shape[-1]), strict=True):
        center = (e[1:] + e[:-1]) / 2
        min_value = torch.tensor(0)
        mses, arguments = [], []
        for i in range(min(start_bin, max(0, len(center) - 1)), len(center), stride):
            if obs.spec.is_float:
                quant_center = obs.scaling_fp8(center, center[i])
            else:
                quant_center = obs.int_fake_tensor_quant(center, min_value, center[i])
            mses.append(((quant_center - center) ** 2 * h).mean())
            arguments.append(i)
        mses = torch.stack(mses)
        best.append(center[arguments[int(torch.argmin(mses))]])
        errors.append(mses)
    best = torch.stack(best)
    return (best[0] if calib_hist.dim() == 1 else best), errors


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values and dtypes, NaN where NaN (its payload aside)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) \
        and torch.equal(a[~a.isnan()], b[~b.isnan()])


def make_counts(kind: str, rows: int, bins: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "constant":
        return torch.full((rows, bins), 7.0)
    if kind == "none":
        return torch.zeros(rows, bins)
    if kind == "one":
        counts = torch.zeros(rows, bins)
        counts[:, torch.randint(bins, (1,), generator=g)] = 3.0
        return counts
    counts = torch.randint(0, 50, (rows, bins), generator=g).float()
    if kind == "sparse":  # many empty bins
        counts *= torch.rand(rows, bins, generator=g) < 0.1
    return counts


@st.composite
def searches(draw, dtype: str):
    """An observer (qspec, module cast) and get_min_max_by_mse's arguments."""
    is_int = not dtype.startswith("fp8")
    qspec = {"dtype": dtype, "symmetric": draw(st.booleans())}
    if is_int:
        qspec["scale_type"] = draw(st.sampled_from([None, "float16", "bfloat16", "float32"]))
    obs = quark.PerTensorMSEObserver({k: v for k, v in qspec.items() if v is not None})
    obs.to(draw(st.sampled_from(FLOATS)))  # the eps buffer's dtype (Quark's module cast)
    bins = draw(st.sampled_from([2, 7, 63, 64, 65, 130, 257]))
    rows = draw(st.sampled_from([0, 1, 2]))  # 0: a 1-D histogram
    hist_dtype, edge_dtype = draw(st.sampled_from(FLOATS)), draw(st.sampled_from(FLOATS))
    hi = draw(st.sampled_from([1e-3, 0.37, 1.0, 45.5, 3000.0]))
    lo = -hi * draw(st.sampled_from([0.0, 0.25, 1.0]))  # an asymmetric grid's [min, max]
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64).to(edge_dtype)
    counts = make_counts(draw(st.sampled_from(["random", "sparse", "constant", "one", "none"])),
                         max(rows, 1), bins, draw(st.integers(0, 99))).to(hist_dtype)
    centers = (edges[1:] + edges[:-1]) / 2
    first = int((centers < 0).sum()) if is_int else 0  # Quark's int pricing: centres >= 0
    start_bin = draw(st.integers(min(first, bins - 1), bins + 2))
    stride = draw(st.integers(1, 3))
    if not rows:
        return obs, counts[0], edges, stride, start_bin
    return obs, counts, edges.expand(rows, -1), stride, start_bin


def assert_search_is_quarks(obs, counts, edges, stride, start_bin):
    try:
        expected, errors = quark_loop(obs, counts, edges, stride, start_bin)
    except (ValueError, RuntimeError) as e:  # the loop raises: the search too, alike
        with pytest.raises(type(e)):
            obs.get_min_max_by_mse(counts, edges, stride, start_bin)
        return
    if not obs.spec.is_float or not bool((expected < 0).any()):
        mn, best = obs.get_min_max_by_mse(counts, edges, stride, start_bin)
        assert same_bits(best, expected), (best, expected)
        assert not bool(mn.any())
    else:  # fp8's best below 0: refused after the search (Quark's scale of it is 0)
        with pytest.raises(ValueError, match="negative"):
            obs.get_min_max_by_mse(counts, edges, stride, start_bin)
    # every candidate's error, not only the argmin's
    h = counts.reshape(-1, counts.shape[-1])
    h = h if h.is_floating_point() else h.float()
    for row, e, loop_errors in zip(h, edges.reshape(-1, edges.shape[-1]), errors, strict=True):
        centers = (e[1:] + e[:-1]) / 2
        amax = centers[min(start_bin, max(0, centers.numel() - 1))::stride]
        assert same_bits(quark_mse.candidate_mses(obs, centers, row, amax), loop_errors)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_chunked_search_is_quarks_loop(dtype, data):
    """Random histograms: the chunked errors and argmin are the loop's, bit for bit (a small
    chunk: several chunks per search)."""
    chunk = data.draw(st.sampled_from([1, 500, quark_mse._CHUNK]))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quark_mse, "_CHUNK", chunk)
        assert_search_is_quarks(*data.draw(searches(dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["constant", "none", "one", "sparse"])
def test_ties_pick_quarks_first(dtype, kind):
    """Ties (equal counts, no counts, one count, mostly empty): Quark's first least error;
    a zero centre (fp8: 0 / 0 errors, NaN, which argmin takes first) among the candidates."""
    obs = quark.PerTensorMSEObserver({"dtype": dtype, "symmetric": False})
    edges = torch.linspace(-1.0, 1.0, 130)  # an odd bin count: a centre at exactly 0
    counts = make_counts(kind, 1, 129, 3)[0]
    assert_search_is_quarks(obs, counts, edges, 1, 64)
    assert_search_is_quarks(obs, counts, edges.abs().cummax(0).values, 2, 0)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "fp8_e4m3"])
def test_long_rows_take_the_loops_mean(dtype):
    """Rows past the 1-D sum's parallel grain (where several threads split the loop's sum)
    and rows shorter than a SIMD vector: each row's own 1-D mean, the loop's."""
    obs = quark.PerTensorMSEObserver({"dtype": dtype})
    for bins, start in ((40_000, 39_996), (5, 0)):
        edges = torch.linspace(0.0, 2.0, bins + 1)
        counts = make_counts("random", 1, bins, 5)[0]
        assert_search_is_quarks(obs, counts, edges, 1, start)


@pytest.mark.parametrize("dtype", FLOATS)
def test_rows_fake_quantize_as_atens_per_tensor_kernel(dtype):
    """The chunks' fake-quantizer, row by row, is torch's per-tensor one at the edges too:
    products past int64 / float range, NaN input (the kernel's fmax takes quant_min), a zero
    scale (1 / 0), subnormal and huge scales, zero points at both ends, halves to even."""
    big = torch.finfo(dtype).max
    x = torch.tensor([0.0, -0.0, 0.5, 1.5, 2.5, -2.5, 126.5, -128.5, 1e-3, 3.0, -7.0, big,
                      -big, float("nan"), 1e30 if dtype != torch.float16 else 6e4]).to(dtype)
    scale = torch.tensor([1.0, 0.1, 1e-3, 0.0, 1e-40, 3e38, 0.75, 2.0 ** -20])
    for qmin, qmax, zps in ((-128, 127, (0, -128, 127, 5)), (0, 255, (0, 255, 7)),
                            (-8, 7, (0, -8)), (0, 15, (15, 0))):
        for z in zps:
            zp = torch.full(scale.shape, z, dtype=torch.int32)
            rows = quark_mse.per_tensor_rows(x, scale, zp, qmin, qmax)
            for row, s in zip(rows, scale, strict=True):
                kernel = torch.fake_quantize_per_tensor_affine(x, s, torch.tensor(z), qmin, qmax)
                assert same_bits(row, kernel), (qmin, qmax, z, s, row, kernel)
