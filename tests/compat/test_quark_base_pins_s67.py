"""compat.quark's observer base (quark_base.py: ``QuarkObserver`` and its min-max mixin) where
the s67 mutation round found behaviour no .venv test pinned: which ``eps`` / ``zero_point_type``
arguments the constructor takes (a block-scaled spec given ``eps``, an int32 zero point type,
Pro's float32 one), the attributes Quark's constructors set, ``device``, ``extra_repr``, the
``ch_axis`` range check, integer input and Quark's token count, a module cast's range dtype,
the qparam shapes Quark returns, the given-range pricing of ``calculate_qparams`` and
``calculate_int_quant_params``, the NVFP4 all-zero scales, ``min_val`` / ``max_val`` before
data, ``del`` and ``reset_state``. Expected values come from Quark 0.13's observer code (quoted
in the docstrings), compat.quark's docstrings and docs/guide/pipelines.md; nothing imports
Quark."""

from __future__ import annotations

import pytest
import torch

from quantscope.compat import quark

F32_EPS = torch.finfo(torch.float32).eps
E8M0_MIN = 2.0 ** -127


def test_eps_with_block_e8m0_scales_is_taken_and_never_read():
    """UniformScalingObserver uses ``eps``; E8M0 block scales never read it (Quark's
    ``even_round``): an all-zero block still gets E8M0's smallest scale, 2**-127."""
    obs = quark.UniformScalingObserver({"dtype": "fp4", "qscheme": "per_group", "group_size": 4,
                                        "ch_axis": -1, "scale_format": "e8m0"}, eps=0.5)
    obs(torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0]]))
    scale, _ = obs.calculate_qparams()
    assert scale[0, 0].item() == E8M0_MIN


