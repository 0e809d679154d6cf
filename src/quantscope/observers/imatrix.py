"""``imatrix_mse``: the weight MSE search with each input channel weighted by its importance.

llama.cpp's imatrix and llm-compressor's ``imatrix_mse``: the squared error of weight column
``j`` counts ``E[x_j^2]`` times (the mean square of that input channel over calibration
activations), so the search spends its precision where the layer's inputs are large. The
search is :func:`~quantscope.estimators.weighted.imatrix_range`; without ``importance``
it is the plain (unweighted) MSE search over the same grid.
"""

from __future__ import annotations

import torch

from .._checks import check_number, tensor_arg
from ..comm import AVG
from ..estimators.mse import shrink_factors
from ..estimators.weighted import (
    check_importance,
    importance_units,
    incumbent_global_amax,
    weighted_search,
)
from ..formats import as_int
from . import record
from .base import Observer
from .registry import register
from .sync import step_sync

__all__ = ["IMatrixMSEObserver"]


@register("imatrix_mse")
class IMatrixMSEObserver(Observer):
    """The importance-weighted MSE range of the last weight observed (memoryless).

    With ``sync_every_step`` a step's weights are the ranks' tensors together (e.g. the
    output-channel shards of one weight): the range is one process's on their
    concatenation; each rank's per-element importance is gathered beside its units.

    Args:
        spec: the weight's quantizer (per channel or per group along the input dim).
        importance: ``[in]`` mean ``x^2`` per input channel (None: unweighted).
        input_dim: the weight's dim of input channels, the one ``importance`` weighs: ``-1``
            for a Linear's ``[out, in]``, ``0`` for a transformers Conv1D's ``[in, out]``.
        maxshrink, grid: the candidate factors ``1 - i / grid``, ``i < maxshrink * grid``.
        norm: error exponent (default 2).
    """

    family = "imatrix"
    memoryless = True

    accumulates = False

    def __init__(self, spec=None, *, importance: torch.Tensor | None = None,
                 maxshrink: float = 0.2, grid: float = 100, norm: float = 2.0,
                 input_dim: int = -1, **kwargs):
        super().__init__(spec, **kwargs)
        self.input_dim = as_int(input_dim)  # checked against the weight in forward
        if self.input_dim is None:
            raise ValueError(f"IMatrixMSEObserver: input_dim must be an integer (the weight's "
                             f"dim of input channels), got {input_dim!r}")
        self.factors = shrink_factors(maxshrink, grid)
        self.norm = check_number("IMatrixMSEObserver", "norm", norm, 0.0, lo_open=True)
        if importance is not None:  # a constant: checked here once, not in every forward
            importance = tensor_arg(self.describe(), "importance", importance,
                                    "a tensor (one value per input channel) or None",
                                    dtype=torch.float32).flatten()
            check_importance(self.describe(), importance)
        else:
            importance = torch.zeros(0, dtype=torch.float32)
        self.register_buffer("importance", importance)
        self.register_buffer("min_vals", torch.zeros(0, dtype=torch.float32))
        self.register_buffer("max_vals", torch.zeros(0, dtype=torch.float32))
        self.register_buffer("global_amax_val", torch.zeros(0, dtype=torch.float32))
        self._shape = None
        self._local_weights = None  # sync_every_step: this step's, until gathered

    _one_value_buffers = ("global_amax_val",)

    def _sized_buffers(self):
        return ("min_vals", "max_vals", "global_amax_val")

    def _setting_buffers(self):
        # the user's importance is a setting: reset keeps it, a load takes the saved one
        return ("importance",)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.importance.numel():  # a loaded setting: checked as the constructor's is
            check_importance(record.at(self.describe(), prefix), self.importance)

    def sync_plan(self):
        return {"min_vals": AVG, "max_vals": AVG, "global_amax_val": AVG}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, d = self.importance.numel(), self.input_dim
        if isinstance(x, torch.Tensor) and n:
            if not -x.dim() <= d < x.dim():
                raise ValueError(f"{self.describe()}: input_dim {d} is no dim of the tensor "
                                 f"of shape {tuple(x.shape)}")
            if x.shape[d] != n:
                where = "last dim" if d == -1 else f"input_dim {d} (its input channels)"
                raise ValueError(f"{self.describe()}: importance has {n} values, the "
                                 f"tensor's {where} is {x.shape[d]}")
        self._shape = tuple(x.shape) if isinstance(x, torch.Tensor) else None
        self._local_weights = None
        return super().forward(x)

    def _weights(self, device):
        imp = self.importance if self.importance.numel() else None
        shape, d = self._shape, self.input_dim
        if imp is None or d % len(shape) == len(shape) - 1:
            return importance_units(imp, shape, self.spec, device, checked=True)
        # input channels on another dim (a Conv1D's 0): the importance broadcast along it,
        # so each element keeps its input channel's weight in any layout's units
        along = [n if i == d % len(shape) else 1 for i, n in enumerate(shape)]
        full = imp.to(device).reshape(along).expand(shape).contiguous()
        return self.spec.layout.to_units(full)

    def _unit_minmax(self, units, count, ends):
        if self.sync_every_step:  # this rank's own: only it knows its shape
            self._local_weights = self._weights(units.device)
        return super()._unit_minmax(units, count, ends)

    def _step_weights(self):
        """The weights of a step's gathered units: every rank's own, gathered as its units
        were (in rank order; a rank without data this step sends none)."""
        w, self._local_weights = self._local_weights, None
        z = None if w is None else w.new_zeros(w.shape[0])
        return step_sync(self, w, z, z, self.sync_group)[0]

    def _observe(self, units, lo, hi):
        weights = self._step_weights() if self.sync_every_step else self._weights(units.device)
        mn, mx = weighted_search(units, weights, self.spec, factors=self.factors, norm=self.norm,
                                 ranges=(lo, hi))
        self._store(("min_vals", "max_vals"), (mn, mx))  # the same tensors: torch.export keeps them
        # NVFP4: the global amax the candidates were priced under, so the qparams run them
        ga = incumbent_global_amax(lo, hi, self.spec)
        if ga is not None:
            self._store(("global_amax_val",), (ga.reshape(1),))

    def calculate_range(self):
        return self.min_vals, self.max_vals

    def global_amax(self):
        return self.global_amax_val[0] if self.global_amax_val.numel() else None
