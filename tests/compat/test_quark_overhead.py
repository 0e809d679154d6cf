"""compat.quark's per-call shortcuts hold the results of the paths they replace, bit for bit:
the token count's reductions (Quark's ``(x != 0).any(-1)``), E8M0 block scales by the C
kernel at any block count (a checked qparams call: the torch branch's values). No Quark
needed (dict qspecs)."""

from __future__ import annotations

import pytest
import torch

from quantscope import kernels, qparams
from quantscope.compat import quark
from quantscope.compat.quark_scales import _AMAX_ROWS_FROM, _quark_token_count

SHAPES = [(8, 64), (6, 3, 40), (64, 256), (4, 8, 1024)]


def _rows(shape, dtype) -> torch.Tensor:
    """Random rows with the edge rows: all zeros, all -0.0, a NaN, an inf, a subnormal."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    flat = x.reshape(-1, shape[-1])
    flat[0], flat[1] = 0.0, -0.0
    flat[2], flat[2, 1] = 0.0, float("nan")
    flat[3], flat[3, -1] = 0.0, float("-inf")
    flat[4], flat[4, 0] = -0.0, torch.finfo(dtype).smallest_normal / 4
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_token_count_is_quarks_expression(shape, dtype):
    x = _rows(shape, dtype)
    got, want = _quark_token_count(x), x.ne(0).any(-1).sum()
    assert got.dtype == want.dtype == torch.int64 and int(got) == int(want)


def test_token_count_shapes_take_both_reductions():
    sizes = [torch.Size(s).numel() for s in (SHAPES[0], SHAPES[-1])]
    assert sizes[0] < _AMAX_ROWS_FROM <= sizes[1]


def test_forward_counts_quarks_tokens():
    obs = quark.PerTensorMinMaxObserver({"dtype": "int8", "is_dynamic": True})
    batches = [_rows((8, 64), torch.float32).nan_to_num(), _rows((64, 512), torch.bfloat16)
               .nan_to_num().clamp(-3, 3), torch.zeros(5, 16)]
    for x in batches:
        obs(x)
    assert obs._num_observed_tokens == sum(int(x.ne(0).any(-1).sum()) for x in batches)


def _torch_branch_qparams(obs, monkeypatch):
    """The qparams with the block kernel off (the torch branch), in Quark's shape."""
    with monkeypatch.context() as m:
        m.setattr(qparams, "_block_qparams_kernel", lambda *a: None)
        qp = obs.range_and_qparams()[2]
    return obs._quark_shape(qp.effective_scale), qp


MX = [({"dtype": "fp4", "group_size": 32}, (8, 64)), ({"dtype": "fp4", "group_size": 32},
      (8, 70)), ({"dtype": "fp8_e4m3", "group_size": 32, "ch_axis": 1}, (4, 64, 3)),
      ({"dtype": "fp6_e2m3", "group_size": 16}, (64, 256)), ({"dtype": "mx",
      "mx_element_dtype": "fp8_e5m2", "group_size": 32}, (3, 5, 96))]


@pytest.mark.parametrize(("qspec", "shape"), MX)
def test_mx_kernel_scales_are_native(qspec, shape, monkeypatch):
    calls = []
    kernel = qparams._block_qparams_kernel
    monkeypatch.setattr(qparams, "_block_qparams_kernel",
                        lambda *a: calls.append(1) or kernel(*a))
    obs = quark.PerBlockMXObserver({"qscheme": "per_group", "ch_axis": -1,
                                    "scale_format": "e8m0", **qspec})
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 3
    x.reshape(-1)[:40] = 0.0  # zero blocks
    x.reshape(-1)[-7:] = 2.0 ** -130  # subnormal amax
    obs(x)
    scale, zp = obs._calculate_qparams()
    assert calls == ([1] if kernels.available("block_qparams") else [])  # a few blocks: in C
    want, _ = _torch_branch_qparams(obs, monkeypatch)
    assert torch.equal(scale, want) and scale.dtype == torch.float32
    assert torch.equal(zp, torch.zeros_like(want))


def test_bfp_kernel_scales_are_native(monkeypatch):
    obs = quark.PerBlockBFPObserver({"dtype": "bfp16", "ch_axis": -1, "group_size": 8})
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)) * 100
    x[0, :8] = 0.0
    obs(x)
    qp = obs.range_and_qparams()[2]
    want = _torch_branch_qparams(obs, monkeypatch)[1]
    assert torch.equal(qp.scale, want.scale) and torch.equal(qp.zero_point, want.zero_point)


INT = [("PerTensorMinMaxObserver", {"dtype": "int8"}),
       ("PerTensorMinMaxObserver", {"dtype": "uint8", "symmetric": False}),
       ("PerChannelMinMaxObserver", {"dtype": "int8", "ch_axis": 0}),
       ("PerChannelMinMaxObserver", {"dtype": "int4", "ch_axis": 1, "symmetric": False}),
       ("PerGroupMinMaxObserver", {"dtype": "int4", "ch_axis": -1, "group_size": 32}),
       ("PerGroupMinMaxObserver", {"dtype": "uint4", "ch_axis": 0, "group_size": 4,
                                   "symmetric": False})]


@pytest.mark.parametrize("name, qspec", [*INT[::2], ("PerBlockMXObserver",
                         {"dtype": "fp4", "group_size": 32, "scale_format": "e8m0"})])
def test_a_non_finite_or_inverted_state_is_refused(name, qspec):
    """The qparams' own checks stand for a state forward did not make (written into)."""
    obs = getattr(quark, name)({"ch_axis": -1, **qspec, **(
        {"qscheme": "per_group"} if "group_size" in qspec else {})})
    obs(torch.randn(8, 64))
    for bad, match in ((float("nan"), "NaN or inf"), (1e3, "lo must be <= hi")):
        saved = obs.min_vals.clone()
        obs.min_vals[0] = bad
        with pytest.raises(ValueError, match=match):
            obs._calculate_qparams()
        obs.min_vals.copy_(saved)


@pytest.mark.parametrize(("name", "qspec"), [*INT[::2], ("PerBlockMXObserver",
                         {"dtype": "fp4", "group_size": 32, "scale_format": "e8m0"})])
def test_non_finite_still_raises(name, qspec):
    obs = getattr(quark, name)({"ch_axis": -1, **qspec, **(
        {"qscheme": "per_group"} if "group_size" in qspec else {})})
    x = torch.randn(8, 64)
    x[2, 5] = float("nan")
    obs(x)
    with pytest.raises(ValueError, match="NaN or inf"):
        obs._calculate_qparams()