def test_int32_zero_point_type_is_taken_on_an_asymmetric_int():
    """Quark's ``ZeroPointType.int32`` is its AWQ formula (int zero points), quantscope's."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "uint8", "symmetric": False,
                                         "zero_point_type": "int32"})
    assert obs.zero_point_type == "int32"


def test_pro_takes_a_float32_zero_point_type():
    """docs: ``zero_point_type`` float32 raises ... (Pro ignores it, as Quark's)."""
    obs = quark.PerTensorHistogramObserverPro({"dtype": "uint8", "symmetric": False,
                                               "zero_point_type": "float32"})
    assert obs.zero_point_type == "float32"


def test_float32_zero_point_type_is_taken_on_a_symmetric_int():
    """Quark's symmetric branch never reads ``zero_point_type``: ``scale = amax / ((qmax -
    qmin) / 2)``, int32 zeros."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "int8", "symmetric": True,
                                         "zero_point_type": "float32"})
    obs(torch.tensor([-2.0, 1.0]))
    scale, zp = obs.calculate_qparams()
    assert scale.item() == pytest.approx(2.0 / 127.5, rel=1e-6)
    assert zp.item() == 0 and zp.dtype == torch.int32


def test_device_moves_quarks_buffers():
    """Quark registers its buffers on ``device``: ``eps`` is there after construction."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "int8", "symmetric": True}, device="meta")
    assert obs.eps.device.type == "meta"


def test_block_attributes_are_group_size_and_ch_axis():
    """Quark's PerBlockMXObserver: ``self.block_size = qspec.group_size``, ``self.axis =
    qspec.ch_axis``."""
    obs = quark.PerBlockMXObserver({"dtype": "mx", "mx_element_dtype": "fp4", "group_size": 32,
                                    "ch_axis": 0})
    assert (obs.block_size, obs.axis) == (32, 0)


def test_extra_repr_is_quarks_range_or_dtype():
    """Quark's ``extra_repr``: ``f"min_val={self.min_val}, max_val={self.max_val}"``
    (uniform scaling), ``f"dtype={self.dtype}"`` (PlaceholderObserver)."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "int8", "symmetric": True})
    obs(torch.tensor([-2.0, 1.0]))
    assert obs.extra_repr() == "min_val=-2.0, max_val=1.0"
    assert quark.PlaceholderObserver({"dtype": "float16"}).extra_repr() == "dtype=float16"


def test_per_channel_fp8_drops_eps_for_a_zero_channel():
    """Quark's per-channel ``super().__init__(qspec, device)`` drops ``eps``: its buffer is
    float32's eps, the fp8 scale of an all-zero channel too (``masked_fill(scale == 0, eps)``);
    ``448 / 448 = 1`` for the other."""
    obs = quark.PerChannelMinMaxObserver({"dtype": "fp8_e4m3", "qscheme": "per_channel",
                                          "ch_axis": 0}, eps=0.5)
    assert obs.eps.item() == F32_EPS
    obs(torch.tensor([[0.0, 0.0], [1.0, -448.0]]))
    scale, _ = obs.calculate_qparams()
    assert scale.tolist() == [F32_EPS, 1.0]


def _per_channel(ch_axis: int, dtype: str = "int8") -> quark.PerChannelMinMaxObserver:
    return quark.PerChannelMinMaxObserver({"dtype": dtype, "symmetric": True,
                                           "qscheme": "per_channel", "ch_axis": ch_axis})


def test_ch_axis_equal_to_the_rank_is_quarks_index_error():
    with pytest.raises(IndexError, match="ch_axis=2 is out of range"):
        _per_channel(2)(torch.ones(2, 3))


def test_ch_axis_minus_the_rank_is_the_first_axis():
    """``ch_axis=-2`` of a 2-D tensor: one channel per row, ``amax / 127.5`` each."""
    obs = _per_channel(-2)
    obs(torch.tensor([[1.0, -2.0, 3.0], [4.0, 5.0, -6.0]]))
    scale, _ = obs.calculate_qparams()
    assert scale.tolist() == pytest.approx([3.0 / 127.5, 6.0 / 127.5], rel=1e-6)


def test_an_empty_batch_passes_over_an_out_of_range_ch_axis():
    """Quark's forward returns an empty batch before it reads ``ch_axis``."""
    obs = _per_channel(2)
    x = torch.ones(0, 3)
    assert obs(x) is x
    assert obs.min_val.item() == float("inf")


def test_integer_input_is_returned_as_it_is():
    """Quark's forward returns ``x_orig``; its ``min_val`` takes the input's dtype."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "int8", "symmetric": True})
    x = torch.tensor([[3, -1], [0, 0]], dtype=torch.int32)
    assert obs(x) is x
    assert obs.min_val.dtype == torch.int32 and obs.min_val.item() == -1


def test_half_cast_after_data_turns_range_and_scale_float16():
    """A module cast converts Quark's min_val / max_val / eps buffers: the symmetric int scale
    ``max(amax / 127.5, eps)`` is then float16."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "int8", "symmetric": True})
    obs(torch.tensor([-2.0, 1.0]))
    obs.half()
    assert obs.min_val.dtype == obs.max_val.dtype == torch.float16
    scale, _ = obs.calculate_qparams()
    assert scale.dtype == torch.float16
    assert scale.item() == torch.tensor(2.0, dtype=torch.float16).div(127.5).item()


def test_a_single_channel_keeps_quarks_one_element_shape():
    """Quark's per-channel ``aminmax(y, dim=1)``: ``(C,)`` statistics and qparams, C = 1 too."""
    obs = quark.PerChannelMinMaxObserver({"dtype": "uint8", "symmetric": False,
                                          "qscheme": "per_channel", "ch_axis": 0})
    obs(torch.tensor([[1.0, -2.0, 3.0]]))
    scale, zp = obs.calculate_qparams()
    assert scale.shape == zp.shape == obs.min_val.shape == (1,)


def _uint8_channels() -> quark.PerChannelMinMaxObserver:
    return quark.PerChannelMinMaxObserver({"dtype": "uint8", "symmetric": False,
                                           "qscheme": "per_channel", "ch_axis": 0})


def test_unobserved_default_needs_both_ends_unobserved():
    """Quark's ``check_min_max_valid`` returns the default only for ``(inf, -inf)``; ``(inf,
    2)`` reaches ``assert min_val <= max_val``."""
    with pytest.raises(AssertionError):
        _uint8_channels().calculate_int_quant_params(torch.tensor(float("inf")),
                                                     torch.tensor(2.0))


def test_unobserved_default_is_for_a_0_dim_range_only():
    """Quark's ``(inf, -inf)`` test runs on 0-dim ranges; a wider one is checked by
    ``torch._assert_async(torch.all(min_val <= max_val))``: a RuntimeError, here
    InvertedRangeError."""
    with pytest.raises(quark.InvertedRangeError):
        _uint8_channels().calculate_int_quant_params(torch.full((2,), float("inf")),
                                                     torch.full((2,), float("-inf")))


def test_a_nan_range_is_not_called_inverted():
    """InvertedRangeError is ``min_val > max_val``; a NaN end is the non-finite ValueError."""
    with pytest.raises(ValueError, match="finite") as info:
        _uint8_channels().calculate_int_quant_params(torch.tensor(float("nan")),
                                                     torch.tensor(1.0))
    assert not isinstance(info.value, quark.InvertedRangeError)


def test_per_group_before_data_is_quarks_default_in_1_by_1():
    """Quark's default ``([1.], [0])`` of an unobserved range, reshaped to its per-group
    ``(rows, groups)``: ``(1, 1)``."""
    obs = quark.PerGroupMinMaxObserver({"dtype": "uint8", "symmetric": False,
                                        "qscheme": "per_group", "ch_axis": 1, "group_size": 2})
    scale, zp = obs.calculate_qparams()
    assert scale.shape == zp.shape == (1, 1)
    assert (scale.item(), zp.item()) == (1.0, 0)


def _fp4(scale_format: str, **kw) -> quark.PerTensorMinMaxObserver:
    return quark.PerTensorMinMaxObserver({"dtype": "fp4", "qscheme": "per_tensor",
                                          "scale_format": scale_format, **kw})


def test_e4m3_get_scale_with_one_zero_amax_is_quarks_two_levels():
    """Only an all-zero amax takes the native zero scales; ``[0, 6]``: Quark's
    ``(amax / 6 * 448 * 6 / 6).to(e4m3) / 448`` = ``[0, 1]``."""
    scale = _fp4("e4m3").get_scale(torch.tensor([0.0, 6.0]), F32_EPS, "e4m3")
    assert scale.tolist() == [0.0, 1.0]


def test_e4m3_all_zero_scales_take_scale_types_dtype():
    """Quark's e4m3 ``get_scale`` ends with ``scale.to(self.scale_torch_dtype)``."""
    obs = _fp4("e4m3", scale_type="bfloat16")
    assert obs.get_scale(torch.zeros(2), F32_EPS, "e4m3").dtype == torch.bfloat16


def test_e8m0_without_calculation_mode_rounds_even():
    """Quark: ``scale_calculation_mode is None`` -> ``even_round``: fp4's amax 7 rounds to 8
    (one mantissa bit), ``2 ** (3 - emax 2)`` = 2 (floor would give 1)."""
    assert _fp4("e8m0").get_scale(torch.tensor([7.0]), F32_EPS, "e8m0").tolist() == [2.0]


def test_half_cast_before_data_turns_the_unobserved_range_float16():
    """``.half()`` converts Quark's ``tensor(inf)`` / ``tensor(-inf)`` buffers too."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "int8", "symmetric": True})
    obs.half()
    assert obs.min_val.dtype == obs.max_val.dtype == torch.float16
    assert (obs.min_val.item(), obs.max_val.item()) == (float("inf"), float("-inf"))


def test_reset_puts_float32_inf_back_after_a_half_batch():
    """Quark's ``reset_min_max_vals``: ``self.min_val = torch.tensor(float("inf"))``."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "int8", "symmetric": True})
    obs(torch.tensor([1.0, 2.0], dtype=torch.float16))
    obs.reset_state()
    assert obs.min_val.dtype == obs.max_val.dtype == torch.float32
    assert (obs.min_val.item(), obs.max_val.item()) == (float("inf"), float("-inf"))


def test_reset_brings_a_deleted_statistic_back():
    """Quark's reset assigns ``min_val`` / ``max_val`` anew: a ``del`` lasts until then."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "int8", "symmetric": True})
    obs(torch.tensor([1.0, 2.0]))
    del obs.min_val
    with pytest.raises(AttributeError):
        obs.min_val  # noqa: B018
    obs.reset_state()
    assert obs.min_val.item() == float("inf")


def test_tokens_outlive_a_per_channel_start_over():
    """A static per-channel observer starts over when the channel count changes (Quark's
    state); the tokens are counted apart from it: 2 + 3 rows."""
    obs = _per_channel(0)
    obs(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    obs(torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 3.0]]))
    assert obs.max_val.tolist() == [1.0, 0.0, 3.0]
    assert int(obs.observed_tokens) == 5


def test_complex_input_is_refused_not_cast():
    """Only integer / bool data is taken as float32 values; complex is a TypeError."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "int8", "symmetric": True})
    with pytest.raises(TypeError):
        obs(torch.tensor([1 + 1j, -2 + 0j]))
    assert not obs.has_observed


@pytest.mark.parametrize("cast, dtype", [("half", torch.float16), ("double", torch.float64)])
def test_module_cast_converts_the_eps_buffer(cast, dtype):
    """docs: ``eps`` a non-persistent float32 buffer, converted by a module cast as Quark's."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "int8", "symmetric": True})
    getattr(obs, cast)()
    assert obs.eps.dtype == dtype
    assert obs.eps.item() == torch.tensor(F32_EPS, dtype=dtype).item()


def test_a_given_fp4_range_is_priced_by_its_scale_format():
    """Quark's ``calculate_qparams`` sends fp4 to ``calculate_fp4_quant_parameters``:
    ``get_scale(amax 7, "e8m0")``, even-rounded, is 2 (fp8's ``amax / 6`` is not)."""
    scale, zp = _fp4("e8m0").calculate_qparams(torch.tensor(-7.0), torch.tensor(3.0))
    assert (scale.item(), zp.item()) == (2.0, 0.0)


def test_float64_symmetric_scale_is_clamped_to_the_used_eps():
    """Quark: ``scale = torch.max(amax / 127.5, self.eps)`` in float64 for float64 input;
    UniformScalingObserver's eps 0.5 beats 1 / 127.5."""
    obs = quark.UniformScalingObserver({"dtype": "int8", "symmetric": True}, eps=0.5)
    obs(torch.tensor([0.0, 1.0], dtype=torch.float64))
    scale, zp = obs.calculate_qparams()
    assert scale.dtype == torch.float64 and scale.item() == 0.5 and zp.item() == 0


def test_int16_zero_point_of_a_float16_range_is_clamped_to_qmax():
    """Quark, float16 range [-1, -0.5], int16: ``scale = (0 - -1) / 65535`` in float16 is
    2**-16, ``qmin - round(-1 / 2**-16)`` = 32768, then ``torch.clamp(zero_point, quant_min,
    quant_max)``: 32767."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "int16", "symmetric": False})
    obs(torch.tensor([-1.0, -0.5], dtype=torch.float16))
    scale, zp = obs.calculate_qparams()
    assert scale.item() == 2.0 ** -16
    assert zp.item() == 32767


def test_fp6_histogram_before_data_is_quarks_integer_default():
    """Quark prices fp6 with ``calculate_int_quant_params``: an unobserved ``(inf, -inf)`` range
    returns its default ``([1.], [0])`` (the assert comes only with data)."""
    scale, zp = quark.PerTensorHistogramObserver({"dtype": "fp6_e2m3"}).calculate_qparams()
    assert (scale.tolist(), zp.tolist()) == ([1.0], [0])
    assert zp.dtype == torch.int64


def test_int_scale_takes_scale_types_dtype():
    """Quark's ``calculate_int_quant_params`` returns ``scale.to(self.scale_torch_dtype)``."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "uint8", "symmetric": False,
                                         "scale_type": "bfloat16"})
    obs(torch.tensor([1.0, 3.0]))
    scale, zp = obs.calculate_qparams()
    assert scale.dtype == torch.bfloat16
    assert scale.item() == torch.tensor(3.0 / 255, dtype=torch.bfloat16).item()
    assert zp.item() == 0


