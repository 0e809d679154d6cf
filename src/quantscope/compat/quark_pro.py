"""AMD Quark's ``PerTensorHistogramObserverPro`` (re-exported by
:mod:`quantscope.compat.quark`): Quark's wrapper of torch.ao's ``HistogramObserver``, over the
native L2 histogram observer and quantscope's bitwise twin of torch.ao's class."""

from __future__ import annotations

import dataclasses

import torch

from ..layout import Tensor
from ..observers.histogram import L2HistogramObserver
from ..observers.registry import register
from . import enum_name
from .quark_base import QuarkObserver
from .quark_scales import _refuse_overflow

__all__ = ["PerTensorHistogramObserverPro"]


class _TorchAOBatch:  # the Pro's batch as its torch.ao child takes it (see the class)
    def forward(self, x):
        ends = (torch.stack(torch.aminmax(x.detach())).tolist()  # NaN: at both ends
                if self.non_finite == "error" and self.check_input(x) else (0.0, 0.0))
        if -torch.inf < ends[0] and ends[1] < torch.inf:  # (0, 0): "ignore" (read as 0), empty
            return super().forward(x)
        if ends[0] != ends[0]:  # NaN
            from .torch_ao import NonFiniteBatchError  # (not loaded with compat.quark)
            raise NonFiniteBatchError(f"{self.describe()}: NaN in the batch (range not finite)")
        from ..stats.ao_histogram import drop_inf  # (torch.ao's ops: not loaded with Quark's)
        kept = drop_inf(x.detach(), stacklevel=2)
        super().forward(kept)  # empty (inf alone): nothing observed, as torch.ao's
        if kept.numel():  # the batch's shape and tokens, less kept's one (1-D)
            self.count_batch(x)
            self.observed_tokens.sub_(1)
        return x


@register("quark:PerTensorHistogramObserverPro")
class PerTensorHistogramObserverPro(QuarkObserver, _TorchAOBatch, L2HistogramObserver):
    """Quark's wrapper of torch.ao's HistogramObserver (256 bins, non-linear L2 search).

    ``upsample_rate`` is accepted and unused (torch >= 2.5 dropped it too); ``reduce_range``
    halves the code range, as torch.ao halves the custom range Quark gives it (the search's 256
    destination bins stay). As Quark's, a torch.ao child (``histogram``: quantscope's bitwise
    twin, :class:`quantscope.compat.torch_ao.HistogramObserver`) holds the histogram the search
    reads and prices its range, so a widening batch merges and a module cast searches as
    torch.ao's; the state_dict saves it beside the native state (Quark's: ``histogram.*``
    only). Non-finite input as torch.ao's: +-inf dropped with its warning, NaN a
    ``NonFiniteBatchError`` (a ``RuntimeError``) in ``forward``. A deliberate difference, as in
    :class:`quantscope.compat.torch_ao.HistogramObserver`: a bfloat16 / float16 batch is binned as
    its float32 values, so the qparams are Quark's for the batch's float32 copy. Quark's hands the
    half batch to torch.ao, which bins it in that dtype (``torch.histc`` rounds the bin positions
    and the counts there: its bins stop counting near 256 values in bfloat16, 2048 in float16)."""

    _saves_state = True  # the native state, where Quark saves its torch.ao child's
    _keeps_input_dtype = False  # torch.ao's state: float32, or a module cast's dtype
    _reads_zero_point_type = False
    #: torch.ao's histc / linspace refuse integer and bool input (Quark's does not cast it)
    _quark_fails_on = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

    def __init__(self, qspec, device: torch.device | None = None, bins: int = 256,
                 reduce_range: bool = False, upsample_rate: int = 384, **native):
        native.setdefault("grid", "first")
        native.setdefault("dst_nbins", 256)  # 2 ** iinfo(qint8 / quint8 / quint4x2).bits
        native.setdefault("polish", 0)
        super().__init__(qspec, device, bins=bins, **native)
        if not isinstance(self.spec.layout, Tensor):
            raise ValueError("PerTensorHistogramObserverPro only supports per_tensor")  # noqa: TRY004
        if enum_name(self.dtype) not in ("uint4", "int8", "uint8"):
            raise ValueError("PerTensorHistogramObserverPro only supports 4bit and 8bit")
        self.reduce_range = reduce_range
        # Quark hands torch.ao its code range as a custom one: reduce_range halves it
        half = 2 if reduce_range else 1
        self.spec = dataclasses.replace(self.spec, quant_min=self.quant_min // half,
                                        quant_max=self.quant_max // half)
        from .torch_ao import HistogramObserver  # (not loaded with compat.quark)
        ao_dtype = {"uint4": torch.quint4x2, "int8": torch.qint8, "uint8": torch.quint8}
        self.histogram = HistogramObserver(  # Quark's child, with Quark's arguments
            bins=bins, dtype=ao_dtype[enum_name(self.dtype)], reduce_range=reduce_range,
            qscheme=torch.per_tensor_symmetric if self.spec.symmetric else torch.per_tensor_affine,
            quant_min=self.quant_min, quant_max=self.quant_max).to(self.eps.device)

    def _observe(self, units, lo, hi):
        self._refuse_overflow()  # (before any change) Quark's histc fails on a cast's inf
        super()._observe(units, lo, hi)
        self.histogram(units)  # torch.ao's step (its merge of a widening batch)

    def _estimate(self, hist):
        lo, hi = self.histogram._non_linear_param_search()  # torch.ao's search of its state
        return lo.reshape(1), hi.reshape(1)

    def reset(self) -> None:
        super().reset()
        if "histogram" in self._modules:  # (the native constructor resets before it exists)
            self.histogram.reset()

    min_val, max_val = QuarkObserver.ends(
        "_never_set", "Never set by Quark's wrapper (torch.ao's observer holds the range)")

    def _never_set(self, name: str, value: float) -> torch.Tensor:
        self._check_present(name)
        return torch.tensor(value, dtype=self._input_dtype, device=self.observed_tokens.device)

    def _calculate_qparams(self):
        """Quark's: torch.ao's ``_calculate_qparams`` of its search (shape ``(1,)``, the zero
        point int64 when symmetric, else int32). Before data ``ValueError`` (Quark's wrapper
        returns a NaN scale there)."""
        self.check_ready()
        self._refuse_overflow()
        return self.histogram._calculate_qparams(*self.histogram._non_linear_param_search())

    def _refuse_overflow(self) -> None:  # the torch.ao child's range, counts in a cast's dtype
        ao = self.histogram  # (+inf / -inf before data: min_val / max_val)
        _refuse_overflow(self, (ao.min_val.clamp(max=0), ao.max_val.clamp(min=0), ao.histogram))
