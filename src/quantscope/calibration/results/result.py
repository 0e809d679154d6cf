"""What calibration produces: per layer and role, the qparams and how they were chosen."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ...exporters.registry import exporter, reader
from ..structure import kv_cache
from ..structure.fingerprint import check_fingerprints, sources
from .apply import apply as _apply
from .apply import fake_quantized, refuse_applied
from .report import Report, exact_note, kv_cache_rows
from .role_state import RoleState
from .saving import save as _save

__all__ = ["Calibration", "RoleState"]

#: why an export refuses a model with QDQ applied (``with calibration.apply(model):``)
_EXPORT_APPLIED = ("an export writes the weights the model holds, fake-quantized while "
                   "applied: export outside the `with calibration.apply(model):` block")


@dataclass(eq=False)  # tensors have no truth value: ``==`` is identity, quantizes_like compares
class Calibration:
    """The result of :func:`quantscope.calibrate` for one recipe.

    ``states[layer][role]`` is a :class:`RoleState`; ``stats`` the report rows
    (computed on the float weights and the activation samples at calibration time);
    ``histograms[(layer, role)]`` activation histograms for plots. ``smoothing``: where
    the model was smoothed before calibrating (``smooth=``), SmoothQuant's per-channel
    scales by smoothed module (:func:`.smooth.reapply` smooths a fresh copy alike).
    ``writer_rank``: the global rank that writes what :meth:`save` and ``export`` write in a
    process group: rank 0 of the group it was calibrated across (``Runtime.group``), 0 for
    one read from disk (``quantscope.load``, :meth:`from_compressed_tensors`: every rank reads
    the same folder, one writes); None (made in this process alone, or built by hand): the
    process holding it writes. Not saved.
    """

    recipe: object
    states: dict[str, dict[str, RoleState]]
    label: str = ""
    stats: list = field(default_factory=list)
    histograms: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    smoothing: dict[str, torch.Tensor] = field(default_factory=dict)
    writer_rank: int | None = None

    def apply(self, model):
        """Fake-quantize ``model`` (QDQ); returns a handle whose ``remove()`` undoes it. A
        calibration with ``smoothing`` belongs to the smoothed weights: a model whose
        weights are recognisably not smoothed (a freshly loaded float model: smooth it first
        with :func:`.smooth.reapply`), or smoothed twice, is refused, unchanged."""
        self.check_model(model, "apply")
        return _apply(model, self.states)

    def check_model(self, model, who: str = "apply") -> None:
        """Raises ``ValueError`` (naming ``who``, the call) if ``model`` is recognisably not
        the one this calibration belongs to: with ``smoothing``, a model not smoothed, or
        smoothed twice; a weight whose bits differ from those calibrated (their fingerprints,
        :func:`~..structure.fingerprint.check_fingerprints`: a quantized weight, the layer
        weight a static input or output scale came through, the projection making the KV
        cache's keys or values; another checkpoint of the same shapes, or the recorded model
        folder re-saved since). ``apply`` and every export
        (:mod:`quantscope.exporters.registry`) call it; any ``who`` but ``"apply"`` (an
        export) also refuses a model with QDQ applied, whose weights are fake-quantized."""
        if who != "apply" and isinstance(model, torch.nn.Module):
            refuse_applied(model, who, _EXPORT_APPLIED)
        if self.smoothing:
            _check_smoothed(model, self, who)
        if isinstance(model, torch.nn.Module):  # else apply's / the export's type check
            check_fingerprints(model, self.states, who,
                               skip=fake_quantized(model, sources(model, self.states)))

    def without_fingerprints(self) -> Calibration:
        """A copy whose ``apply`` and exports take a model whose weights differ from those
        calibrated, knowingly (fine-tuned a little since, and the old scales are wanted): its
        states carry no fingerprint, as a calibration saved before they were recorded. The
        scales stay the calibrated model's: values past their range clip.
        ``quantscope export`` / ``evaluate --allow-other-weights`` apply it."""
        states = {layer: {role: st if st.fingerprint is None else replace(st, fingerprint=None)
                          for role, st in roles.items()} for layer, roles in self.states.items()}
        return replace(self, states=states, info=dict(self.info))

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
        """The :class:`~quantscope.calibration.results.report.Report` of this calibration.
        A saved one keeps no statistics (only qparams and specs): loaded, its report has no
        layer rows, and a note says so."""
        notes = []
        if not self.stats and any(r not in kv_cache.ROLES for rs in self.states.values()
                                  for r in rs):
            notes.append("no layer statistics (SQNR, clipped): they are computed on the "
                         "calibration's samples, which a saved calibration does not keep "
                         "(calibrate again for them)")
        exact = exact_note(self.stats)  # SQNR inf: say why, JSON holds no inf
        if exact:
            notes.append(exact)
        return Report(self.label or self.recipe.name, self.recipe.name, self.stats,
                      dict(metrics or {}), self.info, kv_cache_rows(self.states), notes)

    def save(self, path, *, overwrite: bool = True):
        """qparams to ``path/qparams.safetensors`` and specs to ``path/quantscope.json``,
        atomically; an earlier calibration at ``path`` is replaced (``overwrite=False``
        refuses it), never a folder quantscope did not write."""
        return _save(self, path, overwrite=overwrite)

    def export(self, model, path, format: str = "compressed-tensors", **options):
        """Write this calibration applied to ``model`` in a runtime's ``format``
        (:func:`quantscope.exporters.export`); returns the path."""
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


def _check_smoothed(model, calibration: Calibration, who: str) -> None:
    """Raises if ``model``'s weights are not the smoothed ones ``calibration`` was made on.
    No forward: each smoothed mapping's first balanced Linear (only that mapping changes its
    columns) has its weight's range per calibrated unit (``lo`` / ``hi``, the spec's layout)
    compared with the model's weight as it is, times the scales (as :func:`.smooth.reapply`
    would make it) and divided by them; a model closer to the second is not smoothed, one
    closer to the third smoothed twice. Mappings the model lacks, or weights without a range
    to compare, are not checked."""
    from ..choice.smooth import find_mappings

    for m in find_mappings(model):
        s = calibration.smoothing.get(m.previous)
        st = calibration.states.get(m.balance[0], {}).get("weight")
        if s is None or st is None or st.lo is None or st.hi is None:
            continue
        w = model.get_submodule(m.balance[0]).weight
        if w.is_meta or w.dim() != 2 or st.spec.layout.num_units(w.shape) != st.lo.numel():
            continue
        with torch.no_grad():
            r = torch.maximum(st.lo.abs(), st.hi.abs()).to(w.device, torch.float32).reshape(-1)
            w, s = w.detach().float(), s.to(w.device, torch.float32)
            off = _off(w, r, st)
            if _off(w * s, r, st) < 0.5 * off:
                raise ValueError(
                    f"{who}: the calibration was made on SmoothQuant-smoothed weights "
                    f"(calibration.smoothing), but this model's {m.balance[0]}.weight is not "
                    f"smoothed (a freshly loaded float model?); smooth it first with "
                    f"quantscope.calibration.choice.smooth.reapply(model, calibration) (it "
                    f"changes the parameters in place), as quantscope evaluate / export do")
            if _off(w / s, r, st) < 0.5 * off:
                raise ValueError(
                    f"{who}: this model's {m.balance[0]}.weight looks smoothed twice (reapply "
                    f"on a model calibrate had smoothed in place already?): calibration."
                    f"smoothing belongs to weights smoothed once; load the float model again "
                    f"and reapply once")


def _off(w: torch.Tensor, r: torch.Tensor, st: RoleState) -> float:
    """Median ``|log|`` of the ratio of ``w``'s absolute range per unit of ``st``'s layout
    to the calibrated one, ``r``: 0 for the weights a min-max observer saw, small for a
    clipping one's."""
    a = st.spec.layout.to_units(w).abs().amax(1)
    return float((a.clamp(min=1e-30) / r.clamp(min=1e-30)).log().abs().median())
