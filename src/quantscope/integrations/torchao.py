"""quantscope's torch.ao-signature observers in torchao's pt2e flow (and torch.ao's QConfig).

The classes of :mod:`quantscope.compat.torch_ao` (``MinMaxObserver``,
``PerChannelMinMaxObserver``, ``HistogramObserver`` ...) are torch.ao observers already.
torchao keeps its own copy of the observer base class, and ``prepare_pt2e`` /
``convert_pt2e`` find observers by ``isinstance`` of it; importing this module registers
the quantscope classes there (as a virtual subclass, nothing is patched; the moving averages
as torchao's namesakes too, which pt2e QAT's ``FusedMovingAvgObsFakeQuantize`` requires), so::

    from quantscope.integrations.torchao import HistogramObserver
    QuantizationSpec(dtype=torch.int8, quant_min=-128, quant_max=127,
                     qscheme=torch.per_tensor_affine,
                     observer_or_fake_quant_ctr=HistogramObserver.with_args(bins=2048))

pt2e passes the spec's ``dtype``, ``quant_min``, ``quant_max``, ``qscheme``, ``is_dynamic``
(and ``ch_axis`` to classes named ``PerChannel...``) to the constructor.
"""

from __future__ import annotations

try:
    from torchao.quantization.pt2e import ObserverBase as _PT2EObserverBase
    from torchao.quantization.pt2e import observer as _pt2e_observers
except ModuleNotFoundError as e:  # the same error, saying what to install
    raise ModuleNotFoundError(
        f"quantscope.integrations.torchao plugs quantscope's observers into torchao's pt2e "
        f"flow and needs torchao: pip install 'quantscope[peers]' ({e})", name=e.name) from None

from ..compat.torch_ao import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
    TorchAOObserver,
)

__all__ = [
    "HistogramObserver",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "PerChannelMinMaxObserver",
    "TorchAOObserver",
]

_PT2EObserverBase.register(TorchAOObserver)
# torchao's FusedMovingAvgObsFakeQuantize (pt2e QAT) takes only its own moving averages, by
# isinstance; the compat ones subclass torch.ao's namesakes already, so they join torchao's
_PT2E_TWINS = {"MovingAverageMinMaxObserver": MovingAverageMinMaxObserver,
               "MovingAveragePerChannelMinMaxObserver": MovingAveragePerChannelMinMaxObserver}
for _name, _cls in _PT2E_TWINS.items():
    getattr(_pt2e_observers, _name).register(_cls)
