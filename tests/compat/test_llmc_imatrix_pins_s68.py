"""Pins from session 68's mutation round over compat.llmcompressor_imatrix (llm-compressor
0.14's ``imatrix_mse``): each test pins a behaviour that a mutant of that module changed while
every other test kept passing - the option defaults and checks, the importance hook (paused
hooks, re-attaching, tuple and half-precision inputs), the importance checks, the expand
overflow check, the candidate factors, the range's dtype, the bfloat16 search's ``expand``,
importance and patience, and NVFP4's float32-scale pricing (against a small re-statement of
llm-compressor's ``_grid_search``). Expected values come from llm-compressor 0.14's
definitions (its observer's defaults, checks, hook and ``p * expand * [min, max]``
candidates), not from quantscope's output."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from test_llmcompressor_api import INT8, _imatrix

from quantscope.compat import llmcompressor as lc
from quantscope.compat import llmcompressor_imatrix as imx
from quantscope.compat.llmcompressor_spec import llmcompressor_spec, search_spec

INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}
NVFP4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
         "group_size": 16}


def _observer(base_name="weight", fields=INT4, **kwargs):
    return lc.IMatrixMSEObserver(base_name, {**fields, "observer_kwargs": kwargs})


class _Pair(torch.nn.Module):
    """A layer with ``in_features`` whose forward takes a tuple (the hook reads its first)."""

    in_features = 3

    def forward(self, xs):
        return xs[0]


def test_imatrix_option_defaults_are_llmcompressors():
    """maxshrink 0.95, patience 5, grid 20, norm 3.0, strict False, expand 1.0."""
    obs = _observer()
    got = {k: getattr(obs, k) for k in ("maxshrink", "patience", "grid", "norm", "strict",
                                        "expand")}
    assert got == {"maxshrink": 0.95, "patience": 5, "grid": 20, "norm": 3.0,
                   "strict": False, "expand": 1.0}


@pytest.mark.parametrize("kwargs, match", [
    ({"grid": 0}, "grid must be > 0"), ({"grid": -1}, "grid must be > 0"),
    ({"patience": -1}, "patience must be >= 0"),
    ({"maxshrink": -0.01}, r"maxshrink must be in \[0, 1\]"),
    ({"maxshrink": 1.01}, r"maxshrink must be in \[0, 1\]"),
    ({"norm": True}, "norm must be a finite positive number"),
    ({"expand": 0}, "expand must be a finite positive number"),
    ({"expand": -1.0}, "expand must be a finite positive number"),
    ({"expand": float("nan")}, "expand must be a finite positive number"),
    ({"expand": True}, "expand must be a finite positive number")])
def test_imatrix_refuses_meaningless_options_when_made(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _observer(**kwargs)


def test_imatrix_takes_patience_0_and_maxshrink_0():
    """llm-compressor's bounds are ``patience >= 0`` and ``0 <= maxshrink``: both 0 allowed."""
    obs = _observer(patience=0, maxshrink=0)
    assert (obs.patience, obs.maxshrink) == (0, 0)


def _fake_hooks(monkeypatch, disabled, keep):
    mixin = type("HooksMixin", (), {"_HOOKS_DISABLED": disabled, "_HOOKS_KEEP_ENABLED": keep})
    monkeypatch.setitem(sys.modules, "llmcompressor.modifiers.utils.hooks",
                        types.SimpleNamespace(HooksMixin=mixin))


def test_imatrix_hook_paused_unless_kept_enabled(monkeypatch):
    """Theirs skips collection while ``HooksMixin._HOOKS_DISABLED`` unless this hook is in
    ``_HOOKS_KEEP_ENABLED``."""
    lin = torch.nn.Linear(2, 1)
    obs = _imatrix(lin)
    x = torch.tensor([[1.0, 2.0]])
    _fake_hooks(monkeypatch, True, set())
    lin(x)
    assert obs._imatrix_count.item() == 0
    _fake_hooks(monkeypatch, True, {obs._imatrix_hook})
    lin(x)
    assert obs._imatrix_count.item() == 1
    assert obs._imatrix_sum.tolist() == [1.0, 4.0]


def test_imatrix_attach_makes_float32_sums_and_an_int64_count():
    """Theirs accumulates in float32 (``IMATRIX_PRECISION``) and counts tokens in int64."""
    obs = _imatrix(torch.nn.Linear(3, 2, dtype=torch.float64))
    assert obs._imatrix_sum.dtype == torch.float32 and obs._imatrix_sum.tolist() == [0.0] * 3
    assert obs._imatrix_count.dtype == torch.int64


