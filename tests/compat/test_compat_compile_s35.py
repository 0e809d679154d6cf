"""Compat observers compile as their toolkits' classes do (probe s35): llm-compressor 0.14's
weight observers and Quark 0.13's per-tensor min-max / placeholder observers trace with
``torch.compile(fullgraph=True)`` and ``torch.export``; quantscope's broke the graph (a host
read of the weight's finiteness; Quark's token count through numpy), values alike."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.peers
pytest.importorskip("llmcompressor")
pytest.importorskip("quark")
sys.path.insert(0, str(Path(__file__).parent))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers import Observer as Theirs
    from quark_twins import quark_twins

from quantscope.compat.llmcompressor import Observer as Ours


class _Holder(torch.nn.Module):
    def __init__(self, observer):
        super().__init__()
        self.observer = observer

    def forward(self, x):
        self.observer(x)
        return x * 2


def _compiled(observer, x):
    torch._dynamo.reset()
    torch.compile(_Holder(observer), backend="eager", fullgraph=True)(x)
    return observer


@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "minmax"])
def test_llmcompressor_weight_observers_compile_fullgraph(name):
    logging.disable(logging.WARNING)
    args = QuantizationArgs(num_bits=8, symmetric=True, strategy="channel")
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    got = {}
    for side, cls in (("ours", Ours), ("theirs", Theirs)):
        observer = cls.load_from_registry(name, base_name="weight", args=args)
        got[side] = _compiled(observer, x).get_qparams()
    assert torch.equal(got["ours"]["scale"], got["theirs"]["scale"])
    assert torch.equal(got["ours"]["zero_point"], got["theirs"]["zero_point"])


def test_a_non_finite_weight_traced_is_refused_when_its_qparams_are_made():
    args = QuantizationArgs(num_bits=8, symmetric=True, strategy="channel")
    x = torch.randn(8, 32)
    x[3, 4] = float("nan")
    observer = _compiled(Ours.load_from_registry("memoryless_minmax", base_name="weight",
                                                 args=args), x)
    with pytest.raises(ValueError, match="observed NaN or inf values"):
        observer.get_qparams()


@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name, kw", [("PerTensorMinMaxObserver", {"dtype": "int8",
                                                                   "symmetric": True}),
                                      ("PlaceholderObserver", {"dtype": "bfloat16"})])
def test_quark_per_tensor_observers_compile_fullgraph_and_export(name, kw):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with contextlib.redirect_stdout(io.StringIO()):
        theirs, ours = quark_twins(name, **kw)
    eager = quark_twins(name, **kw)[1]
    eager(x)
    _compiled(ours, x)
    _compiled(theirs, x)
    torch._dynamo.reset()
    torch.export.export(_Holder(quark_twins(name, **kw)[1]), (x,), strict=True)
    for a, b in ((ours, eager), (ours, theirs)):
        qa, qb = a._calculate_qparams(), b._calculate_qparams()
        assert (qa is None) == (qb is None)  # a placeholder's: none
        for ta, tb in zip(qa or (), qb or ()):
            assert torch.equal(ta, tb) if isinstance(ta, torch.Tensor) else ta == tb
