"""What calibration produces: per layer and role, the qparams and how they were chosen."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..export.registry import exporter, reader
from ..qparams import QParams
from ..spec import QuantSpec

__all__ = ["Calibration", "RoleState"]


@dataclass
class RoleState:
    """The calibrated quantizer of one tensor (a layer's weight, input or output).

    ``qparams`` is None for ``dynamic=True`` (computed at run time);
    ``global_amax`` is set for ``dynamic="local"``. ``observer`` is the observer that
    made the range (for ``auto``, the one chosen; ``requested`` says ``"auto"``).
    ``lo`` / ``hi`` are its per-unit range; ``shape`` the calibrated weight shape.
    """

    spec: QuantSpec
    observer: str
    requested: str
    dynamic: bool | str = False
    options: tuple = ()
    qparams: QParams | None = None
    global_amax: torch.Tensor | None = None
    lo: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    shape: tuple[int, ...] | None = None

    def quantizes_like(self, other: RoleState) -> bool:
        """Whether QDQ with ``other`` is the same as with this state: equal spec, mode,
        qparams and global amax (the observer that found them does not matter)."""
        def tensors(st):
            qp = st.qparams
            return ((None, None, None) if qp is None else (qp.scale, qp.zero_point,
                                                           qp.global_scale)) + (st.global_amax,)
        return (self.spec == other.spec and self.dynamic == other.dynamic
                and all(a is b or (a is not None and b is not None and a.shape == b.shape
                                   and a.dtype == b.dtype and torch.equal(a, b))
                        for a, b in zip(tensors(self), tensors(other))))

    def to(self, device) -> RoleState:
        mv = (lambda t: None if t is None else t.to(device))
        return replace(self, qparams=None if self.qparams is None else self.qparams.to(device),
                       global_amax=mv(self.global_amax), lo=mv(self.lo), hi=mv(self.hi))


@dataclass
class Calibration:
    """The result of :func:`quantscope.calibrate` for one recipe.

    ``states[layer][role]`` is a :class:`RoleState`; ``stats`` the report rows
    (computed on the float weights and the activation samples at calibration time);
    ``histograms[(layer, role)]`` activation histograms for plots. ``smoothing``: where
    the model was smoothed before calibrating (``smooth=``), SmoothQuant's per-channel
    scales by smoothed module (:func:`.smooth.reapply` smooths a fresh copy alike).
    """

    recipe: object
    states: dict[str, dict[str, RoleState]]
    label: str = ""
    stats: list = field(default_factory=list)
    histograms: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    smoothing: dict[str, torch.Tensor] = field(default_factory=dict)

    def apply(self, model):
        """Fake-quantize ``model`` (QDQ); returns a handle whose ``remove()`` undoes it."""
        from .apply import apply

        return apply(model, self.states)

    def quantizes_like(self, other: Calibration) -> bool:
        """Whether applying ``other`` quantizes a model exactly as applying this does: the
        same tensors, each with a state that :meth:`RoleState.quantizes_like` this one's
        (``auto`` often keeps one candidate's qparams whole), and the same smoothing."""
        return (self.states.keys() == other.states.keys()
                and all(self.states[k].keys() == other.states[k].keys()
                        and all(st.quantizes_like(other.states[k][r])
                                for r, st in self.states[k].items()) for k in self.states)
                and self.smoothing.keys() == other.smoothing.keys()
                and all(torch.equal(s, other.smoothing[k]) for k, s in self.smoothing.items()))

    def report(self, metrics: dict | None = None):
        """The :class:`~quantscope.calibrate.report.Report` of this calibration."""
        from .report import Report

        return Report(self.label or self.recipe.name, self.recipe.name, self.stats,
                      dict(metrics or {}), self.info)

    def save(self, path):
        """qparams to ``path/qparams.safetensors`` and specs to ``path/quantscope.json``."""
        from .io import save

        return save(self, path)

    def export(self, model, path, format: str = "compressed-tensors", **options):
        """Write this calibration applied to ``model`` in a runtime's ``format``
        (:func:`quantscope.export.export`); returns the path."""
        return exporter(format)(self, model, path, **options)

    @classmethod
    def from_compressed_tensors(cls, path) -> Calibration:
        """The calibration a compressed-tensors checkpoint holds (quantscope's export or
        llm-compressor's): ``apply`` it to the float model to run it as the checkpoint does."""
        return reader("compressed-tensors")(path)

    def __repr__(self):
        n = sum(len(r) for r in self.states.values())
        return (f"Calibration({self.label or self.recipe.name!r}, {len(self.states)} layers, "
                f"{n} quantized tensors)")
