"""Calibrating convolution models: batches of different spatial sizes (images, audio
lengths), and per-channel weights of ConvTranspose layers (output channels on axis 1)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import MinMaxObserver, PerChannelMinMaxObserver

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Recipe, Role, Rule, Sampling, preset
from quantscope.calibration.run.samples import RowSample

ALL_ROWS = Sampling(tokens=100_000)  # every row of the batches below: the report sees all


def _ao_tensor_scale(batches) -> torch.Tensor:
    """torch.ao's static per-tensor int8 symmetric min-max scale over all ``batches``."""
    ao = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    for b in batches:
        ao(b)
    return ao.calculate_qparams()[0]


def _sqnr_db(x: torch.Tensor, scale: torch.Tensor) -> float:
    """SQNR of ``x`` under int8 symmetric QDQ with one ``scale`` (torch's fake quantize)."""
    q = torch.fake_quantize_per_tensor_affine(x, float(scale), 0, -128, 127)
    return 10 * math.log10(float(x.double().square().sum())
                           / float((q - x).double().square().sum()))


def _row(calib, layer, role):
    (row,) = [r for r in calib.report().rows if r["layer"] == layer and r["role"] == role]
    return row


def test_conv2d_images_of_two_sizes():
    """Per-tensor static inputs of Conv2d fed 16x16 and 16x24 images: torch.ao's scale over
    both, and the report's SQNR on all values of both (the channel rows keep every batch)."""
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    imgs = [torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 24)]
    rec = preset("w8a8", "static_minmax", targets=["Conv2d"])
    c = quantscope.calibrate(cnn.eval(), imgs, rec, sampling=ALL_ROWS, progress=False)
    scale = _ao_tensor_scale(imgs)
    assert torch.equal(c.states["0"]["input"].qparams.scale.reshape(()), scale.reshape(()))
    row = _row(c, "0", "input")
    assert row["numel"] == sum(b.numel() for b in imgs)
    flat = torch.cat([b.movedim(1, -1).reshape(-1, 3) for b in imgs])
    assert row["sqnr_db"] == pytest.approx(_sqnr_db(flat, scale), rel=1e-6)


def test_conv1d_audio_of_two_lengths():
    """A speech front end (Conv1d) fed audio of 400 and 320 samples calibrates: the first
    conv's input scale is torch.ao's over both lengths."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 8, 10, stride=5), nn.GELU(), nn.Conv1d(8, 8, 3, stride=2))
    batches = [torch.randn(2, 1, 400), torch.randn(2, 1, 320)]
    rec = preset("w8a8", "static_minmax", targets=["Conv1d"])
    c = quantscope.calibrate(model.eval(), batches, rec, sampling=ALL_ROWS, progress=False)
    assert sorted(c.states) == ["0", "2"]
    assert torch.equal(c.states["0"]["input"].qparams.scale.reshape(()),
                       _ao_tensor_scale(batches).reshape(()))
    assert _row(c, "2", "input")["numel"] == 2 * 8 * (79 + 63)  # both lengths, all rows


def test_wav2vec2_raw_audio_of_two_lengths():
    """transformers' Wav2Vec2ForCTC (tiny config) on raw audio of two lengths."""
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.Wav2Vec2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2),
                           conv_kernel=(10, 3), num_conv_pos_embeddings=4,
                           num_conv_pos_embedding_groups=2, vocab_size=10)
    model = T.Wav2Vec2ForCTC(cfg).eval()
    audio = [torch.randn(2, 400), torch.randn(2, 320)]
    rec = preset("w8a8", "static_minmax", targets=["Conv1d"], ignore=["re:.*pos_conv_embed.*"])
    c = quantscope.calibrate(model, [{"input_values": a} for a in audio], rec, progress=False)
    first = "wav2vec2.feature_extractor.conv_layers.0.conv"
    assert torch.equal(c.states[first]["input"].qparams.scale.reshape(()),
                       _ao_tensor_scale(audio).reshape(()))


