"""Probe fixes (s28): forward-mode AD through the activation QDQ, a model deepcopied during
calibrate, and a layer whose input dtype changes between batches."""

import copy
import gc
import weakref

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

import quantscope
from quantscope import fake_quantize
from quantscope.calibration.run.samples import RowSample
from quantscope.observers.runtime import qdq_tensor, runtime_qparams


# ----------------------------------------------------------- forward-mode AD (jvp, jacfwd)
def _calibrated():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
    cal = quantscope.calibrate(model, [torch.randn(16, 8)], "w8a8", progress=False)
    return model, cal


def _x_and_ste_tangent(state):
    """An input partly outside the calibrated range (a 0 / 1 mask), and its STE tangent."""
    x = torch.randn(3, 8) * 4
    v = torch.randn(3, 8)
    q = runtime_qparams(x, state)
    _, want = torch.func.jvp(lambda t: fake_quantize(t, q, state.spec, ste=True), (x,), (v,))
    assert 0 < int((want == 0).sum()) < want.numel()  # both sides of the mask are tested
    return x, v, want


def test_qdq_tensor_forward_ad_tangent_is_straight_through():
    """torch.func.jvp, jacfwd and forward_ad dual tensors (under no_grad too, which does not
    stop forward AD) get the STE tangent, not a silent zero."""
    _, cal = _calibrated()
    state = cal.states["0"]["input"]
    x, v, want = _x_and_ste_tangent(state)
    _, got = torch.func.jvp(lambda t: qdq_tensor(t, state), (x,), (v,))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.no_grad():
        _, got = torch.func.jvp(lambda t: qdq_tensor(t, state), (x,), (v,))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    jac = torch.func.jacfwd(lambda t: qdq_tensor(t, state))(x[0])
    inside = torch.func.jacrev(lambda t: qdq_tensor(t, state))(x[0])  # reverse mode: STE
    assert torch.equal(jac, inside) and jac.abs().sum() > 0
    for grad_mode in (torch.enable_grad, torch.no_grad):
        with fwAD.dual_level(), grad_mode():
            out = qdq_tensor(fwAD.make_dual(x, v), state)
            got = fwAD.unpack_dual(out).tangent
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # plain tensors: unchanged (no STE graph without grad, the STE gradient with it)
    plain = qdq_tensor(x, state)
    assert not plain.requires_grad
    xg = x.clone().requires_grad_()
    qdq_tensor(xg, state).backward(v)
    torch.testing.assert_close(xg.grad, want, rtol=0, atol=0)
    torch.testing.assert_close(qdq_tensor(xg, state).detach(), plain, rtol=0, atol=0)


def test_applied_model_jacfwd_matches_jacrev():
    model, cal = _calibrated()
    x = torch.randn(8) * 4
    with cal.apply(model):
        fwd = torch.func.jacfwd(model)(x)
        rev = torch.func.jacrev(model)(x)
    torch.testing.assert_close(fwd, rev)
    assert fwd.abs().sum() > 0


# ----------------------------------------------------- a model copied during calibrate
def _ranges(copy_with, run_copy=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 8))
    batches = [torch.randn(4, 16) for _ in range(4)]
    copies = []

    def gen():
        for i, b in enumerate(batches):
            if i == 2 and copy_with is not None:
                replica = copy_with(model)
                copies.append(replica)
                if run_copy:
                    with torch.inference_mode():
                        out = replica(torch.randn(4, 16) * 1000)
                    copies.append(out)
            yield b
    cal = quantscope.calibrate(model, gen(), "w8a8", progress=False)
    rows = {(r["layer"], r["role"]): (r["lo"], r["hi"]) for r in cal.report().rows
            if r["role"] in ("input", "output")}
    return rows, model, copies


def test_deepcopy_mid_calibration_runs_float_and_leaves_the_original_alone():
    ref, _, _ = _ranges(None)
    got, model, (replica, _) = _ranges(copy.deepcopy)
    assert got == ref  # the copy's data reached none of the original's observers
    for m in replica.modules():  # its copied hooks removed themselves on its first forward
        assert not m._forward_pre_hooks and not m._forward_hooks
    x = torch.randn(4, 16)
    with torch.inference_mode():  # (copied in the pass: inference-mode parameters)
        torch.testing.assert_close(replica(x), model(x))  # it runs as the float model
    # a copy never run during the pass: its hooks do nothing afterwards, then go
    _, model, (late,) = _ranges(copy.deepcopy, run_copy=False)
    assert late[0]._forward_pre_hooks
    with torch.inference_mode():
        torch.testing.assert_close(late(x), model(x))
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in late.modules())


def test_shallow_copy_mid_calibration_keeps_the_original_hooks():
    """copy.copy shares the hook dicts: running it must not unhook the original."""
    ref, _, _ = _ranges(None)
    got, _, _ = _ranges(lambda m: copy.copy(m[0]))
    assert got == ref


def test_calibrated_modules_freed_without_gc():
    """The hooks reach their module by weakref: no cycle keeps a model after calibrate."""
    gc.disable()
    try:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        quantscope.calibrate(model, [torch.randn(4, 8)], "w8a8", progress=False)
        ref = weakref.ref(model[0])
        del model
        assert ref() is None
    finally:
        gc.enable()


# ----------------------------------------------------- input dtypes changing by batch
class _CastLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x.to(self.weight.dtype))


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.float32),
                                    (torch.float32, torch.float64, torch.float32)])
def test_calibrate_layer_fed_mixed_dtypes(dtypes):
    torch.manual_seed(0)
    model = nn.Sequential(_CastLinear(32, 32), nn.ReLU(), nn.Linear(32, 32)).eval()
    batches = [torch.randn(4, 8, 32).to(d) for d in dtypes]
    cal = quantscope.calibrate(model, batches, "w8a8", progress=False)
    rows = {(r["layer"], r["role"]) for r in cal.report().rows}
    assert ("0", "input") in rows
    auto = quantscope.calibrate(model, batches, "w8a8", observer="auto",
                                candidates=["minmax", "mse"], progress=False)
    assert "0" in auto.states


def test_row_sample_promotes_to_keep_every_row_exactly():
    xs = [torch.randn(2, 5, 4), torch.randn(2, 5, 4).to(torch.bfloat16),
          torch.randn(10, 4).double(), torch.randn(4, 10).t()]  # the last not contiguous
    s = RowSample(capacity=40, batches=4, generator=torch.Generator().manual_seed(0))
    gen, ref = torch.Generator().manual_seed(0), []
    for x in xs:
        s.add(x)
        rows = x.reshape(-1, 4)
        ref.append(rows[torch.randperm(10, generator=gen)].double())
    assert s.rows().dtype == torch.float64 and s.count == 40
    assert torch.equal(s.rows(), torch.cat(ref))
