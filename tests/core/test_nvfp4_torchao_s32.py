"""NVFP4 against torchao 0.18's ``NVFP4Tensor`` (probe s32), the differences observers.md
states: torchao clamps each e4m3 block scale to e4m3's smallest normal (``2 ** -6``) where
quantscope, as compressed-tensors and NVIDIA's recipe, keeps a subnormal one; blocks whose
scales agree quantize to the same codes."""

import pytest
import torch

from quantscope import fake_quantize, presets, qparams_from_range

nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")

E4M3_TINY = torch.finfo(torch.float8_e4m3fn).tiny  # 2 ** -6


def _both(x):
    spec = presets.NVFP4
    u = spec.layout.to_units(x)
    qp = qparams_from_range(u.amin(1), u.amax(1), spec)
    theirs = nvfp4.NVFP4Tensor.to_nvfp4(
        x, per_tensor_scale=nvfp4.per_tensor_amax_to_scale(x.abs().max()))
    return qp, fake_quantize(x, qp, spec), theirs


def test_a_small_block_keeps_its_subnormal_scale_where_torchao_clamps_it():
    x = torch.zeros(1, 32)
    x[0, 0] = 1000.0  # the global amax
    x[0, 16:] = torch.linspace(-0.02, 0.02, 16)  # amax 0.02 < 1000 / 28672
    qp, ours, theirs = _both(x)
    gs = 448 * 6 / 1000.0
    # the e4m3 block scale of amax / 6 * gs (the formula), subnormal in e4m3
    want = torch.tensor(0.02 / 6 * gs).to(torch.float8_e4m3fn).float()
    assert 0 < want < E4M3_TINY
    assert qp.scale.reshape(-1)[1].float() == want
    assert theirs.scale.float().reshape(-1)[1] == E4M3_TINY  # torchao's clamp
    assert not torch.equal(ours[0, 16:], theirs.dequantize(torch.float32)[0, 16:])


def test_blocks_of_normal_scales_quantize_as_torchao_within_its_last_bit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g)  # every block scale a normal e4m3
    qp, ours, theirs = _both(x)
    assert torch.equal(qp.scale.float().reshape(-1), theirs.scale.float().reshape(-1))
    # dequantized as code * (s / gs) here, (amax / 2688 * s) * code there: last bits apart
    assert torch.allclose(ours, theirs.dequantize(torch.float32), rtol=2 ** -22, atol=0)
