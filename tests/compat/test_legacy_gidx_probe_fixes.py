"""The seed's llm-compressor observers and ``g_idx`` (probe s27 actorder): NVFP4 / MXFP4 blocks
take it as group / tensor_group integers do, and a call without it means the observer's
default grouping (the module's ``weight_g_idx``), not the last call's."""

from __future__ import annotations

import pytest
import torch

from quantscope.compat import llmcompressor_legacy as legacy

NVFP4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
MXFP4 = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
         "scale_dtype": torch.uint8}
INT4_TG = {"num_bits": 4, "strategy": "tensor_group", "group_size": 16}
INT4_G = {"num_bits": 4, "strategy": "group", "group_size": 16}


def _weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 64, generator=g) * torch.linspace(0.1, 4, 64)  # columns differ


def _g_idx(size: int, seed: int = 1) -> torch.Tensor:
    return torch.randperm(64, generator=torch.Generator().manual_seed(seed)) // size


def _scale(args, w, module=None, **call):
    return legacy.MemorylessMinMaxObserver("weight", args, module=module)(w, **call)[0]


@pytest.mark.parametrize("args", [NVFP4, MXFP4], ids=["nvfp4", "mxfp4"])
def test_block_layouts_group_columns_by_g_idx(args):
    """The seed applied g_idx to GROUP and TENSOR_GROUP alike: the block scales are those of
    the columns in ``argsort(g_idx)`` order (they were the column-order ones)."""
    w, g_idx = _weight(), _g_idx(args["group_size"])
    act_order = _scale(args, w[:, torch.argsort(g_idx, stable=True)])
    assert not torch.equal(act_order, _scale(args, w))  # the case tells them apart
    assert torch.equal(_scale(args, w, g_idx=g_idx), act_order)
    lin = torch.nn.Linear(64, 4, bias=False)
    lin.weight_g_idx = g_idx  # the module's, read at construction
    assert torch.equal(_scale(args, w, module=lin), act_order)
    assert torch.equal(_scale(args, w, g_idx=torch.full((64,), -1)), _scale(args, w))


def test_block_g_idx_is_checked_as_group_checks_it():
    w = _weight()
    with pytest.raises(ValueError, match="g_idx has 32 entries"):
        _scale(NVFP4, w, g_idx=torch.arange(32) // 16)
    with pytest.raises(ValueError, match="g_idx must put exactly size=16"):
        _scale(NVFP4, w, g_idx=torch.arange(64) // 32)


def test_channel_ignores_g_idx_as_the_seed_did():
    w = _weight()
    args = {"num_bits": 4, "strategy": "channel"}
    assert torch.equal(_scale(args, w, g_idx=_g_idx(16)), _scale(args, w))


def test_tensor_group_reads_the_module_g_idx():
    """tensor_group integers read ``weight_g_idx`` at construction, as group does."""
    w, g_idx = _weight(), _g_idx(16)
    lin = torch.nn.Linear(64, 4, bias=False)
    lin.weight_g_idx = g_idx
    expect = torch.stack([w[:, g_idx == k].abs().amax(1) for k in range(4)], 1) / 7.5
    torch.testing.assert_close(_scale(INT4_TG, w, module=lin), expect)
    assert torch.equal(_scale(INT4_TG, w, module=lin), _scale(INT4_TG, w, g_idx=g_idx))


@pytest.mark.parametrize("args", [INT4_G, NVFP4], ids=["int4-group", "nvfp4"])
def test_g_idx_does_not_stick_between_calls(args):
    """``forward(x)`` without g_idx: the observer's default grouping, not the last call's."""
    w, a, m = _weight(), _g_idx(16, 1), _g_idx(16, 2)
    obs = legacy.MemorylessMinMaxObserver("weight", args)
    obs(w, g_idx=a)
    assert torch.equal(obs(w)[0], _scale(args, w))  # column order
    lin = torch.nn.Linear(64, 4, bias=False)
    lin.weight_g_idx = m
    obs = legacy.MemorylessMinMaxObserver("weight", args, module=lin)
    obs(w, g_idx=a)
    assert torch.equal(obs(w)[0], _scale(args, w, g_idx=m))  # the module's


@pytest.mark.parametrize("args", [INT4_G, NVFP4], ids=["int4-group", "nvfp4"])
def test_a_g_idx_written_in_place_regroups(args):
    """Probe s40: GPTQ fills ``weight_g_idx`` in place; the order was cached by the tensor's
    identity, so the next call grouped by the old values (the last call's scales, stale)."""
    w, g_idx = _weight(), _g_idx(16, 1)
    obs = legacy.MemorylessMinMaxObserver("weight", args)
    obs(w, g_idx=g_idx)
    g_idx.copy_(_g_idx(16, 2))
    assert torch.equal(obs(w, g_idx=g_idx)[0], _scale(args, w, g_idx=g_idx.clone()))
    with torch.inference_mode():  # an inference tensor has no version: regrouped every call
        g_idx = _g_idx(16, 1)
        obs(w, g_idx=g_idx)
        g_idx.copy_(_g_idx(16, 3))
        assert torch.equal(obs(w, g_idx=g_idx)[0], _scale(args, w, g_idx=_g_idx(16, 3)))


def test_running_state_merges_per_group_index_across_g_idx():
    """Kept as the seed's: a static observer merges group k's range whatever g_idx gave it."""
    w, a, b = _weight(), _g_idx(16, 1), _g_idx(16, 2)
    obs = legacy.StaticMinMaxObserver("weight", INT4_G)
    obs(w, g_idx=a)
    scale, _ = obs(w * 0.5, g_idx=b)

    def amax(x, g):
        return torch.stack([x[:, g == k].abs().amax(1) for k in range(4)], 1)

    torch.testing.assert_close(scale, torch.maximum(amax(w, a), amax(w * 0.5, b)) / 7.5)


@pytest.mark.parametrize("bits", [8, 6])
def test_fp8_and_fp6_tensor_group_take_plain_group_scales(bits):
    """Probe s40: fp8 / fp6 tensor_group elements took NVFP4's fp8 block scales under a global
    scale of their own max (the module table says plain group scales, as the seed's
    compressed-tensors computed them: ``amax / element max``, no global scale)."""
    args = {"num_bits": bits, "type": "float", "strategy": "tensor_group", "group_size": 16}
    w = _weight()
    obs = legacy.MemorylessMinMaxObserver("weight", args)
    scale, _ = obs(w)
    fmax = {8: 448.0, 6: 7.5}[bits]
    assert torch.equal(scale, (w.reshape(4, 4, 16).abs().amax(-1) / fmax))
    assert obs.get_qparams()["global_scale"] is None