def test_fp8_pricing_moves_eps_to_the_ranges_dtype():
    """Quark's ``calculate_fp8_quant_parameters``: ``self.eps = self.eps.to(min_val.dtype)``;
    an all-zero float16 range's scale is that eps."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "fp8_e4m3"})
    obs(torch.zeros(2, dtype=torch.float16))
    scale, _ = obs.calculate_qparams()
    assert obs.eps.dtype == scale.dtype == torch.float16
    assert scale.item() == torch.tensor(F32_EPS, dtype=torch.float16).item()


def test_fp4_e5m3_scale_of_zeros_is_float32_eps():
    """Quark's e5m3 ``get_scale`` rounds eps (2**-23) to E5M3, whose smallest step is 2**-17:
    0; ``calculate_fp4_quant_parameters`` then fills ``scale == 0`` with float32's eps."""
    obs = _fp4("e5m3")
    obs(torch.zeros(2))
    scale, zp = obs.calculate_qparams()
    assert (scale.item(), zp.item()) == (F32_EPS, 0.0)


def test_fp8_scale_of_a_bfloat16_range_is_bfloat16():
    """Quark's float32 ``get_scale`` divides the bfloat16 amax by 448 in bfloat16 (no
    ``scale_type``: no cast)."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "fp8_e4m3"})
    obs(torch.tensor([1.0, 3.0], dtype=torch.bfloat16))
    scale, _ = obs.calculate_qparams()
    assert scale.dtype == torch.bfloat16
    assert scale.item() == torch.tensor(3.0, dtype=torch.bfloat16).div(448.0).item()


def test_fp4_without_scale_format_names_quarks_get_scale_before_data():
    with pytest.raises(ValueError, match="'fp4' needs a scale_format"):
        quark.PerTensorMinMaxObserver({"dtype": "fp4"}).calculate_qparams()


def test_bool_range_under_fp8_scales_is_quarks_not_implemented():
    """docs: where Quark's torch ops fail (``abs`` of a bool range under fp8 / fp4 scales) an
    UnsupportedInputError, a NotImplementedError as Quark's."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "fp8_e4m3"})
    obs(torch.tensor([True, False]))
    with pytest.raises(NotImplementedError, match="bool range"):
        obs.calculate_qparams()