def test_imatrix_attach_twice_keeps_one_hook():
    """Attaching again removes the old hook: one forward counts its tokens once."""
    lin = torch.nn.Linear(2, 1)
    obs = _imatrix(lin)
    obs.attach(lin)
    lin(torch.tensor([[1.0, 3.0]]))
    assert len(lin._forward_pre_hooks) == 1
    assert obs._imatrix_count.item() == 1 and obs._imatrix_sum.tolist() == [1.0, 9.0]


def test_imatrix_attach_starts_a_fresh_count():
    """Re-attaching resets sum and count: with no forward since, there is no data."""
    lin = torch.nn.Linear(4, 2)
    obs = _imatrix(lin, strict=True)
    lin(torch.ones(3, 4))
    obs.attach(lin)
    assert obs._imatrix_count.item() == 0
    with pytest.raises(ValueError, match="no importance data available"):
        obs(lin.weight)


def test_imatrix_hook_reads_the_first_of_a_tuple_input():
    """A tuple argument: its first tensor is collected (theirs: ``x = x[0]``)."""
    mod = _Pair()
    obs = _imatrix(mod)
    mod((torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[5.0, 5.0, 5.0]])))
    assert obs._imatrix_sum.tolist() == [1.0, 4.0, 9.0]
    assert obs._imatrix_count.item() == 1


def test_imatrix_hook_squares_half_inputs_in_float32():
    """Theirs casts the input to float32 before squaring: 300 ** 2 (past float16's max)."""
    mod = _Pair()
    obs = _imatrix(mod)
    mod((torch.tensor([[300.0, 1.0, 0.5]], dtype=torch.float16),))
    assert obs._imatrix_sum.tolist() == [90000.0, 1.0, 0.25]


@pytest.mark.parametrize("base_name, fields, shape, match", [
    ("input", {**INT4, "strategy": "tensor"}, (2, 3, 4), "only supported for weight observers"),
    ("weight", {**INT4, "strategy": "tensor"}, (2, 4), "TENSOR strategy not supported")])
def test_imatrix_strict_refuses_activations_and_tensor_strategy(base_name, fields, shape,
                                                                 match):
    obs = _observer(base_name, fields, strict=True)
    obs._imatrix_sum, obs._imatrix_count = torch.ones(4), torch.tensor(1)
    with pytest.raises(NotImplementedError, match=match):
        obs(torch.randn(shape))


def test_imatrix_takes_importance_with_some_zero_channels():
    """Theirs refuses negative values and all zeros only: a zero channel is importance."""
    obs = _observer(strict=True)
    obs._imatrix_sum, obs._imatrix_count = torch.tensor([1.0, 0.0, 2.0, 0.0]), torch.tensor(1)
    obs(torch.randn(3, 4))
    assert obs.has_statistics


def test_imatrix_channel_importance_has_one_value_per_input_column():
    """channel: one importance value per column (8), not per output row (2)."""
    obs = _observer(strict=True)
    obs._imatrix_sum, obs._imatrix_count = torch.ones(8), torch.tensor(1)
    obs(torch.randn(2, 8))
    assert obs.max_vals.shape == (2, 1)


def test_imatrix_refuses_an_expand_past_float32():
    """expand 1.5 of a 3e38 weight is past float32's max (theirs: NaN scales); 1.0 is not."""
    w = torch.tensor([[3e38, -1.0, 0.5, 2.0]])
    for expand, refused in ((1.0, False), (1.5, True)):
        obs = _observer(expand=expand)
        obs._imatrix_sum, obs._imatrix_count = torch.ones(4), torch.tensor(1)
        if refused:
            with pytest.raises(ValueError, match="expand=1.5 takes the observed range past"):
                obs(w)
        else:
            assert obs(w).has_statistics


@pytest.mark.parametrize("maxshrink, grid, want", [(0.0, 20, [0.95]), (1.0, 0.5, [0.0]),
                                                   (0.1, 20, [0.95, 0.9])])
def test_imatrix_search_factors_at_least_one_and_never_negative(monkeypatch, maxshrink, grid,
                                                                want):
    """``max(1, int(maxshrink * grid))`` shrink steps of ``p = 1 - i / grid``; a grid below
    1 clamps p to 0 (their qparams clamp the range (p*min, p*max) to (0, 0))."""
    seen = {}

    def spy(units, weights, spec, *, factors, **kw):
        seen["factors"] = factors
        return units.amin(1), units.amax(1)

    monkeypatch.setattr(imx, "weighted_search", spy)
    imx.imatrix_search(torch.randn(1, 2, 1, 8), None, llmcompressor_spec(INT8),
                       maxshrink=maxshrink, patience=None, grid=grid, norm=3.0)
    assert seen["factors"] == pytest.approx(want)


