"""The calibrated quantizer of one tensor: what the pass, QDQ, save / load and the exports
share (below all of them, so none imports another to know it)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...qparams import QParams
from ...scales import nvfp4_global_scale
from ...spec import QuantSpec

__all__ = ["RoleState"]


@dataclass(eq=False)  # tensors have no truth value: ``==`` is identity, quantizes_like compares
class RoleState:
    """The calibrated quantizer of one tensor (a layer's weight, input or output).

    ``qparams`` is None for ``dynamic=True`` (computed at run time);
    ``global_amax`` is set for ``dynamic="local"``. ``observer`` is the observer that
    made the range (for ``auto``, the one chosen; ``requested`` says ``"auto"``).
    ``lo`` / ``hi`` are its per-unit range; ``shape`` the calibrated weight shape, and
    ``fingerprint`` the bits' of the weight its values came through (a static or
    ``"local"`` role's: a weight's own, an input's or output's layer weight, the KV cache's
    projection;
    :mod:`~..structure.fingerprint`: what ``Calibration.check_model`` compares a model's
    weight with).
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
    fingerprint: str | None = None

    def quantizes_like(self, other: RoleState) -> bool:
        """Whether QDQ with ``other`` is the same as with this state: equal spec, mode,
        qparams and the global scale of the global amax (the observer that found them does
        not matter; a checkpoint's reader finds an amax giving its stored global scale,
        which may lie an ulp from the calibrated one). A run-time (``dynamic=True``) role's
        observer and options are what computes its qparams at each call: they must match."""
        def tensors(st):
            qp, amax = st.qparams, st.global_amax
            return ((None, None, None) if qp is None else (qp.scale, qp.zero_point,
                                                           qp.global_scale)) + (
                None if amax is None else nvfp4_global_scale(amax, st.spec.format),)
        # spec equality ignores an act-order group's g_idx: its column order must match too
        order = [getattr(st.spec.layout, "order", None) for st in (self, other)]
        return (self.spec == other.spec and order[0] == order[1]
                and self.dynamic == other.dynamic
                and (self.dynamic is not True or (self.observer == other.observer and
                                                  dict(self.options) == dict(other.options)))
                and all(a is b or (a is not None and b is not None and a.shape == b.shape
                                   and a.dtype == b.dtype and torch.equal(a, b))
                        for a, b in zip(tensors(self), tensors(other))))

    def check_weight(self, who: str, layer: str, weight: torch.Tensor) -> None:
        """Raise ``ValueError`` naming ``layer`` where ``weight`` has another shape than the
        one calibrated (another model's layer of that name)."""
        if self.shape is not None and tuple(weight.shape) != tuple(self.shape):
            raise ValueError(f"{who}: {layer}.weight has shape {tuple(weight.shape)}, but was "
                             f"calibrated with shape {tuple(self.shape)} (a calibration of "
                             f"another model?)")

    def to(self, device) -> RoleState:
        """A copy with qparams, ``global_amax``, ``lo`` and ``hi`` moved to ``device``."""
        mv = (lambda t: None if t is None else t.to(device))
        return replace(self, qparams=None if self.qparams is None else self.qparams.to(device),
                       global_amax=mv(self.global_amax), lo=mv(self.lo), hi=mv(self.hi))
