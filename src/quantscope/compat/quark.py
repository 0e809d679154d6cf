"""AMD Quark's observers, with their names, ``(qspec, device=None)`` signature and qparams.

``qspec`` is Quark's ``QTensorConfig`` or a dict / object with its fields: dtype,
qscheme (per_tensor / per_channel / per_group), ch_axis, group_size, symmetric,
round_method, scale_type, scale_format (float32 / e8m0 / e4m3 / e5m3),
scale_calculation_mode (even / floor / ceil), mx_element_dtype, is_dynamic.
Enums or their string values both work. A class takes its own granularity only, as Quark's
config (another ``qscheme`` raises ``ValueError``; a qspec without one takes the class's), a
float16 / bfloat16 cast dtype only on ``PlaceholderObserver``, per-channel needs a
``ch_axis`` and ``PerBlockMXObserver`` one too (:class:`QuarkAssertionError`, an
``AssertionError`` as Quark's). These classes join Quark's observer sets
(``OBSERVER_CLASSES``, ``PER_TENSOR_OBSERVERS`` ...) when Quark is loaded, before or after this
module, so a ``QTensorConfig(observer_cls=...)`` accepts them (:func:`register_with_quark`),
except for a float16 / bfloat16 cast, where Quark tests for its own ``PlaceholderObserver``.

Scales follow Quark's ``get_scale``: float32 divides by ``quant_max_first_level * quant_max``
when the first level is set (the second stage of a two-level scheme), e4m3 is Quark's two-level
NVFP4 rounding, e5m3 rounds to Quark's unsigned E5M3 (:data:`FP8_E5M3`), e8m0 'floor' / 'ceil'
are Quark's formulas (:func:`quark_e8m0_scale`: eps for a zero block), e8m0 'even' the native
MX rule (bitwise Quark's ``even_round`` for float elements below float32's top binade, where
Quark's rounded amax overflows to inf and its exponent clamps to 127, a binade above the
rule's; float elements are the only ones Quark's
``PerBlockMXObserver`` takes: an integer element raises :class:`UnsupportedElementError`, an
``AssertionError`` as Quark's; for int8 elements quantscope's rule rounds the block max to the
element's 6 fraction bits, OCP MXINT8's 1.6 layout, where Quark's ``fake_quantize_mx`` rounds
to 8). fp4 per tensor / per channel takes these scale formats too, on the min-max and
histogram classes, as Quark's ``calculate_fp4_quant_parameters`` (a zero left: float32 eps);
fp6 there takes them unread, as Quark's integer formula. Integer ranges take
the native scale, which matches Quark's ``calculate_int_quant_params`` bit for bit on
float32 input (an integer-typed range is priced in float32, as Quark's division promotes
it) and on bfloat16 / float16 ranges as Quark's ops there (asymmetric: ``max - min``
rounded to that dtype before it is divided, the zero point divided there), and Quark's
asymmetric zero point ``qmin - round(min / scale)`` (the native ``round(qmin - min /
scale)`` is a code off on some int16 ranges); as there, a symmetric range has
zero point 0, unsigned formats too, and ``scale_format`` is not read (e8m0 / e4m3 give the
plain scales; so on an fp8 per-tensor / per-channel range). The histogram classes price a
float estimate with the min-max classes' rules (fp8: Quark's ``calculate_fp8_quant_parameters``,
only an exact 0 becomes eps, a half ``scale_type`` casts the amax before dividing; fp4 by its
``scale_format``), and with ``symmetric=False`` bin fp8 over ``[min, max]`` and take
Quark's asymmetric estimate, as Quark's. ``_num_observed_tokens`` is Quark's count (the rows
with a non-zero of each 2-D+ batch: its api warns of MoE experts that saw none), counted by
``forward``, never reset; a static ``PerBlockMXObserver`` / ``PerBlockBFPObserver``'s amax
promotes its dtype with each batch's, as Quark's ``torch.max``. fp4 with no ``scale_format``
raises
a ``ValueError`` on the per-tensor / per-channel min-max and the histogram classes (before data
too), as Quark's ``get_scale``; the fp6 dtypes on those classes (and fp4 on
``PerGroupMinMaxObserver``), which Quark prices with that integer formula, raise
:class:`UnsupportedElementError` (an ``AssertionError`` as Quark's) on a given range and once
data is seen (before, the min-max classes and the histogram recorder give Quark's
``([1.], [0])``).
``PerTensorMSEObserver``'s search, as Quark's, prices int4 / uint4 / int8 / uint8 / fp8_e4m3 /
fp8_e5m2 only: another dtype raises ``ValueError`` at ``calculate_qparams()`` once data is
seen. Before any data the min-max classes and the histogram recorder return Quark's answers in
its shapes (``([1.], [0])`` for integers, ``(eps, 0.)`` for fp8, ``(1, 1)`` per group),
``PerBlockMXObserver`` Quark's scale of its ``amax`` 0 (``2 ** -127`` for E8M0); the
percentile, MSE and Pro classes raise a ``ValueError`` (Quark's raise an ``AttributeError``,
and Pro's returns a NaN scale). ``PerBlockMXObserver`` with no ``scale_format`` gives float32
scales (E8M0 for the dtype ``mx``), as :func:`quark_spec` reads it (Quark's untested branch
returns integer exponents). NaN / inf raise a ``ValueError`` naming the observer at
``calculate_qparams()`` on every scale rule, and in a range given to
``calculate_qparams(min_val, max_val)`` (Quark's float path returns NaN / inf scales); so
does an asymmetric ``PerTensorMSEObserver`` with a negative integer candidate or a negative
fp8 choice (all-negative data: Quark asserts on integers; on fp8 Quark's gives a zero
scale). Histogram edges are Quark's ``torch.linspace(lo, hi, bins + 1)``, the top one
nudged for a constant batch as Quark's; once a batch widens the range the percentile and MSE classes
keep Quark's own grid beside the native one (bins of the first width appended, every later
batch binned over all of them, each batch's ends read to the host as Quark's Python floats
are), so counts, edges and scales are Quark's bit for bit, its quirks included: a batch that
widens the range downward has the old counts added to the new grid's first bins, and where
Quark's ``arange`` gives an edge more or less than its bin count the MSE search raises a
``ValueError`` (Quark's fails on the sizes). The percentile class takes a batch's range from
its non-zero values, as Quark's; the MSE class prices a symmetric unsigned candidate with
zero point 0 and an asymmetric fp8 one below 0 as its magnitude, as Quark's;
``PerTensorHistogramObserverPro`` holds Quark's torch.ao child (``histogram``: torch.ao's
bitwise twin :class:`quantscope.compat.torch_ao.HistogramObserver`) and returns its qparams, of
Quark's custom code range (``reduce_range`` halves it), so widening batches and module casts
are Quark's too.
``PerBlockBFPObserver`` is BFP16 whatever the qspec's dtype (Quark's never reads it).
``PerBlockMXObserver`` zero-pads the last block of an axis the group size does not divide,
``PerGroupMinMaxObserver`` refuses it (``ValueError``, block scale formats too), as Quark's; a
static ``PerChannelMinMaxObserver`` / ``PerBlockMXObserver`` starts over when the channel count
/ Quark's ``(rows, blocks)`` change, as Quark's (a batch of another shape with the same
``(rows, blocks)`` is merged row by row in Quark's row order, as Quark's); a static
``PerBlockBFPObserver`` raises :class:`StateShapeError` there (a ``RuntimeError`` as
Quark's ``torch.max`` of the two amax, and a ``ValueError``), the other static classes
``ValueError`` when their unit count changes.

``(scale, zero_point)`` come in Quark's shapes: 0-dim per tensor (``min_val`` / ``max_val``
too; ``PerTensorHistogramObserverPro``: torch.ao's ``(1,)``), ``(C,)`` per channel,
``(rows, groups)`` per group / block (rows in Quark's order; per-group ``min_val`` /
``max_val`` flat, as Quark's); the scale in ``scale_type``'s dtype when it is float32 /
float16 / bfloat16, else in the dtype Quark computes it in (the input's, promoted to float32
for a per-tensor integer scale by Quark's float32 eps; float32 for the histogram observers,
e8m0 'even' and e4m3); the zero point int32 for integers and BFP16, a float zero tensor for
float and MX formats.

Known differences: ``round_method`` other than half_even is not supported; the histogram MSE
search prices candidates in float64 (Quark's float32 mean can tie two candidates and take the
first); integer scales of a float64 input are computed in float32 and then cast to float64,
then to ``scale_type``'s as Quark's (Quark computes them in float64: the last bits can
differ), and so are those after a ``.double()`` (after a module cast the dtypes are Quark's,
eps, ``min_val`` / ``max_val`` and scales in the cast's dtype; a histogram observer keeps that
dtype where Quark's returns to float32 once a batch widens its bins); an asymmetric float16
range wider than 65504 takes the native finite scale where Quark's ``max - min`` overflows
(an inf scale); ``reset_state`` forgets
the histogram and the BFP16 amax (Quark's keeps them and merges the next batch);
``PerTensorHistogramObserverPro`` saves the native state beside its child's ``histogram.*``
(Quark's saves these only; the other classes save nothing, as Quark's); ``zero_point_type``
float32 raises ``ValueError`` where Quark's would give float zero points (an asymmetric
integer dtype; Pro ignores it, as Quark's); a module cast (``.half()``) after
a float32 batch keeps the exact float32 ``min_val`` / ``max_val`` where Quark's rounds its
buffers through the cast's dtype (so does a float32 batch after a bfloat16 one there, copied
into that buffer), so a later ``.float()`` or batch prices the unrounded range; the histogram
MSE search's float64 error can take a candidate Quark's float32 mean orders within its
rounding behind another; Quark's percentile observer skips zeros, and an all-zero *first*
batch starts no grid in quantscope's (the first batch with data does) where Quark's starts
one at ``[0, 4200 eps]`` and grows it in steps of that width (asymmetric: it fails on the
next batch); an empty first batch of the percentile and MSE observers starts no grid either
(Quark's starts its grid of zeros; qparams read before any data are Quark's, of that grid
with no count); BFP16's scale is Quark's
(``quark_scales.quark_bfp16_scale``) but never subnormal or
infinite (the native one there), its ``amax`` the block absmax (Quark's doubles it on each
overflowing call), and where one amax has a single row / block Quark's broadcasts it over a
batch's, a state quantscope's refuses (:class:`StateShapeError`); dtype ``int32`` raises
``ValueError`` (quantscope's integer formats stop at 16 bits; Quark's takes it);
an all-zero tensor with ``scale_format`` e4m3 (NVFP4's two levels) gets the native NVFP4 answer
(global scale 1, each block the smallest e4m3 scale ``0.125``, whatever ``eps``) where
Quark's divides by its zero global amax and returns NaN scales; ``calculate_qparams(min_val,
max_val)`` with ``min_val > max_val`` raises quantscope's ``ValueError`` message as
:class:`InvertedRangeError`, also an ``AssertionError`` and a ``RuntimeError`` (Quark's types
on a 0-dim / wider range), and a ``ch_axis`` the batch has no dimension for
:class:`AxisRangeError`, also an ``IndexError`` (Quark's ``x.shape[ch_axis]``);
``PerTensorHistogramObserverPro`` bins a bfloat16 / float16 batch as its float32 values (Quark's
hands it to torch.ao, which bins it in that dtype and loses counts: quantscope's gives Quark's
answer for the batch's float32 copy).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys

import torch

from ..layout import Block
from ..observers.minmax import PlaceholderObserver as _NativePlaceholder
from ..observers.registry import register
from . import field
from .quark_base import (
    FP8_E5M3,
    AxisRangeError,
    InvertedRangeError,
    QuarkAssertionError,
    QuarkObserver,
    StateShapeError,
    UnsupportedElementError,
    UnsupportedInputError,
    _DynamicOrStatic,
    quark_e8m0_scale,
    quark_float_scale,
    quark_spec,
)
from .quark_block import PerBlockBFPObserver, PerBlockMXObserver
from .quark_histogram import (
    PerTensorHistogramObserver,
    PerTensorMSEObserver,
    PerTensorPercentileObserver,
)
from .quark_pro import PerTensorHistogramObserverPro

__all__ = [
    "FP8_E5M3",
    "AxisRangeError",
    "InvertedRangeError",
    "PerBlockBFPObserver",
    "PerBlockMXObserver",
    "PerChannelMinMaxObserver",
    "PerGroupMinMaxObserver",
    "PerTensorHistogramObserver",
    "PerTensorHistogramObserverPro",
    "PerTensorMSEObserver",
    "PerTensorMinMaxObserver",
    "PerTensorPercentileObserver",
    "PlaceholderObserver",
    "QuarkAssertionError",
    "QuarkObserver",
    "StateShapeError",
    "UniformScalingObserver",
    "UnsupportedElementError",
    "UnsupportedInputError",
    "quark_e8m0_scale",
    "quark_float_scale",
    "quark_spec",
    "register_with_quark",
]

_QUARK_OBSERVERS = "quark.torch.quantization.observer"


def register_with_quark() -> bool:
    """Add each class to the observer sets of Quark that hold its Quark namesake
    (``OBSERVER_CLASSES``, ``PER_TENSOR_OBSERVERS`` ...: Quark's config checks
    ``observer_cls`` against them). False when Quark is not importable."""
    try:  # sys.modules first: called while Quark's package is still loading
        quark_observer = sys.modules.get(_QUARK_OBSERVERS) or importlib.import_module(
            _QUARK_OBSERVERS)
    except ImportError:
        return False
    sets = [v for k, v in vars(quark_observer).items() if k.endswith("OBSERVERS")
            and isinstance(v, set)] + [quark_observer.OBSERVER_CLASSES]
    for name in __all__:
        theirs = getattr(quark_observer, name, None)
        for members in sets:
            if theirs is not None and theirs in members:
                members.add(globals()[name])
    return True


class _JoinQuarkOnImport:
    """Meta-path finder: when Quark's observer package loads after this module, the classes
    join its sets right after it runs (so the import order of the two does not matter)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != _QUARK_OBSERVERS:
            return None
        sys.meta_path.remove(_JoinQuarkOnImport)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                register_with_quark()

            spec.loader.exec_module = exec_module
        return spec


