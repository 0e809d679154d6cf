"""Pins from session 59's mutation round of compat.llmcompressor: each test compares with
llm-compressor 0.14 (or its documented refusal) a case where a mutant left every other test
passing."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.peers

pytest.importorskip("llmcompressor")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers import Observer as Theirs

from quiet_logs import quiet

from quantscope.compat.llmcompressor import Observer as Ours
from quantscope.compat.llmcompressor_parts import GroupSizeError

INT4_CHANNEL = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}


def _both(name, args, w, **kw):
    """``(theirs, ours)``: each observer's ``max_vals`` after ``w``, and its qparams."""
    out = []
    with quiet():
        for cls in (Theirs, Ours):
            obs = cls.load_from_registry(name, base_name="weight", args=args, **kw)
            obs(w)
            out.append((obs.max_vals.clone(), obs.get_qparams()))  # (get deletes them)
    return out


def _bf16_weights(seed, rows, cols, outlier):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) ** 3
    if outlier:
        w[:, 0] *= 1 + 4 * torch.rand(rows, generator=g)
    return (w * 3).bfloat16()


@pytest.mark.parametrize(("rows", "cols", "outlier", "kw"), [
    (16, 64, True, {"patience": 1}),  # p = 1 is the incumbent, not a candidate
    (32, 512, False, {}),  # long rows: the errors summed in bfloat16, as theirs
], ids=["patience-1", "bf16-sums"])
def test_bf16_mse_searches_choose_theirs(rows, cols, outlier, kw):
    for seed in range(6):
        w = _bf16_weights(seed, rows, cols, outlier)
        (theirs, _), (ours, _) = _both("memoryless_mse", QuantizationArgs(**INT4_CHANNEL), w,
                                       **kw)
        assert torch.equal(theirs, ours), seed


def test_a_float64_mse_search_keeps_float64_statistics_and_scales():
    w = torch.randn(4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    (their_max, theirs), (our_max, ours) = _both("memoryless_mse", args, w)
    assert our_max.dtype == their_max.dtype == torch.float64
    assert ours["scale"].dtype == theirs["scale"].dtype == torch.float64


def test_imatrix_with_some_channels_never_active_is_theirs():
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 8, bias=False)
    x = torch.randn(64, 32)
    x[:, :16] = 0  # half the input channels: zero importance, not all
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=16)
    got = []
    with quiet():
        for cls in (Theirs, Ours):
            obs = cls.load_from_registry("imatrix_mse", base_name="weight", args=args,
                                         strict=True)
            obs.attach(lin)
            lin(x)
            obs.detach(lin)
            obs(lin.weight.detach())
            got.append(obs.max_vals.clone())
    assert torch.equal(*got)


def test_a_group_size_that_does_not_divide_the_columns_is_a_group_size_error():
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=16)
    obs = Ours.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    with pytest.raises(GroupSizeError), quiet():
        obs(torch.randn(8, 40))


def test_blocks_past_the_weights_edges_are_padded_as_theirs():
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block",
                            block_structure=[16, 16])
    w = torch.randn(36, 20, generator=torch.Generator().manual_seed(0))  # 36 % 16 != -36 % 16
    (_, theirs), (_, ours) = _both("memoryless_minmax", args, w)
    assert ours["scale"].shape == (3, 2) and torch.equal(ours["scale"], theirs["scale"])


def test_bf16_asymmetric_activations_with_inf_are_refused():
    args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="tensor")
    obs = Ours.load_from_registry("static_minmax", base_name="input", args=args)
    obs(torch.tensor([[[1.0, float("inf"), -2.0]]]).bfloat16())
    with pytest.raises(ValueError, match="observed NaN or inf"):
        obs.get_qparams()


def test_spec_translation_edges():
    from quantscope.compat.llmcompressor_spec import llmcompressor_spec

    # compressed-tensors' default symmetric is True; a dict may leave it None
    assert llmcompressor_spec({"num_bits": 8, "type": "int", "symmetric": None}).symmetric
    # MX scales need group 32 (compressed-tensors' should_generate_mx_scales); else a uint8
    # scale_dtype is an integer scale encoding, refused
    mx = {"num_bits": 4, "type": "float", "strategy": "group", "scale_dtype": torch.uint8}
    assert str(llmcompressor_spec({**mx, "group_size": 32}).scale).startswith("e8m0")
    with pytest.raises(ValueError, match="scale_dtype"):
        llmcompressor_spec({**mx, "group_size": 16})


def test_an_activations_channels_are_its_features():
    # the spec exporters and recipes read (llm-compressor's observers refuse channel
    # activations, as quantscope's compat observer does): one scale per feature, the last axis
    from quantscope.compat.llmcompressor_spec import llmcompressor_spec

    args = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    assert llmcompressor_spec(args, "input").layout.qparam_shape((4, 6)) == (1, 6)
    assert llmcompressor_spec(args, "weight").layout.qparam_shape((4, 6)) == (4, 1)
    obs = Ours.load_from_registry("static_minmax", base_name="input",
                                  args=QuantizationArgs(**args))
    with pytest.raises(ValueError, match="Channel quantization cannot be applied to "
                                         "activations"), quiet():
        obs(torch.randn(4, 6))
