"""Pins found by a mutation round (s68) on the block-scale searches' ops
(``kernels.block_ops``: ``nvfp4_mse``, ``nvfp4_search``, ``mx_mse`` and their pricing
``nvfp4_price`` / ``mx_price``) and the candidate pricing ops (``kernels.price_ops``:
``mse_price_int``, ``mse_price_fp``): the argument checks the CPU and the fake (meta)
implementations make alike, ``float32_squares`` and another ``norm``'s float32 power on both
CPU paths, weights of any strides, the ``same`` row of the first candidate (the incumbent is
its previous one), ``nvfp4_mse`` as ``mse_select`` of ``nvfp4_price``, the chunking of the
definitions' pricing, MX integer elements' full code range, the shapes and dtypes the fakes
promise, and which rows the Triton paths take."""

from __future__ import annotations

import pytest
import torch

from quantscope.kernels import block_ops, ops
from quantscope.qparams import e8m0_block_scales_op

DEVICES = ["cpu", "meta"]  # meta: the fake implementation, as torch.compile traces it
OTHER = {"cpu": "meta", "meta": "cpu"}  # a device that is not the units'


# ---- the block searches' arguments ---------------------------------------------------------

def _block_args(device, U=3, E=16, K=4):
    """A block search's tensors on ``device``: units, lo, hi, factors, inc_lo, inc_hi, amax."""
    units = torch.linspace(-1.0, 1.0, U * E).reshape(U, E).to(device)
    lo, hi = -torch.ones(U, device=device), torch.ones(U, device=device)
    factors = torch.linspace(1.0, 0.7, K, device=device)
    return [units, lo, hi, factors, lo.clone(), hi.clone(), torch.ones(1, device=device)]


def _call(op, args, weights=None, ext_start=2):
    """``op`` (``nvfp4_mse``, ``nvfp4_search`` or ``mx_mse``) on the tensors of
    :func:`_block_args` (``mx_mse`` drops the global amax)."""
    rules = (ext_start, -1, False, False, False)
    if op == "nvfp4_mse":
        return ops.nvfp4_mse(*args, "fp4_e2m1", 2.0 ** -9, *rules, weights)
    if op == "nvfp4_search":
        return ops.nvfp4_search(*args, "fp4_e2m1", 2.0 ** -9, weights)
    return ops.mx_mse(*args[:6], "fp4_e2m1", "floor", *rules, weights)


BLOCK_OPS = ["nvfp4_mse", "nvfp4_search", "mx_mse"]


def _bad_units(a, d):
    a[0] = a[0].reshape(3, 4, 4)


def _bad_inc_hi(a, d):
    a[5] = torch.ones(2, device=d)


def _float64_factors(a, d):
    a[3] = a[3].double()


def _factors_elsewhere(a, d):
    a[3] = torch.linspace(1.0, 0.7, 4, device=OTHER[d])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", BLOCK_OPS)
@pytest.mark.parametrize(("spoil", "said"), [
    (_bad_units, "units must be a 2-D"),
    (_bad_inc_hi, r"inc_hi must be a float32 tensor of shape \(3,\)"),
    (_float64_factors, "factors must be a non-empty 1-D float32"),
    (_factors_elsewhere, "factors must be a non-empty 1-D float32 tensor on {device}"),
    (None, r"weights must be None or a float32 \(3, 16\) tensor on {device}"),
], ids=["3d-units", "inc_hi-shape", "float64-factors", "factors-device", "weights-device"])
def test_block_searches_refuse_bad_arguments_naming_them(device, op, spoil, said):
    """The CPU and fake implementations refuse alike, naming the op and the argument
    (``None``: weights on another device than the units)."""
    args, weights = _block_args(device), None
    if spoil is None:
        weights = torch.ones(3, 16, device=OTHER[device])
    else:
        spoil(args, device)
    with pytest.raises(ValueError, match=rf"quantscope::{op}: " + said.format(device=device)):
        _call(op, args, weights)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["nvfp4_mse", "mx_mse"])
