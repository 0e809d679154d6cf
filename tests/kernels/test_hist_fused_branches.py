"""csrc/hist_kernel.c's fused pass on its scalar and AVX2 branches gives the native build's
state, short batches (counted straight into the window) and long ones (the int32 copies).

The native build (AVX-512 on this project's machines) is checked against the torch path in
tests/kernels/test_histogram_kernel.py; CI machines without AVX-512 run the AVX2 branch, and
machines without AVX2 the scalar one, so each is built here and compared with it.
"""

import pytest
import torch
from march_builds import CC, build, cpu_has

from quantscope.stats import hist_kernel
from quantscope.stats import histogram as H

pytestmark = pytest.mark.skipif(CC is None or hist_kernel._kernel() is None,
                                reason="no C compiler or no native kernel")


def _fused(so, state, x, absolute, threads):
    """The C call of hist_kernel.fused_update: (miss, new state, lo, hi, ends)."""
    B = state[0].shape[1]
    new = (torch.zeros(1, B, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
           torch.zeros(1, dtype=torch.int64), torch.zeros(1), torch.zeros(1))
    lo, hi, ends = torch.zeros(1), torch.zeros(1), torch.zeros(2)
    miss = so.qs_hist_fused(x.data_ptr(), x.numel(), B, int(absolute),
                            *(t.data_ptr() for t in state), *(t.data_ptr() for t in new),
                            lo.data_ptr(), hi.data_ptr(), ends.data_ptr(), threads)
    return miss, new, lo, hi, ends


@pytest.mark.parametrize("march, flag", [("x86-64", "sse2"), ("haswell", "avx2")])
def test_branch_fused_pass_equals_the_native_build(march, flag, tmp_path):
    if not cpu_has(flag):
        pytest.skip(f"this CPU cannot run -march={march} code")
    branch, native = build("hist_kernel", march, tmp_path), hist_kernel._kernel()
    g = torch.Generator().manual_seed(5)
    hits = 0
    for n in (1, 15, 17, 600, 2048, 6143, 12289, 70_000):  # direct below 2 x the window
        for absolute in (False, True):
            seed = torch.randn(1, n, generator=g)
            state = H.update(H.empty_state(1, 256), seed, seed.amin(1), seed.amax(1), absolute)
            for scale in (0.5, 1.7, 2.5, 100.0):
                x = torch.randn(1, n, generator=g) * scale
                x.view(-1)[::7] = -0.0
                for threads in (1, 2):
                    a, b = _fused(branch, state, x, absolute, threads), \
                        _fused(native, state, x, absolute, threads)
                    assert a[0] == b[0], (n, absolute, scale)
                    if a[0] == 0:  # a hit: every output written
                        hits += 1
                        assert all(torch.equal(p, q) for p, q in zip(a[1], b[1]))
                        assert all(torch.equal(p, q) for p, q in zip(a[2:], b[2:]))
    assert hits >= 40