def test_imatrix_range_keeps_a_float64_weights_dtype():
    """llm-compressor's min / max are the observed dtype's (float64 here)."""
    obs = _observer()
    obs._imatrix_sum, obs._imatrix_count = torch.ones(4), torch.tensor(1)
    obs(torch.randn(3, 4, dtype=torch.float64))
    assert obs.min_vals.dtype == obs.max_vals.dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_imatrix_first_candidate_is_expand_times_the_range(dtype):
    """maxshrink 0, grid 1: candidates ``p * expand * [min, max]`` for p = 1 and p = 0; the
    zero range (every value quantized to ~0) loses on these spread values."""
    w = torch.stack([torch.linspace(-1, 1, 16), torch.linspace(-0.5, 0.25, 16)]).to(dtype)
    obs = _observer(expand=1.5, maxshrink=0.0, grid=1)
    obs._imatrix_sum, obs._imatrix_count = torch.ones(16), torch.tensor(1)
    obs(w)
    assert obs.max_vals.dtype == dtype
    assert obs.max_vals.reshape(-1).tolist() == [1.5, 0.375]
    assert obs.min_vals.reshape(-1).tolist() == [-1.5, -0.75]


def _bf16_rows(seed):
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_bfloat16_imatrix_search_is_weighted():
    """On bfloat16 weights (priced in the dtype) the importance still weights the error: a
    skewed importance moves some rows' ranges from the uniform importance's."""
    w = _bf16_rows(1)
    got = []
    for imp in (torch.ones(32), torch.tensor([1e3] * 4 + [1e-3] * 28)):
        obs = _observer()
        obs._imatrix_sum, obs._imatrix_count = imp, torch.tensor(1)
        got.append(obs(w).max_vals)
    assert not torch.equal(got[0], got[1])


def test_bfloat16_imatrix_search_keeps_patience():
    """On bfloat16 weights too, theirs stops after ``patience`` candidates without
    improvement: patience 1 ends before the best range of some row, patience 0 never stops."""
    w = _bf16_rows(2)
    got = {}
    for patience in (0, 1, 10 ** 6):
        obs = _observer(grid=100, maxshrink=0.5, patience=patience)
        obs._imatrix_sum, obs._imatrix_count = torch.ones(32), torch.tensor(1)
        got[patience] = obs(w).max_vals
    assert torch.equal(got[0], got[10 ** 6])
    assert not torch.equal(got[1], got[10 ** 6])


_FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _nvfp4_search(groups, imp, grid=20, maxshrink=0.95, patience=5, norm=3.0):
    """llm-compressor 0.14's ``_grid_search`` for tensor_group: float32 scales ``amax / 6``
    (the fp8 scale_dtype dropped), FP4 E2M1 codes, ``sum imp * |fq - x| ** norm``."""
    lo0, hi0 = groups.amin(-1), groups.amax(-1)
    best = torch.full(lo0.shape, torch.finfo(torch.float32).max)
    best_lo, best_hi, no_improve = lo0.clone(), hi0.clone(), 0
    for i in range(max(1, int(maxshrink * grid)) + 1):
        p = 1 - i / grid
        lo, hi = p * lo0, p * hi0
        scale = (torch.maximum(lo.abs(), hi.abs()) / 6.0)[..., None]
        t = (groups / scale).clamp(-6, 6)
        fq = _FP4_GRID[(t.abs()[..., None] - _FP4_GRID).abs().argmin(-1)] * t.sign() * scale
        err = ((fq - groups).abs() ** norm * imp).sum(-1)
        improved = err < best
        if improved.any():
            best[improved], best_lo[improved], best_hi[improved] = (
                err[improved], lo[improved], hi[improved])
            no_improve = 0
        else:
            no_improve += 1
            if no_improve >= patience:
                break
    return best_lo, best_hi


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_imatrix_tensor_group_search_prices_float32_scales(seed):
    """NVFP4 (tensor_group): the search prices candidates with float32 scales, not the fp8
    scale_dtype (theirs drops it: the global scale cancels)."""
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(seed)) * 0.05
    imp = torch.rand(32, generator=torch.Generator().manual_seed(seed + 10)) + 0.1
    obs = lc.IMatrixMSEObserver("weight", {**NVFP4, "observer_kwargs": {"strict": True}})
    obs._imatrix_sum, obs._imatrix_count = imp.clone(), torch.tensor(1)
    obs(w)
    lo, hi = _nvfp4_search(w.reshape(4, 2, 16), (imp / imp.mean()).reshape(2, 16))
    assert torch.equal(obs.min_vals, lo) and torch.equal(obs.max_vals, hi)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mx_half_weights_are_priced_in_the_dtype(dtype):
    """MX's E8M0 scales are among those llm-compressor prices on half data in the dtype."""
    mx = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
          "group_size": 32, "scale_dtype": torch.uint8, "zp_dtype": torch.uint8}
    assert imx.prices_in_dtype(search_spec(mx, "weight"), dtype, "group")
