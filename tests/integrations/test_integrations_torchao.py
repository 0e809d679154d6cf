"""quantscope's torch.ao-signature observers in torch's own flows: torch.ao eager and FX
``QConfig`` prepare / convert, and torchao's pt2e ``QuantizationSpec`` (PTQ and QAT): the
converted model's outputs are bitwise those of torch's own observers (a histogram's growing
ranges too)."""

from __future__ import annotations

import pytest
import torch
from torch.ao import quantization as tq

from quantscope.compat import torch_ao as qa

torch.set_num_threads(1)


class Net(torch.nn.Module):
    def __init__(self, stubs=False):
        super().__init__()
        self.quant = tq.QuantStub() if stubs else torch.nn.Identity()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.fc = torch.nn.Linear(8 * 6 * 6, 10)
        self.dequant = tq.DeQuantStub() if stubs else torch.nn.Identity()

    def forward(self, x):
        x = torch.relu(self.conv(self.quant(x)))
        return self.dequant(self.fc(x.flatten(1)))


def _data():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, 8, 8, generator=g) * (3 if i == 0 else 1) for i in range(4)]


def _model(stubs=False):
    torch.manual_seed(0)
    return Net(stubs).eval()


OBSERVERS = {  # name -> (torch's activation, weight), (quantscope's)
    "minmax": ((tq.MinMaxObserver, tq.PerChannelMinMaxObserver),
               (qa.MinMaxObserver, qa.PerChannelMinMaxObserver)),
    "histogram": ((tq.HistogramObserver, tq.PerChannelMinMaxObserver),
                  (qa.HistogramObserver, qa.PerChannelMinMaxObserver)),
}


def _qconfig(act, weight):
    return tq.QConfig(
        activation=act.with_args(dtype=torch.quint8, qscheme=torch.per_tensor_affine),
        weight=weight.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric))


def test_with_args_and_observer_base():
    ctor = qa.HistogramObserver.with_args(bins=256).with_args(dtype=torch.qint8)
    obs = ctor()
    assert isinstance(obs, tq.ObserverBase) and isinstance(obs, torch.nn.Module)
    assert obs.bins == 256 and obs.dtype == torch.qint8
    assert ctor.__name__ == "HistogramObserver"
    calls = []
    lazy = qa.MinMaxObserver.with_callable_args(dtype=lambda: calls.append(1) or torch.qint8)
    assert lazy().dtype == torch.qint8 and lazy().dtype == torch.qint8 and len(calls) == 2
    chained = qa.HistogramObserver.with_args(bins=64).with_callable_args(eps=lambda: 1e-3)
    assert chained.__name__ == "HistogramObserver"
    assert chained().bins == 64 and chained().eps == torch.tensor([1e-3])


@pytest.mark.parametrize("kind", list(OBSERVERS))
def test_eager_qconfig_converts_like_torch(kind):
    outs = []
    for act, weight in OBSERVERS[kind]:
        m = _model(stubs=True)
        m.qconfig = _qconfig(act, weight)
        p = tq.prepare(m)
        assert isinstance(p.quant.activation_post_process, act)  # the given class, observing
        for x in _data():
            p(x)
        q = tq.convert(p)
        assert isinstance(q.fc, torch.ao.nn.quantized.Linear)
        outs.append(q(_data()[1]))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kind", list(OBSERVERS))
def test_fx_qconfig_converts_like_torch(kind):
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    outs = []
    for act, weight in OBSERVERS[kind]:
        mapping = tq.QConfigMapping().set_global(_qconfig(act, weight))
        p = prepare_fx(_model(), mapping, example_inputs=(_data()[0],))
        for x in _data():
            p(x)
        outs.append(convert_fx(p)(_data()[1]))
    assert torch.equal(outs[0], outs[1])


# ------------------------------------------------------------------------------- pt2e
pt2e = pytest.importorskip("torchao.quantization.pt2e")
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
)

import quantscope.integrations.torchao as qt


