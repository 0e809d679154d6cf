"""The compat kernel engine (:mod:`quantscope.estimators.mse_compat`) has no
``float32_squares`` option (review s49): its terms are torch's float32 ``|d| ** norm``,
llm-compressor's arithmetic. It took the keyword, defaulting to True, and ignored it; now it
takes the other engines' options it has no use for as ``**_``, and answers alike whatever
the caller's ``float32_squares`` says."""

from __future__ import annotations

import inspect

import pytest
import torch

from quantscope import kernels
from quantscope.estimators import mse_compat, mse_search
from quantscope.spec import QuantSpec
from quantscope.stats.minmax import unit_minmax


def test_the_engine_names_no_option_it_ignores():
    params = inspect.signature(mse_compat.search).parameters
    assert "float32_squares" not in params
    assert params["_"].kind is inspect.Parameter.VAR_KEYWORD


@pytest.mark.skipif(not kernels.available("mse_pnorm"), reason="no C compiler")
@pytest.mark.parametrize("norm", [2.0, 3.0])
def test_its_answer_does_not_depend_on_float32_squares(norm):
    g = torch.Generator().manual_seed(0)
    u = torch.randn(24, 256, generator=g)
    lo, hi = unit_minmax(u)
    spec = QuantSpec("int4", "channel:0", symmetric=False)
    runs = []
    for sq32 in (False, True):
        mse_compat.STATS["units"] = 0
        runs.append(mse_search(u, lo, hi, spec, compat="llmcompressor", backend="kernel",
                               norm=norm, float32_squares=sq32))
        assert mse_compat.STATS["units"] == u.shape[0]  # the engine ran
    a, b = runs
    for name in ("lo", "hi", "index", "error"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
