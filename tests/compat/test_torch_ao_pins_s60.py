"""compat.torch_ao.HistogramObserver against torch.ao where s60's mutants of its tensor-path
histogram step and its search changed behaviour no test saw: a state with only one end at
its start value is torch.ao's ``is_uninitialized`` (the batch's range taken afresh, not a
"loaded inf" refusal), a float64 batch end past float32's max that rounds to it is stored as
that max (torch.ao's ``copy_``; ``fill_`` of the float64 raised), and a float16 / bfloat16
state searches in its own dtype, torch.ao's loop (the float32 vectorized search gave other
qparams). Values, dtypes and exceptions as torch.ao's."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.ao.quantization import HistogramObserver as AOHistogramObserver

from quantscope.compat.torch_ao import HistogramObserver

F32_MAX = torch.finfo(torch.float32).max


def _same(ref, ours):
    for name in ("min_val", "max_val", "histogram"):
        a, b = getattr(ref, name), getattr(ours, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (name, a, b)
    for a, b in zip(ref.calculate_qparams(), ours.calculate_qparams(), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (a, b)


@pytest.mark.parametrize("ends", [(math.inf, 3.0), (-2.0, -math.inf)], ids=["min-inf", "max-inf"])
@pytest.mark.parametrize("batch", ["float64", "float32-with-inf"])
def test_a_state_with_one_end_at_its_start_takes_the_batch_as_torch_ao(ends, batch):
    # torch.ao's is_uninitialized is min_val == inf *or* max_val == -inf; the tensor path
    # (float64 batches, batches holding inf) must not read such a state as a loaded inf one
    x = torch.linspace(-1.0, 2.0, 50, dtype=torch.float64)
    if batch != "float64":
        x = x.float()
        x[7] = math.inf
    ref, ours = AOHistogramObserver(), HistogramObserver()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's "inf detected" warning
        for obs in (ref, ours):  # (a state of its own each: torch.ao's load can alias it)
            obs.load_state_dict({"histogram": torch.zeros(2048),
                                 "min_val": torch.tensor(ends[0]),
                                 "max_val": torch.tensor(ends[1]), "eps": obs.eps.clone()})
            assert (float(obs.min_val), float(obs.max_val)) == ends
            obs(x)
    assert (float(ours.min_val), float(ours.max_val)) == (-1.0, 2.0)
    _same(ref, ours)


@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_a_float64_end_that_rounds_to_float32_max_is_stored_as_max(sign):
    # 2 ** 102 past float32's max is half its last ulp: torch.ao's copy_ rounds it to max
    end = sign * (F32_MAX + 2.0 ** 102)
    x = torch.tensor([end, -sign * 1.0], dtype=torch.float64)
    ref, ours = AOHistogramObserver(), HistogramObserver()
    ref(x)
    ours(x)
    assert float(ours.min_val if sign < 0 else ours.max_val) == sign * F32_MAX
    _same(ref, ours)


@pytest.mark.parametrize("cast", ["half", "bfloat16", "double"])
def test_a_cast_state_searches_in_its_dtype_as_torch_ao(cast):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    ref, ours = AOHistogramObserver(), HistogramObserver()
    for obs in (ref, ours):
        obs(x)
        getattr(obs, cast)()
    _same(ref, ours)  # (a 16-bit state searched by float32's vectorized search: other qparams)