@pytest.mark.parametrize("ext_start", [-1, 5])
def test_block_searches_refuse_ext_start_outside_zero_to_candidates(device, op, ext_start):
    with pytest.raises(ValueError, match=rf"quantscope::{op}: ext_start must be in \[0, 4\]"):
        _call(op, _block_args(device), ext_start=ext_start)


@pytest.mark.parametrize("op", BLOCK_OPS)
def test_block_search_fakes_give_int64_indices_and_float64_errors_per_unit(op):
    idx, best = _call(op, _block_args("meta", U=5))
    assert idx.device.type == best.device.type == "meta"
    assert idx.shape == best.shape == (5,)
    assert idx.dtype == torch.int64 and best.dtype == torch.float64


@pytest.mark.parametrize("rules", [(True, False), (False, True), (True, True)])
def test_nvfp4_mse_is_mse_select_of_nvfp4_price(rules):
    """``nvfp4_mse``: ``mse_select``'s rules, each flag where it names it (``per_unit``, then
    ``use_global``), over :func:`nvfp4_price`'s candidates: per-unit patience and the global
    rule choose differently here."""
    g = torch.Generator().manual_seed(3)
    units = torch.randn(16, 16, generator=g) * torch.rand(16, 1, generator=g).add(0.1)
    lo, hi = torch.aminmax(units, dim=1)
    factors, amax = torch.linspace(1.0, 0.5, 12), units.abs().amax().reshape(1)
    args = (units, lo, hi, factors, lo * 1.3, hi * 1.3, amax, "fp4_e2m1", 2.0 ** -9)
    err, same = block_ops.nvfp4_price(*args)
    want = ops.mse_select(err[1:], same, err[0], 8, 1, *rules, False)
    got = ops.nvfp4_mse(*args, 8, 1, *rules, False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    other = ops.mse_select(err[1:], same, err[0], 8, 1, *rules[::-1], False)
    assert rules[0] == rules[1] or not torch.equal(other[0], want[0])  # the flags matter


# ---- the block searches' pricing -----------------------------------------------------------

def _units(U=5, E=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(U, E, generator=g) * torch.rand(U, 1, generator=g).add(0.1)


def _price(kind, units, factors, inc_scale=1.0, weights=None, amax=None):
    """``nvfp4_price`` (global amax ``amax``, else the units') or ``mx_price`` of ``units``
    over their own ranges, the incumbent the ranges times ``inc_scale``."""
    lo, hi = torch.aminmax(units, dim=1)
    inc = (lo * inc_scale, hi * inc_scale)
    if kind == "nvfp4":
        amax = units.abs().amax().reshape(1) if amax is None else amax
        return block_ops.nvfp4_price(units, lo, hi, factors, *inc, amax, "fp4_e2m1",
                                     2.0 ** -9, weights)
    return block_ops.mx_price(units, lo, hi, factors, *inc, "fp4_e2m1", "floor", weights)


@pytest.mark.parametrize("kind", ["nvfp4", "mx"])
def test_the_first_candidates_previous_block_scale_is_the_incumbents(kind):
    """``same[0]``: candidate 0's block scale equals the incumbent's (row 0 of the pricing):
    a first factor of 1 over an incumbent of the same ranges repeats its scales, so every
    unit's first candidate is a plateau of the incumbent and prices as it does."""
    units = _units()
    err, same = _price(kind, units, torch.tensor([1.0, 0.5]))
    assert same[0].all()
    assert torch.equal(err[1], err[0])
    # an incumbent of ranges 64 times narrower has other block scales: no plateau
    _, same = _price(kind, units, torch.tensor([1.0, 0.5]), inc_scale=2.0 ** -6)
    assert not same[0].any()


@pytest.mark.parametrize("kind", ["nvfp4", "mx"])
def test_pricing_chunk_by_chunk_of_units_prices_each_unit_as_alone(kind, monkeypatch):
    """The definitions price ``[candidates, chunk]`` block scales at a time: with chunks of
    two units (a chunk of 6 values over 3 rows), five weighted units, the last chunk one unit,
    price and plateau as they do in one chunk, each unit with its own weights."""
    units = _units()
    weights = torch.rand(units.shape, generator=torch.Generator().manual_seed(1))
    factors = torch.tensor([1.0, 0.8])
    want = _price(kind, units, factors, 2.0, weights)
    monkeypatch.setattr(block_ops, "_BLOCK_CHUNK", 6)
    got = _price(kind, units, factors, 2.0, weights)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for u in range(units.shape[0]):  # and each unit as priced alone
        alone = _price(kind, units[u:u + 1], factors, 2.0, weights[u:u + 1],
                       units.abs().amax().reshape(1))
        assert torch.equal(alone[0][:, 0], want[0][:, u])


def test_mx_int8_elements_reach_code_minus_128():
    """Signed integer MX elements (accepted by ``mx_mse``) take the format's whole code range
    ``[qmin, qmax] = [-128, 127]``: an element of -(2 - 2 ** -8) under the E8M0 scale 2 ** -6
    of its range (amax in [1, 2), emax 6) is -127.75 codes, rounded to -128: an error of
    2 ** -8 (clamped to -127 it would be 3 * 2 ** -8). Half the range (scale 2 ** -7) clamps
    it to -1: the search keeps the incumbent, whose first candidate only ties it."""
    x = -(2.0 - 2.0 ** -8)
    units = torch.tensor([[x, 0.0]])
    lo, hi = torch.tensor([x]), torch.tensor([0.0])
    assert e8m0_block_scales_op(lo, hi, "int8", "floor").item() == 2.0 ** -6
    err, _ = block_ops.mx_price(units, lo, hi, torch.tensor([1.0]), lo, hi, "int8", "floor")
    assert err.tolist() == [[2.0 ** -16], [2.0 ** -16]]
    idx, best = ops.mx_mse(units, lo, hi, torch.tensor([1.0, 0.5]), lo, hi, "int8", "floor", 2,
                           -1, False, False, False)
    assert idx.tolist() == [-1] and best.tolist() == [2.0 ** -16]


# ---- the pricing ops' arguments ------------------------------------------------------------

def _price_args(device, U=3, E=4, K=2):
    units = torch.linspace(-1.0, 1.0, U * E, device=device).reshape(U, E)
    return units, torch.ones(K, U, device=device), torch.zeros(K, U, dtype=torch.int32,
                                                               device=device)


def _price_call(op, units, scale, zp, weights=None, norm=2.0):
    if op == "mse_price_int":
        return ops.mse_price_int(units, scale, zp, -8.0, 7.0, weights, norm)
    return ops.mse_price_fp(units, scale, 6.0, 0, 1, weights, norm)


PRICE_OPS = ["mse_price_int", "mse_price_fp"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", PRICE_OPS)
@pytest.mark.parametrize("shape", [(12,), (3, 2, 2)])
def test_prices_refuse_units_not_2d(device, op, shape):
    units, scale, zp = _price_args(device)
    with pytest.raises(ValueError, match=rf"quantscope::{op}: units must be a 2-D float32"):
        _price_call(op, units.reshape(shape), scale, zp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", PRICE_OPS)
def test_prices_refuse_a_0d_scale_with_their_value_error(device, op):
    units, _, zp = _price_args(device)
    with pytest.raises(ValueError, match=rf"quantscope::{op}: scale must be a torch.float32 "
                                         r"\[candidates, 3\]"):
        _price_call(op, units, torch.ones((), device=device), zp)


@pytest.mark.parametrize("device", DEVICES)
def test_mse_price_int_refuses_zero_points_of_other_candidates_than_the_scales(device):
    units, scale, _ = _price_args(device, K=2)
    zp = torch.zeros(3, 3, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"quantscope::mse_price_int: zero_point must be a "
                                         r"torch.int32 \[candidates, 3\] tensor on .* \(scale "
                                         "and zero_point of one shape\\)"):
        _price_call("mse_price_int", units, scale, zp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", PRICE_OPS)
def test_prices_refuse_a_scale_on_another_device(device, op):
    units, _, zp = _price_args(device)
    with pytest.raises(ValueError, match=rf"quantscope::{op}: scale must be a torch.float32 "
                                         rf"\[candidates, 3\] tensor on {device}"):
        _price_call(op, units, torch.ones(2, 3, device=OTHER[device]), zp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", PRICE_OPS)
@pytest.mark.parametrize("bad", ["wide", "float64", "device"])
def test_prices_refuse_weights_not_float32_of_the_units_shape_on_their_device(device, op, bad):
    units, scale, zp = _price_args(device)
    weights = {"wide": lambda: torch.ones(3, 5, device=device),
               "float64": lambda: torch.ones(3, 4, dtype=torch.float64, device=device),
               "device": lambda: torch.ones(3, 4, device=OTHER[device])}[bad]()
    with pytest.raises(ValueError, match=rf"quantscope::{op}: weights must be None or a float32 "
                                         rf"\(3, 4\) tensor on {device}"):
        _price_call(op, units, scale, zp, weights)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", PRICE_OPS)
@pytest.mark.parametrize("norm", [0.0, -2.0])
def test_prices_refuse_a_norm_not_positive(device, op, norm):
    units, scale, zp = _price_args(device)
    with pytest.raises(ValueError, match=rf"quantscope::{op}: norm must be a finite number in "
                                         r"\(0.0, inf\)"):
        _price_call(op, units, scale, zp, norm=norm)


@pytest.mark.parametrize("op", PRICE_OPS)
def test_price_fakes_are_float64_candidates_by_units(op):
    err = _price_call(op, *_price_args("meta", U=3, K=5))
    assert err.device.type == "meta" and err.shape == (5, 3) and err.dtype == torch.float64


@pytest.mark.parametrize("c_kernel", [True, False])
@pytest.mark.parametrize("op", PRICE_OPS)
def test_float32_squares_round_each_square_to_float32(monkeypatch, op, c_kernel):
    """Under a scale of 2 ** 100 an element of 1 + 2 ** -12 fake-quantizes to 0: its error's
    exact square is 1 + 2 ** -11 + 2 ** -24; ``float32_squares`` rounds it to float32 first,
    a tie to even, 1 + 2 ** -11. On the C kernel and on the torch path alike."""
    from quantscope.kernels import price_ops

    if not c_kernel:
        monkeypatch.setattr(price_ops, "_c_lib", lambda name: None)
    units, scale = torch.tensor([[1.0 + 2.0 ** -12]]), torch.full((1, 1), 2.0 ** 100)
    zp = torch.zeros(1, 1, dtype=torch.int32)
    for squares, want in ((False, 1.0 + 2.0 ** -11 + 2.0 ** -24), (True, 1.0 + 2.0 ** -11)):
        if op == "mse_price_int":
            err = ops.mse_price_int(units, scale, zp, -8.0, 7.0, float32_squares=squares)
        else:
            err = ops.mse_price_fp(units, scale, 6.0, 0, 1, float32_squares=squares)
        assert err.tolist() == [[want]]


@pytest.mark.parametrize("op", PRICE_OPS)
def test_another_norm_takes_the_float32_power(op):
    """Another ``norm`` (3: the torch path) takes each term as ``float64(|d| ** norm)`` of
    torch's float32 power, not the float64 power: an element of 1 + 2 ** -12 fake-quantized
    to 0 (a scale of 2 ** 100) prices the float32 cube of its error, which the float64 cube
    1 + 3 * 2 ** -12 + 3 * 2 ** -24 + 2 ** -36 is not."""
    x = 1.0 + 2.0 ** -12
    units, scale = torch.tensor([[x]]), torch.full((1, 1), 2.0 ** 100)
    err = _price_call(op, units, scale, torch.zeros(1, 1, dtype=torch.int32), norm=3.0)
    want = float(torch.tensor(x).pow(3.0))
    assert want != 1.0 + 3 * 2.0 ** -12 + 3 * 2.0 ** -24 + 2.0 ** -36
    assert err.tolist() == [[want]]


@pytest.mark.parametrize("op", PRICE_OPS)
def test_weights_whose_rows_are_strided_price_as_their_values(op):
    """``weights`` are one value per element whatever their strides: a transposed ``[E, U]``
    tensor's view prices as its contiguous copy (the C kernel reads a contiguous one)."""
    g = torch.Generator().manual_seed(2)
    units, weights = torch.randn(4, 8, generator=g), torch.rand(4, 8, generator=g)
    scale = torch.rand(3, 4, generator=g).add(0.05)
    zp = torch.zeros(3, 4, dtype=torch.int32)
    strided = weights.t().contiguous().t()
    assert strided.stride(1) != 1
    want = _price_call(op, units, scale, zp, weights)
    assert torch.equal(_price_call(op, units, scale, zp, strided), want)


# ---- the Triton paths' selection (``device``: CUDA, or the CPU under Triton's interpreter) --

def test_block_searches_take_the_triton_path_for_rows_up_to_one_tile(device):
    """``_block_kernel``: rows of ``MAX_TILE`` elements go to the Triton searches; only rows
    longer than a tile take the definition."""
    kernel = block_ops._block_kernel(torch.zeros(2, 8, device=device), None)
    assert kernel is not None
    tile = kernel.MAX_TILE
    assert block_ops._block_kernel(torch.zeros(2, tile, device=device), None) is kernel
    assert block_ops._block_kernel(torch.zeros(2, tile + 1, device=device), None) is None


def test_block_searches_take_the_definition_for_units_whose_rows_are_strided(device):
    """Units whose rows are not contiguous (stride ``(1, U)``) never reach the Triton
    searches, which read a row as contiguous."""
    units = torch.zeros(16, 4, device=device).t()
    assert units.stride(1) != 1
    assert block_ops._block_kernel(units, None) is None
    assert block_ops._block_kernel(units.contiguous(), None) is not None


@pytest.mark.parametrize("op", PRICE_OPS)
def test_prices_of_units_and_weights_whose_rows_are_strided_are_the_cpu_prices(device, op):
    """The Triton pricing reads rows as contiguous: units and weights whose rows are strided
    (a transposed ``[E, U]`` tensor's view) price as their contiguous copies on the CPU."""
    from quantscope.kernels import price_ops

    g = torch.Generator().manual_seed(0)
    units, weights = torch.randn(4, 8, generator=g), torch.rand(4, 8, generator=g)
    scale = torch.rand(3, 4, generator=g).add(0.05)
    zp = torch.zeros(3, 4, dtype=torch.int32)
    strided = [t.t().contiguous().t().to(device) for t in (units, weights)]
    assert strided[0].stride(1) != 1 and strided[1].stride(1) != 1
    if op == "mse_price_int":
        want = ops.mse_price_int(units, scale, zp, -8.0, 7.0, weights)
        got = price_ops._cuda_mse_price_int(strided[0], scale.to(device), zp.to(device), -8.0,
                                            7.0, strided[1])
    else:
        want = ops.mse_price_fp(units, scale * 0.1, 6.0, 0, 1, weights)
        got = price_ops._cuda_mse_price_fp(strided[0], (scale * 0.1).to(device), 6.0, 0, 1,
                                           strided[1])
    torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=0)
