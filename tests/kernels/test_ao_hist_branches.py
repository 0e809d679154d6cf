"""csrc/ao_hist.c's scalar and AVX2 branches give the native build's bins, bit for bit.

The native build (AVX-512 on this project's machines) is checked against torch's ops in
tests/compat/test_ao_histogram.py; CI machines without AVX-512 run the AVX2 branch, and
machines without AVX2 the scalar one, so each is built here (once: the ``branch`` fixture)
and compared with it.
"""

import pytest
import torch
from march_builds import CC, build, cpu_has

from quantscope.stats import ao_histogram

pytestmark = pytest.mark.skipif(CC is None or ao_histogram._kernel() is None,
                                reason="no C compiler or no native kernel")


@pytest.fixture(scope="module", params=[("x86-64", "sse2"), ("haswell", "avx2")],
                ids=["scalar", "avx2"])
def branch(request, tmp_path_factory):
    """The kernel built for the branch (once per module), where this CPU can run it."""
    march, flag = request.param
    if not cpu_has(flag):
        pytest.skip(f"this CPU cannot run -march={march} code")
    return build("ao_hist", march, tmp_path_factory.mktemp(march))


def _histc(so, x, bins, lo, hi, base, threads):
    out = torch.empty(bins)
    assert so.qs_ao_histc(x.data_ptr(), x.numel(), lo, hi, bins, base.data_ptr(),
                          out.data_ptr(), threads) == 0
    return out


def _fused(so, x, bins, lo, hi, base, threads):
    out, mm = torch.empty(bins), torch.empty(2)
    miss = so.qs_ao_fused(x.data_ptr(), x.numel(), lo, hi, bins, base.data_ptr(),
                          out.data_ptr(), mm.data_ptr(), threads)
    return miss, mm, (out if miss == 0 else None)


def test_branch_bins_and_ranges_equal_the_native_build(branch):
    native = ao_histogram._kernel()
    g = torch.Generator().manual_seed(3)
    for n in (1, 15, 17, 4099, 600_001):  # the last on 2 threads
        x = torch.randn(n, generator=g) * 3
        x[: n // 5] = -2.0  # on the left edge
        x[n // 5: n // 4] = 2.5  # on the right edge
        if n > 100:
            x[50], x[-3] = 9.0, float("nan")  # outside, and NaN (neither counted)
        base = torch.rand(777, generator=g)
        for threads in (1, 2):
            a = _histc(branch, x, 777, -2.0, 2.5, base, threads)
            assert torch.equal(a, _histc(native, x, 777, -2.0, 2.5, base, threads))
            for lo, hi in ((-2.0, 2.5), (-20.0, 20.0)):
                ma, mb = _fused(branch, x, 777, lo, hi, base, threads), \
                    _fused(native, x, 777, lo, hi, base, threads)
                assert ma[0] == mb[0]
                assert torch.equal(ma[1], mb[1]) or (ma[1].isnan() == mb[1].isnan()).all()
                assert (ma[2] is None) == (mb[2] is None)
                if ma[2] is not None:
                    assert torch.equal(ma[2], mb[2])
            ra, rb = torch.empty(2), torch.empty(2)  # the min / max pass
            branch.qs_ao_minmax(x.data_ptr(), n, ra.data_ptr(), threads)
            native.qs_ao_minmax(x.data_ptr(), n, rb.data_ptr(), threads)
            assert torch.equal(ra, rb) or (ra.isnan() == rb.isnan()).all()


def test_branch_int64_histc_equals_the_native_build(branch):
    """qs_ao_histc64 (the first-grid histograms' histc of |x| or x into int64 counts; the
    native build is checked against linear_counts in tests/compat/test_modelopt_first_step.py)
    on the scalar and AVX2 branches."""
    native = ao_histogram._kernel()
    g = torch.Generator().manual_seed(4)
    for n in (1, 15, 17, 4099, 600_001):  # the last on 2 threads
        x = torch.randn(n, generator=g) * 3
        x[: n // 5] = -2.0  # |x| on an edge
        x[n // 5: n // 4] = -0.0
        if n > 100:
            x[50], x[-3] = 9.0, float("nan")  # outside, and NaN (neither counted)
        for absolute, lo in ((1, 0.0), (0, -2.0)):
            for threads in (1, 2):
                a, b = (torch.full((777,), 3, dtype=torch.int64) for _ in range(2))
                for so, counts in ((branch, a), (native, b)):
                    assert so.qs_ao_histc64(x.data_ptr(), n, lo, 2.5, 777, counts.data_ptr(),
                                            absolute, threads) == 0
                assert torch.equal(a, b)