def test_last_dim_layout_leaves_other_widths_out_of_the_sample():
    """A run-time layout sampled along the last dim (``channel:1`` on a Conv1d): a batch of
    another length than the first is left out of the report's sample, without an error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 4, 5)).eval()
    batches = [torch.randn(2, 1, 40), torch.randn(2, 1, 30)]
    per_channel = Role(QuantSpec("int8", "channel:1"), "minmax", dynamic=True)
    rec = Recipe(Rule(("Conv1d",), input=per_channel))
    c = quantscope.calibrate(model, batches, rec, sampling=ALL_ROWS, progress=False)
    assert _row(c, "0", "input")["numel"] == batches[0].numel()


@pytest.mark.parametrize("channels_last", [False, True])
def test_row_sample_channel_rows(channels_last):
    """Rows along the channel axis: the same rows, drawn with the same generator, as
    ``x.movedim(1, -1).reshape(-1, C)`` indexed by one randperm per batch (NCHW is gathered,
    channels-last read as a view)."""
    xs = [torch.randn(2, 3, 4, 5), torch.randn(2, 3, 6, 2)]
    if channels_last:
        xs = [x.contiguous(memory_format=torch.channels_last) for x in xs]
    s = RowSample(30, 2, torch.Generator().manual_seed(0), axis=-3, skip_other_widths=True)
    gen, ref = torch.Generator().manual_seed(0), []
    for x, take in zip(xs, (15, 15), strict=True):
        s.add(x)
        rows = x.movedim(1, -1).reshape(-1, 3)
        ref.append(rows[torch.randperm(rows.shape[0], generator=gen)[:take]])
    assert torch.equal(s.rows(), torch.cat(ref))


def test_row_sample_skips_other_widths():
    s = RowSample(8, 2, torch.Generator(), skip_other_widths=True)
    s.add(torch.randn(2, 5))
    s.add(torch.randn(2, 6))  # left out, no error
    assert s.rows().shape == (2, 5)


# ------------------------------------------------------------------ ConvTranspose weights
def _ct_model(groups=1):
    torch.manual_seed(0)
    return nn.Sequential(nn.ConvTranspose2d(4, 6, 2, stride=2, groups=groups)).eval()


def _weight_only():
    return Recipe(Rule(("ConvTranspose2d",),
                       weight=Role(QuantSpec("int8", "channel"), "memoryless_minmax")))


def test_convtranspose_weight_scales_per_output_channel():
    """Per-channel weights of a ConvTranspose2d: one scale per output channel (axis 1), bit
    for bit torch.ao's PerChannelMinMaxObserver(ch_axis=1)."""
    model = _ct_model()
    c = quantscope.calibrate(model, [torch.randn(1, 4, 4, 4)],
                             preset("w8a8", targets=["ConvTranspose2d"]), progress=False)
    w = model[0].weight.detach()
    ao = PerChannelMinMaxObserver(ch_axis=1, dtype=torch.qint8,
                                  qscheme=torch.per_channel_symmetric)
    ao(w)
    st = c.states["0"]["weight"]
    assert st.spec.layout.axis == 1
    assert torch.equal(st.qparams.scale.flatten(), ao.calculate_qparams()[0])
    assert _row(c, "0", "weight")["units"] == 6


def test_convtranspose_applied_and_saved(tmp_path):
    """The applied ConvTranspose2d computes F.conv_transpose2d with its weight fake-quantized
    per output channel (``clamp(round(w / s), -128, 127) * s`` with torch.ao's scales
    ``s``, one per index of axis 1); save / load gives the same."""
    model = _ct_model()
    x = torch.randn(2, 4, 5, 5)
    c = quantscope.calibrate(model, [x], _weight_only(), progress=False)
    m = model[0]
    ao = PerChannelMinMaxObserver(ch_axis=1, dtype=torch.qint8,
                                  qscheme=torch.per_channel_symmetric)
    ao(m.weight.detach())
    s = ao.calculate_qparams()[0].reshape(1, -1, 1, 1)
    wq = (m.weight.detach() / s).round().clamp(-128, 127) * s
    with torch.no_grad():
        expected = F.conv_transpose2d(x, wq, m.bias, stride=2)
    with torch.no_grad(), c.apply(model):
        assert torch.equal(model(x), expected)
    c.save(tmp_path / "q")
    back = quantscope.calibrate.load(tmp_path / "q")
    assert back.states["0"]["weight"].spec == c.states["0"]["weight"].spec
    with torch.no_grad(), back.apply(model):
        assert torch.equal(model(x), expected)


def test_grouped_convtranspose_per_channel_weight_refused():
    model = _ct_model(groups=2)
    with pytest.raises(ValueError, match=r"layer '0' \(ConvTranspose2d, groups=2\) weight: "
                                         r"per-channel .* needs groups == 1"):
        quantscope.calibrate(model, [torch.randn(1, 4, 4, 4)], _weight_only(), progress=False)


@pytest.mark.parametrize("conv", [nn.Conv2d(64, 32, 1), nn.Conv2d(64, 32, 3),
                                  nn.Conv1d(64, 32, 5), nn.ConvTranspose2d(64, 32, 3)],
                         ids=["1x1", "3x3", "conv1d", "transpose"])
