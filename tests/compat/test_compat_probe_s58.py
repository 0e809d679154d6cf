"""Where probe s58 found the compat classes differ from their toolkits' (Quark 0.13,
llm-compressor 0.14), or found behaviour no test pinned, run in the peers' venv: an empty batch
to Quark's per-channel / per-group observers (passed over, whatever its dimensions), negative
axes, the torch.ao-backed ``PerTensorHistogramObserverPro`` (``reduce_range``, a batch with inf,
its old import path and pickles)."""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import warnings

import pytest
import torch

pytestmark = pytest.mark.peers

pytest.importorskip("quark")
pytest.importorskip("llmcompressor")
with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers import Observer as Theirs
from quark_twins import qo, quark_config, quark_twins

from quantscope.compat import quark
from quantscope.compat.llmcompressor import Observer as Ours


def _quiet(fn, *args):
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return fn(*args)
    finally:
        logging.disable(logging.NOTSET)


AXIS_CLASSES = [("PerChannelMinMaxObserver", {"qscheme": "per_channel"}),
                ("PerGroupMinMaxObserver", {"qscheme": "per_group", "group_size": 8})]


@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize(("name", "kw"), AXIS_CLASSES)
@pytest.mark.parametrize("shape", [(0,), (0, 16), (16, 0)])
@pytest.mark.parametrize("axis", [1, 3])
def test_an_empty_batch_is_passed_over_whatever_its_axes(name, kw, shape, axis):
    """An empty 1-D batch with ch_axis=1 raised AxisRangeError; Quark passes it over."""
    theirs, ours = quark_twins(name, dtype="int8", symmetric=True, ch_axis=axis, **kw)
    for obs in (theirs, ours):
        _quiet(obs, torch.empty(shape))
    assert not ours.has_observed


@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize(("name", "kw"), AXIS_CLASSES)
@pytest.mark.parametrize(("axis", "shape"), [(-2, (16, 8)), (-1, (16,)), (-1, (4, 16))])
def test_negative_axes_inside_the_batch_are_quarks(name, kw, axis, shape):
    theirs, ours = quark_twins(name, dtype="int8", symmetric=True, ch_axis=axis, **kw)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    for obs in (theirs, ours):
        _quiet(obs, x)
    for a, b in zip(_quiet(theirs._calculate_qparams), ours._calculate_qparams(), strict=True):
        assert a.shape == b.shape and torch.equal(a, b.to(a.dtype)), (a, b)


@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize(("dtype", "symmetric", "codes"),
                         [("uint8", False, (0, 127)), ("int8", True, (-64, 63))])
def test_pro_reduce_range_halves_the_codes_of_its_native_qparams(dtype, symmetric, codes):
    """``reduce_range=True``: Quark's torch.ao child uses half the codes, so the native
    ``qparams()`` (what quantscope's exporters read) must too, equal to Quark's."""
    c = quark_config("PerTensorHistogramObserverPro", dtype=dtype, symmetric=symmetric)
    theirs = qo.PerTensorHistogramObserverPro(c, None, reduce_range=True)
    ours = quark.PerTensorHistogramObserverPro(c, None, reduce_range=True)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0)) + 1
    for obs in (theirs, ours):
        _quiet(obs, x)
    assert (ours.spec.qmin, ours.spec.qmax) == codes
    scale, zp = _quiet(theirs._calculate_qparams)
    qp = ours.qparams()
    assert torch.equal(qp.scale.reshape(-1), scale.reshape(-1).float())
    assert torch.equal(qp.zero_point.reshape(-1).long(), zp.reshape(-1).long())


@pytest.mark.xdist_group("quark")
def test_pro_counts_the_tokens_of_a_batch_with_inf_as_of_any_batch():
    """torch.ao drops the inf; the batch still counts its rows once (not one more)."""
    c = quark_config("PerTensorHistogramObserverPro", dtype="int8", symmetric=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    x[1, 2] = float("inf")
    with_inf, finite = quark.PerTensorHistogramObserverPro(c), quark.PerTensorHistogramObserverPro(c)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with_inf(x)
    finite(torch.randn(4, 8))
    assert int(with_inf.observed_tokens) == int(finite.observed_tokens) == 4


@pytest.mark.xdist_group("quark")
def test_pro_loads_from_its_old_module():
    """Pro moved from compat.quark_histogram to compat.quark_pro (s57): the old import path
    and a pickle that names it still load."""
    from quantscope.compat.quark_histogram import PerTensorHistogramObserverPro as Old

    assert Old is quark.PerTensorHistogramObserverPro
    obs = quark.PerTensorHistogramObserverPro(
        quark_config("PerTensorHistogramObserverPro", dtype="int8", symmetric=True))
    obs(torch.randn(8, 16, generator=torch.Generator().manual_seed(1)))
    old = pickle.dumps(obs, protocol=2).replace(b"quantscope.compat.quark_pro\n",
                                                b"quantscope.compat.quark_histogram\n")
    assert b"quark_histogram" in old
    back = pickle.loads(old)
    for a, b in zip(back._calculate_qparams(), obs._calculate_qparams(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["memoryless_mse", "mse"])
@pytest.mark.parametrize(("bits", "kind"), [(8, "int"), (4, "int"), (8, "float")])
@pytest.mark.parametrize("below", [0.95, 0.25])
def test_mse_candidates_keep_scales_below_float32_eps_as_theirs(name, bits, kind, below):
    """compressed-tensors replaces only a zero scale by eps; the search floored candidate
    scales at float32's eps, so ranges below ~qmax * 2**-23 chose other candidates."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 16, generator=g)
    base = base / base.abs().amax(dim=1, keepdim=True)
    qmax = {("int", 8): 127.5, ("int", 4): 7.5, ("float", 8): 448.0}[(kind, bits)]
    x = base * (qmax * 2 ** -23 * below)
    args = {"num_bits": bits, "type": kind, "symmetric": True, "strategy": "channel"}
    got = []
    for cls in (Theirs, Ours):
        obs = cls.load_from_registry(name, base_name="weight", args=QuantizationArgs(**args))
        _quiet(obs, x)
        got.append((obs.min_vals, obs.max_vals))
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b), (a, b)