class _Annotator(Quantizer):
    """int8 activations (per tensor, affine) and weights (per channel, symmetric) on every
    conv2d / linear input, each spec naming the given observer constructors."""

    def __init__(self, act, weight):
        super().__init__()
        self.act, self.weight = act, weight

    def annotate(self, gm):
        targets = (torch.ops.aten.conv2d.default, torch.ops.aten.linear.default)
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target in targets:
                a = QuantizationSpec(dtype=torch.int8, quant_min=-128, quant_max=127,
                                     qscheme=torch.per_tensor_affine, is_dynamic=False,
                                     observer_or_fake_quant_ctr=self.act)
                w = QuantizationSpec(dtype=torch.int8, quant_min=-127, quant_max=127,
                                     qscheme=torch.per_channel_symmetric, ch_axis=0,
                                     is_dynamic=False, observer_or_fake_quant_ctr=self.weight)
                n.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={n.args[0]: a, n.args[1]: w}, _annotated=True)
        return gm

    def validate(self, gm):
        pass


def _pt2e(act, weight, data):
    exported = torch.export.export(_model(), (data[0],)).module()
    prepared = prepare_pt2e(exported, _Annotator(act, weight))
    observers = [m for m in prepared.modules() if isinstance(m, pt2e.ObserverBase)]
    for x in data:
        prepared(x)
    return convert_pt2e(prepared), observers


PT2E = {
    "minmax": ((pt2e.MinMaxObserver, pt2e.PerChannelMinMaxObserver),
               (qt.MinMaxObserver, qt.PerChannelMinMaxObserver)),
    "histogram": ((pt2e.HistogramObserver.with_args(bins=256), pt2e.PerChannelMinMaxObserver),
                  (qt.HistogramObserver.with_args(bins=256), qt.PerChannelMinMaxObserver)),
    # probing: with_callable_args after with_args lost the class's __name__, which pt2e
    # reads (AttributeError in prepare_pt2e)
    "callable_args": ((pt2e.MinMaxObserver, pt2e.PerChannelMinMaxObserver.with_args(
                           eps=1e-4).with_callable_args(eps=lambda: 1e-5)),
                      (qt.MinMaxObserver, qt.PerChannelMinMaxObserver.with_args(
                          eps=1e-4).with_callable_args(eps=lambda: 1e-5))),
}


@pytest.mark.parametrize("kind", list(PT2E))
def test_pt2e_converts_like_torchao(kind):
    data = _data()
    outs = []
    for i, (act, weight) in enumerate(PT2E[kind]):
        converted, observers = _pt2e(act, weight, data)
        assert len(observers) == 4
        if i == 1:  # every observer pt2e inserted is quantscope's
            assert all(isinstance(o, qa.TorchAOObserver) for o in observers)
        ops = {str(n.target) for n in converted.graph.nodes if n.op == "call_function"}
        assert any("quantize_per_tensor" in o for o in ops)
        assert any("dequantize_per_channel" in o for o in ops)
        outs.append(converted(data[1]))
    assert torch.equal(outs[0], outs[1])


def test_pt2e_qat_fused_fake_quantize_takes_the_moving_averages():
    """torchao's FusedMovingAvgObsFakeQuantize (pt2e QAT) asserted that its observer is one of
    torchao's own moving averages (isinstance): quantscope's were refused."""
    from torchao.quantization.pt2e.fake_quantize import FusedMovingAvgObsFakeQuantize
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e

    data = _data()
    outs = []
    for mod in (pt2e, qt):
        fused = [FusedMovingAvgObsFakeQuantize.with_args(observer=cls) for cls in (
            mod.MovingAverageMinMaxObserver, mod.MovingAveragePerChannelMinMaxObserver)]
        torch.manual_seed(0)
        model = Net().train()
        prepared = prepare_qat_pt2e(torch.export.export(model, (data[0],)).module(),
                                    _Annotator(*fused))
        opt = torch.optim.SGD(prepared.parameters(), lr=0.01)
        for x in data:  # QAT steps: the fused op updates the observer's min / max buffers
            opt.zero_grad()
            prepared(x).square().mean().backward()
            opt.step()
        outs.append(convert_pt2e(prepared)(data[1]))
    assert torch.equal(outs[0], outs[1])


def test_pt2e_histogram_on_growing_ranges_is_torchaos():
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(2, 3, 8, 8, generator=g) * (i + 1) for i in range(4)]  # ranges grow
    outs = [_pt2e(mod.HistogramObserver, mod.PerChannelMinMaxObserver, data)[0](data[0])
            for mod in (pt2e, qt)]
    assert torch.equal(outs[0], outs[1])