@pytest.mark.parametrize("recipe", ["mxfp4", "nvfp4", "w4a16", "tile"])
def test_units_along_a_conv_kernel_are_refused(conv, recipe):
    """Groups, blocks and tiles run along the last dim, on a conv weight the kernel's width:
    probing found MXFP4 / NVFP4 taken silently as blocks of 1 or 3 values (a 1x1 conv's scale
    per weight) and a tile padding each 3x3 kernel to 128x128 (1,800x the weight's memory)."""
    rule = (preset(recipe, targets=[type(conv).__name__]) if recipe != "tile" else
            Recipe([Rule((type(conv).__name__,),
                         weight=Role(QuantSpec("fp8_e4m3", "tile:128x128"), "minmax"))]))
    x = torch.randn(2, 64, *(8,) * (conv.weight.dim() - 2))
    with pytest.raises(ValueError, match=rf"layer '0' \({type(conv).__name__}\) weight of shape "
                                         rf".* along the kernel dims .* along a channel axis"):
        quantscope.calibrate(nn.Sequential(conv), [x], rule, progress=False)


def test_blocks_along_a_conv_input_channels_calibrate():
    """The refusal's way out: blocks along axis 1 (a Conv's input channels) calibrate, apply
    and give the weight's QDQ as a standalone observer's qparams do."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(64, 32, 3, padding=1))
    spec = QuantSpec("fp4_e2m1", "block:32:1", scale="e8m0")
    calib = quantscope.calibrate(model, [torch.randn(2, 64, 8, 8)],
                                 Recipe([Rule(("Conv2d",), weight=Role(spec, "minmax"))]),
                                 progress=False)
    w = model[0].weight.detach().clone()
    obs = quantscope.get_observer("memoryless_minmax", spec)
    obs(w)
    scale = calib.states["0"]["weight"].qparams.scale
    assert scale.numel() == 32 * 2 * 3 * 3  # one scale per 32 input channels of each tap
    with calib.apply(model):
        assert torch.equal(model[0].weight, quantscope.fake_quantize(w, obs.qparams(), spec))


def test_cli_group_size_check_leaves_a_conv_kernel_to_the_refusal():
    """The command line's indivisible-width check read an nn.Conv1d's kernel width (4) as its
    width: it offered --group-size / --on-indivisible float (which left the conv in float)
    where no group size fits; it now leaves such a conv to calibrate's refusal, and its
    sizes hint reads the Linears alone."""
    from quantscope.cli.checks import UsageError
    from quantscope.cli.recipes import _indivisible

    model = nn.Sequential(nn.Conv1d(128, 128, 4, groups=128), nn.Linear(96, 64))
    rec = preset("w4a16", targets=["Conv1d", "Linear"])
    with pytest.raises(UsageError, match=r"layer '1' has width 96, which group size 128 does "
                                         r"not divide \(1 such layers\); --group-size 16 / 32 "
                                         r"/ 96 would"):
        _indivisible(rec, model, "error")
    assert _indivisible(rec, model, "float").ignore == ("1",)
    with pytest.raises(ValueError, match=r"layer '0' \(Conv1d\) .* along the kernel dims \(4,\)"):
        quantscope.calibrate(model, [torch.randn(2, 128, 8)], preset(
            "w4a16", targets=["Conv1d"]), progress=False)


@pytest.mark.parametrize("layout", ["block:32", "group:4", "tile:4x4", "block:32:1"])
def test_run_time_activation_units_along_a_conv_image_are_refused(layout):
    """A conv input's blocks along the last dim run along the image's width (8 pixels of one
    channel, padded to 32), which probing found taken silently; along the channels (axis 1)
    they calibrate and apply."""
    spec = (QuantSpec("fp4_e2m1", layout, scale="e8m0") if layout.startswith("block") else
            QuantSpec("int8", layout))
    rule = Recipe(Rule(("Conv2d",), weight=Role(QuantSpec("int8", "channel:0"), "minmax"),
                       input=Role(spec, "memoryless_minmax", True)))
    model, x = nn.Sequential(nn.Conv2d(64, 32, 3, padding=1)), torch.randn(2, 64, 8, 8)
    if layout == "block:32:1":
        with quantscope.calibrate(model, [x], rule, progress=False).apply(model):
            assert torch.isfinite(model(x)).all()
        return
    with pytest.raises(ValueError, match=r"layer '0' \(Conv2d\) input cannot take .* along the "
                                         r"spatial dims of \[batch, channels, \*spatial\]"):
        quantscope.calibrate(model, [x], rule, progress=False)
