"""The ``quantscope::`` ops have no autograd formula (probe s33): given an input that requires
grad, torch's fallback gave the output a gradient of zero (``fake_quant_int``) or whatever the
torch path's ops gave (``unit_minmax``), with a deprecation warning at most. Now each op
refuses such an input while grad mode is on, naming itself and the way out; detached, or
under ``torch.no_grad()``, it computes what it computed."""

import pytest
import torch
from test_triton_ops import _cases


def _with_grad(args):
    """``args`` with the first floating-point tensor (in a list too) requiring grad."""
    out, done = [], False
    for a in args:
        if not done and isinstance(a, torch.Tensor) and a.is_floating_point():
            a, done = a.detach().clone().requires_grad_(), True
        elif not done and isinstance(a, list) and a and a[0].is_floating_point():
            a, done = [a[0].detach().clone().requires_grad_(), *a[1:]], True
        out.append(a)
    assert done
    return tuple(out)


def _flat(out) -> list:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", list(_cases()))
def test_an_input_that_requires_grad_is_refused_naming_the_op(name):
    op, args = _cases()[name]
    graded = _with_grad(args)
    with pytest.raises(RuntimeError, match=rf"quantscope::{op._opname} is not differentiable.*"
                                           r"ste=True"):
        op(*graded)
    with torch.no_grad():
        got = _flat(op(*graded))
    want = _flat(op(*args))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert not g.requires_grad
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
