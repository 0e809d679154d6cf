"""An applied model under ``torch.compile``: every preset's run-time (``dynamic=True``) role
computes its qparams as the memoryless min-max observer would, but as plain ops that Dynamo
traces into the graph (probing found each such role built an observer module per forward:
five graph breaks per model, ``fullgraph=True`` refused)."""

import pytest
import torch
from torch import nn

from quantscope import presets
from quantscope.calibration import calibrate
from quantscope.calibration.recipe import RECIPES
from quantscope.calibration.results.role_state import RoleState
from quantscope.observers.registry import get_observer
from quantscope.observers.runtime import runtime_qparams
from quantscope.qparams import QParams, qparams_from_range

DYNAMIC = ("w8a8-dynamic", "fp8-dynamic", "mxfp4")


def _observed(x, spec):
    """The qparams of a memoryless min-max observer run on ``x`` (the path the run-time role
    took before, kept as the reference), under the run-time rule for non-finite units."""
    obs = get_observer("memoryless_minmax", spec)
    obs(x)
    lo, hi = obs.calculate_range()
    qp = qparams_from_range(lo, hi, spec, global_amax=obs.global_amax(), check_finite=False)
    if not spec.scale.is_block:  # the run-time rule: a unit holding NaN / inf scales by NaN
        bad = ~(torch.isfinite(lo) & torch.isfinite(hi))
        qp = QParams(qp.scale.masked_fill(bad, float("nan")), qp.zero_point, qp.global_scale)
    return qp.reshape(spec.layout.qparam_shape(x.shape))


def _same(a, b):
    """Both absent, or the same dtype, shape and bits."""
    if a is None or b is None:
        return a is b
    return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", [*DYNAMIC, "nvfp4"])
def test_run_time_qparams_are_the_memoryless_observers(name, dtype):
    spec = presets.NVFP4 if name == "nvfp4" else RECIPES[name]("minmax").input.spec
    state = RoleState(spec, "memoryless_minmax", "memoryless_minmax", dynamic=True)
    torch.manual_seed(0)
    # 40 and 48 columns: MX / NVFP4 blocks padded with zeros; NaN, inf, all-positive units
    cases = [torch.randn(4, 8, 64) * 3, torch.randn(3, 48), torch.randn(2, 5, 40).abs() + 1,
             torch.zeros(2, 32)]
    odd = torch.randn(6, 64)
    odd[1, 3], odd[2, 0], odd[4, 7] = float("nan"), float("inf"), -float("inf")
    for x in (*cases, odd, torch.randn(64, 6).t()):  # the last: a transposed view
        x = x.to(dtype)
        got, want = runtime_qparams(x, state), _observed(x, spec)
        for field in ("scale", "zero_point", "global_scale"):
            assert _same(getattr(got, field), getattr(want, field)), (name, field)


@pytest.mark.parametrize("name", DYNAMIC)
def test_a_dynamic_preset_compiles_as_one_graph(name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    batches = [torch.randn(4, 8, 64) for _ in range(2)]
    calib = calibrate(model, batches, name, progress=False)
    x = torch.randn(4, 8, 64)
    with calib.apply(model), torch.no_grad():
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        assert torch.equal(compiled(x), model(x))
    torch._dynamo.reset()