@register("quark:PlaceholderObserver")
class PlaceholderObserver(QuarkObserver, _NativePlaceholder):
    """For float16 / bfloat16 casts: passes tensors through, no qparams."""

    _quark_base = None

    def _calculate_qparams(self):
        return None


@register("quark:UniformScalingObserver")
class UniformScalingObserver(_DynamicOrStatic):
    """Quark's base of uniform int / fp8 scaling: min / max over the spec's layout."""

    _eps_argument = "used"


@register("quark:PerTensorMinMaxObserver")
class PerTensorMinMaxObserver(_DynamicOrStatic):
    """Running (static) or last (dynamic) per-tensor min / max."""

    _quark_qscheme = "per_tensor"


@register("quark:PerChannelMinMaxObserver")
class PerChannelMinMaxObserver(_DynamicOrStatic):
    """Running (static) or last (dynamic) min / max per channel along ``ch_axis``; a static
    one starts over when the channel count changes, as Quark's."""

    _eps_argument = "ignored"
    _quark_qscheme = "per_channel"

    def _quark_attributes(self, qspec) -> dict:
        return {**super()._quark_attributes(qspec), "ch_axis": field(qspec, "ch_axis")}

    def _quark_state_key(self, shape):
        return self.spec.layout.num_units(shape)  # Quark compares its min_val's numel

    def reset_min_max_vals(self) -> None:
        self._require("min_val", "max_val")
        super().reset_min_max_vals()


