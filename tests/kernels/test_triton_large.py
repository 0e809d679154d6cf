"""Triton kernels on a unit past 2 ** 31 elements (a 405B model's lm_head per tensor is
128256 x 16384 = 2.1e9): element offsets must be int64, or the last chunk's column index
wraps negative and reads before the tensor. 4.3 GB of bf16 each: CUDA only (the interpreter
would take minutes per test); bench/gpu_check.sh runs them on a lent GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (4.3 GB tensors)", allow_module_level=True)

N = 2 ** 31 + 4096  # the last 4096 elements lie past int32's reach


def _tensor(tail: float, head: float) -> torch.Tensor:
    x = torch.zeros(N, dtype=torch.bfloat16, device="cuda")
    x[7], x[-5] = head, tail
    return x


def test_unit_minmax_reads_the_elements_past_2_31():
    from quantscope.kernels.triton.minmax import unit_minmax

    x = _tensor(tail=3.0, head=-2.0)
    lo, hi = unit_minmax(x.view(1, -1))
    assert (lo.item(), hi.item()) == (-2.0, 3.0)
    lo, hi = unit_minmax(x.view(1, 1, N // 4096, 4096))  # the 4-D view's offsets alike
    assert (lo.item(), hi.item()) == (-2.0, 3.0)


def test_hist_add_bins_the_elements_past_2_31():
    from quantscope.kernels.triton.histogram import hist_add
    from quantscope.stats import histogram as H

    x = _tensor(tail=1.0, head=0.5).view(1, -1)
    state = H._update_grid(H.empty_state(1, 64, "cuda"), torch.zeros(1, device="cuda"),
                           torch.ones(1, device="cuda"), False)
    want = torch.zeros_like(state.counts)
    H._add_values_torch(want, torch.tensor([[0.0, 0.5, 1.0]], device="cuda"), state.exp,
                        state.first, False)
    counts = state.counts.clone()
    hist_add(counts, x, state.exp, state.first, False)
    assert int(counts.sum()) == N
    nonzero = (want > 0).nonzero()[:, 1]  # the bins of 0, 0.5 and 1.0
    assert counts[0, nonzero].tolist() == [N - 2, 1, 1]
