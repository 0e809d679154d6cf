"""The Triton implementations of the ops that write their arguments in place leave a tensor
made under ``torch.inference_mode`` to the torch path when called outside it (probe s39):
they wrote it through its pointer, where torch and the CPU path raise (the C kernels'
``kernels.writable`` rule). Under the interpreter on CPU tensors, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import fresh_interpreter_test

from quantscope.stats import hist_ops, minmax

test_in_a_fresh_interpreter = fresh_interpreter_test(__file__)

INFERENCE = "Inplace update to inference tensor outside InferenceMode"


def _calls(device):
    """name -> (the op's CUDA implementation, a function making its written tensors, the call
    given them)."""
    units = torch.randn(3, 5, device=device)
    lo, hi = torch.aminmax(units, dim=1)
    return {
        "hist_add": (hist_ops._cuda_hist_add,
                     lambda: (torch.zeros(3, 8, dtype=torch.int64, device=device),),
                     lambda f, w: f(w[0], units, torch.full((3,), -3, device=device),
                                    torch.full((3,), -8, device=device), False)),
        "minmax_update": (minmax._cuda_minmax_update,
                          lambda: (lo - 1, hi + 1),
                          lambda f, w: f(lo * 2, hi * 2, *w, minmax.UPDATES["min"], 0.0)),
        "record_non_finite": (minmax._cuda_record_non_finite,
                              lambda: (torch.zeros((), dtype=torch.bool, device=device),),
                              lambda f, w: f(lo, hi.clone().fill_(float("inf")), *w)),
        "minmax_observe": (minmax._cuda_minmax_observe,
                           lambda: (lo - 1, hi + 1, torch.zeros((), dtype=torch.bool,
                                                                 device=device),
                                    torch.zeros((), dtype=torch.int64, device=device)),
                           lambda f, w: f(units * 2, *w, minmax.UPDATES["min"], 0.0, 3)),
    }


@pytest.mark.parametrize("name", ["hist_add", "minmax_update", "record_non_finite",
                                  "minmax_observe"])
def test_inference_state_written_outside_inference_mode_raises(device, name):
    op, make, call = _calls(device)[name]
    with torch.inference_mode():
        written = make()
        kept = [t.clone() for t in written]
    with pytest.raises(RuntimeError, match=INFERENCE):
        call(op, written)
    if name == "minmax_observe":  # the torch path raises at its first write, of seen: the
        # kernel had updated the state first
        assert torch.equal(written[0], kept[0]) and torch.equal(written[1], kept[1])
    with torch.inference_mode():  # inside it, the write is the caller's to make
        written = make()
        before = [t.clone() for t in written]
        call(op, written)
    assert any(not torch.equal(a, b) for a, b in zip(before, written, strict=True))


@pytest.mark.parametrize("name,which", [("minmax_update", 0), ("minmax_observe", 2),
                                        ("minmax_observe", 3)])
def test_one_inference_tensor_among_the_written_raises(device, name, which):
    # any written tensor made under inference mode leaves the call to the torch path
    op, make, call = _calls(device)[name]
    written = list(make())
    with torch.inference_mode():
        written[which] = written[which].clone()
    with pytest.raises(RuntimeError, match=INFERENCE):
        call(op, tuple(written))