@register("quark:PerGroupMinMaxObserver")
class PerGroupMinMaxObserver(_DynamicOrStatic):
    """Min / max per group of ``group_size`` along ``ch_axis``, of the last call (as Quark's:
    ``min_val`` / ``max_val`` flat ``(rows * groups,)``, the qparams ``(rows, groups)``)."""

    _eps_argument = "ignored"
    _quark_qscheme = "per_group"
    always_memoryless = True
    _flat_stats = True
    _quark_int_priced = ("fp4", "fp6_e2m3", "fp6_e3m2")
    #: its check_input (the shape) and set_shape (group_count) run on the cached CPU call too
    _step_overrides = ("check_input", "set_shape")

    def _quark_attributes(self, qspec) -> dict:
        # group_count: 1 until a tensor is observed (set_shape), kept by a reset, as Quark's
        return {**super()._quark_attributes(qspec), "ch_axis": field(qspec, "ch_axis"),
                "group_size": field(qspec, "group_size"), "group_count": 1}

    def check_input(self, x: torch.Tensor) -> bool:
        ok = super().check_input(x)
        layout = self.spec.layout  # a block scale format's: it pads, Quark's class refuses
        if ok and isinstance(layout, Block) and x.shape[layout.axis] % layout.size:
            raise ValueError(f"{self.describe()}: the {x.shape[layout.axis]} elements along "
                             f"ch_axis={layout.axis} are not divisible by group_size="
                             f"{layout.size}, as Quark's PerGroupMinMaxObserver requires")
        return ok

    def set_shape(self, shape):
        super().set_shape(shape)
        self.group_count = self.spec.layout.qparam_shape(tuple(shape))[-1]

    def calculate_qparams(self, min_val: torch.Tensor | None = None,
                          max_val: torch.Tensor | None = None):
        """As Quark's: a given flat range's qparams come back ``(-1, group_count)``, the
        group count of the last observed tensor (1 before any)."""
        out = super().calculate_qparams(min_val, max_val)
        if min_val is None and max_val is None:
            return out
        return tuple(t.reshape(-1, self.group_count) for t in out)


if _QUARK_OBSERVERS in sys.modules:  # Quark came first: join it now
    register_with_quark()
elif _JoinQuarkOnImport not in sys.meta_path:
    sys.meta_path.insert(0, _JoinQuarkOnImport)
