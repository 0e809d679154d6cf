"""llm-compressor's earlier observer generation (the seed's API): ``forward`` returns
``(scale, zero_point)``.

These classes register in quantscope's registry as ``"llmcompressor:<name>"``
(``quantscope.get_observer("llmcompressor:minmax", base_name=..., args=...)``).
llm-compressor 0.14's generation (``forward`` returns the observer, ``get_qparams()``
a dict, statistics API, fusion handler) is :mod:`quantscope.compat.llmcompressor`.

``args`` is a compressed-tensors ``QuantizationArgs`` or a dict with its fields
(num_bits, type, symmetric, strategy, group_size, block_structure, dynamic,
actorder, scale_dtype, observer_kwargs). :func:`llmcompressor_spec` is the one
translation into a :class:`~quantscope.QuantSpec`:

==============  =================================================================
strategy        layout
==============  =================================================================
tensor          ``Tensor()``
channel         ``Channel(0)`` for weights (rows), ``Channel(-1)`` for activations
group           ``Group(group_size)``; MX when float, group 32 and ``scale_dtype`` uint8
                (E8M0 'even')
tensor_group    ``Block(group_size)`` with fp8 block scales under a global scale (NVFP4:
                fp4 elements, ``scale_dtype`` float8_e4m3fn or unset); ``Group(group_size)``
                otherwise (integers, fp8 / fp6 elements, a float16 / bfloat16 ``scale_dtype``)
block           ``Tile(*block_structure)``
token           ``Token()``
attn_head       ``Channel(1)`` of ``[batch, heads, seq, head_dim]``
==============  =================================================================

``g_idx`` (the call's, else ``module.<base_name>_g_idx`` read at construction; -1s: column
order) groups the columns of group and tensor_group strategies, MX and NVFP4 blocks too, as
the seed did (``argsort(g_idx)``); the other strategies ignore it, as the seed's did.
Running observers (static, moving average) merge each group index's statistics across calls
whatever ``g_idx`` each call gave, as the seed's kept them per group index.

Calling an observer observes the tensor and returns ``(scale, zero_point)`` as
llm-compressor's observers did, and so does ``get_qparams(observed=...)``, as in that
generation; ``get_qparams()`` without arguments returns the newer dict with
``global_scale``. Known difference: compressed-tensors' MXFP8 rounds the block
amax with fp4's mantissa width before taking the exponent; quantscope uses the
element format's own (e4m3: 3 bits).
"""

from __future__ import annotations

import torch

from .._checks import version_of
from ..layout import Block, Group
from ..observers.minmax import MemorylessMinMaxObserver as _NativeMemoryless
from ..observers.minmax import MovingAverageMinMaxObserver as _NativeEMA
from ..observers.minmax import StaticMinMaxObserver as _NativeStatic
from ..observers.mse import MemorylessMSEObserver as _NativeMemorylessMSE
from ..observers.mse import MovingAverageMSEObserver as _NativeMSE
from ..observers.mse import NVFP4ExpandedMSEObserver as _NativeNVFP4MSE
from ..observers.registry import observer_class, register
from . import enum_name, field
from .llmcompressor_spec import filled_g_idx, llmcompressor_spec, zp_dtype

__all__ = [
    "LLMCompressorObserver",
    "MemorylessMSEObserver",
    "MemorylessMinMaxObserver",
    "MinMaxObserver",
    "MovingAverageMSEObserver",
    "NVFP4ExpandedMSEObserver",
    "Observer",
    "StaticMinMaxObserver",
    "llmcompressor_spec",
]


class Observer:
    """llm-compressor's observer base (a mixin: put it before the native class).

    ``(base_name, args, module=None, **observer_kwargs)``; keywords named in
    :attr:`native_options` (from ``args.observer_kwargs`` or the call) go to the
    native observer.
    """

    #: observer_kwargs forwarded to the native observer's constructor
    native_options: tuple[str, ...] = ()

    def __init__(self, base_name: str, args, module: torch.nn.Module | None = None,
                 **observer_kwargs):
        kwargs = dict(field(args, "observer_kwargs") or {})
        kwargs.update(observer_kwargs)
        g_idx = None
        if module is not None and enum_name(field(args, "strategy")) in ("group", "tensor_group"):
            g_idx = filled_g_idx(getattr(module, f"{base_name}_g_idx", None))
        spec = _seed_spec(args, base_name)
        order = _act_order(spec.layout, g_idx)  # checks g_idx as Group does
        if isinstance(spec.layout, Group) and order is not None:
            spec = spec.replace(layout=order)
        super().__init__(spec, **{k: kwargs[k] for k in self.native_options if k in kwargs})
        self.base_name, self.args, self.observer_kwargs = base_name, args, kwargs
        self._g_idx = g_idx  # the default grouping: forward(x) without g_idx
        # (g_idx, its in-place version) the layout was last built for, and a Block layout's
        # Group: Group's checks read g_idx on the host, once per g_idx (or in-place write,
        # as GPTQ fills weight_g_idx) rather than per forward
        self._order_of = (g_idx, version_of(g_idx))
        self._block_order = None
        self.module = None if module is None else [module]  # not a submodule
        # [(state key, zp dtype, get_qparams' dict, its tensors' versions)]: forward returns
        # qparams, then callers ask get_qparams for the same ones (llm-compressor's flow); a
        # list, not a module attribute
        self._qp_cache = [None]

    def __getstate__(self):
        # the cache is derived, and its float8 zero points do not unpickle (torch 2.13)
        return {**super().__getstate__(), "_qp_cache": [None]}

    @classmethod
    def load_from_registry(cls, name: str, **kwargs):
        """The class registered as ``"llmcompressor:" + name``, constructed with ``kwargs``."""
        return observer_class(f"llmcompressor:{name}")(**kwargs)

    @property
    def is_weight_obs(self) -> bool:
        return self.base_name == "weight"

    @torch.no_grad()
    def forward(self, observed: torch.Tensor, g_idx: torch.Tensor | None = None,
                global_scale: torch.Tensor | None = None):
        """Observe ``observed`` and return ``(scale, zero_point)`` for it, its columns grouped
        by ``g_idx`` (-1s: column order; None: the module's ``{base_name}_g_idx``, if any)."""
        if global_scale is not None:
            raise NotImplementedError("llmcompressor: pass NVFP4 tensors whole; the global "
                                      "scale is derived from the observed absmax")
        self._observe_grouped(observed, g_idx)
        if not self.has_observed:  # empty tensor
            return None
        qp = self.get_qparams()
        return qp["scale"], qp["zero_point"]

    def get_qparams(self, observed: torch.Tensor | None = None,
                    g_idx: torch.Tensor | None = None,
                    global_scale: torch.Tensor | None = None):
        """Without arguments, ``{"scale", "zero_point", "global_scale"}`` from the statistics
        (the newer API); with ``observed``, the seed generation's call: :meth:`forward`'s
        ``(scale, zero_point)`` (``observed`` observed first, ``g_idx`` / ``global_scale``
        as there).

        The zero point comes in compressed-tensors' ``zp_dtype`` (int8 for int8 / int4,
        float8_e4m3fn for float formats, unless ``args.zp_dtype`` says otherwise).

        Computed once per state: forward computes them (its return value) and the
        ``get_qparams()`` that follows in llm-compressor's flow hands out the same tensors,
        not copies (a million NVFP4 block scales per weight). The cache keeps their in-place
        versions: a caller that wrote into them makes it a miss, so a write is never seen by
        the next call (but it is by the other holder of the tensors).
        """
        if observed is not None:
            return self.forward(observed, g_idx, global_scale)
        if g_idx is not None or global_scale is not None:  # they only apply to observed data
            raise ValueError("get_qparams: g_idx and global_scale need observed=...; call "
                             "get_qparams() without them for the stored qparams' dict")
        key, dtype, hit = self._state_key(), self._zp_dtype(), self._qp_cache[0]
        if (key is not None and hit is not None and hit[1] == dtype and _same_key(hit[0], key)
                and all(t._version == v for t, v in hit[3])):
            return dict(hit[2])
        qp = self.qparams()
        if self.spec.is_float and (self.spec.symmetric or self.spec.scale.is_block):
            zp = torch.zeros(qp.zero_point.shape, dtype=dtype)  # zero by construction (a
            # float8 cast of a million zeros costs more than the qparams)
        else:
            zp = qp.zero_point.to(dtype)
        out = {"scale": qp.scale, "zero_point": zp, "global_scale": qp.global_scale}
        versions = [(t, version_of(t)) for t in out.values() if t is not None]
        # not cached where a version is not tracked (made under inference mode)
        self._qp_cache[0] = None if key is None or any(v is None for _, v in versions) else (
            key, dtype, out, versions)
        return dict(out)

    def _observe_grouped(self, observed, g_idx) -> None:
        """The native forward on ``observed`` grouped by ``g_idx`` (None: the default), as the
        seed's group and tensor_group strategies did: Group layouts carry it; Block ones
        (NVFP4, MX) observe the columns in its group order; other layouts ignore it."""
        g_idx = self._g_idx if g_idx is None else filled_g_idx(g_idx)
        seen = (g_idx, version_of(g_idx))
        changed = (seen[0] is not self._order_of[0] or seen[1] != self._order_of[1]
                   or (g_idx is not None and seen[1] is None))  # an untracked one: rebuilt
        lay = self.spec.layout
        if isinstance(lay, Group):
            if changed:
                self.spec = self.spec.replace(layout=Group(lay.size, lay.axis, g_idx))
        elif isinstance(lay, Block) and g_idx is not None and isinstance(observed, torch.Tensor):
            if changed or self._block_order is None:
                self._block_order = _act_order(lay, g_idx)
            self._block_order._geometry(observed.shape)  # g_idx's length: the columns'
            observed = self._block_order._columns(observed)
        self._order_of = seen
        super().forward(observed)

    def _state_key(self):
        """What the qparams depend on: the spec and every buffer, by identity and in-place
        version (any update, reset, load or sync replaces a buffer or bumps its version);
        None where versions are not tracked (inference-mode tensors): no caching."""
        try:
            return (self.spec, self._last_shape,
                    tuple((b, b._version) for b in self._buffers.values() if b is not None))
        except RuntimeError:
            return None

    def _zp_dtype(self) -> torch.dtype:
        return zp_dtype(self.args, self.spec)

    def sync_activation_stats(self) -> list:
        """All-reduce the statistics across DDP ranks as llm-compressor declares them
        (``_act_sync_dict``: static MIN / MAX, moving averages AVG, memoryless nothing).

        Synchronous (through :mod:`quantscope.distributed`, which also brings a rank
        that saw no data into line); returns an empty list of pending handles.
        """
        self.sync()
        return []

    def get_global_scale(self, observed: torch.Tensor | None = None) -> torch.Tensor | None:
        """NVFP4's global scale (observing ``observed`` first if given); None for other
        strategies."""
        if observed is not None:
            self._observe_grouped(observed, None)
        if not self.spec.scale.has_global_scale:
            return None
        return self.qparams().global_scale


LLMCompressorObserver = Observer


def _seed_spec(args, base_name: str):
    """:func:`llmcompressor_spec`, but for fp8 / fp6 ``tensor_group`` elements: the seed's
    compressed-tensors gave them plain group scales (``amax / element max``; its block scales
    under a global scale were NVFP4's alone), where the later one multiplies them by fp4's
    global scale, which the translation's block scales express (the reader needs that)."""
    spec = llmcompressor_spec(args, base_name)
    if (enum_name(field(args, "strategy")) == "tensor_group" and spec.is_float
            and int(field(args, "num_bits", 8)) != 4):
        spec = spec.replace(layout=Group(spec.layout.size, -1), scale="fp32")
    return spec


def _act_order(layout, g_idx: torch.Tensor | None) -> Group | None:
    """``Group(size, -1, g_idx)`` for a group or NVFP4 / MX block layout (its checks run
    here); None for column order and for the layouts the seed applied no g_idx to."""
    if g_idx is None or not isinstance(layout, (Group, Block)):
        return None
    return Group(layout.size, -1, g_idx)


def _same_key(a, b) -> bool:
    return (a[0] is b[0] and a[1] == b[1] and len(a[2]) == len(b[2])
            and all(x is y and vx == vy for (x, vx), (y, vy) in zip(a[2], b[2])))


@register("llmcompressor:memoryless_minmax")
class MemorylessMinMaxObserver(Observer, _NativeMemoryless):
    """The min / max of the last observed value."""

    def sync_plan(self):  # llm-compressor's _act_sync_dict is empty: nothing is reduced
        return {}


@register("llmcompressor:static_minmax")
class StaticMinMaxObserver(Observer, _NativeStatic):
    """The min / max of all observed values."""


@register("llmcompressor:minmax")
class MinMaxObserver(Observer, _NativeEMA):
    """Moving average of min / max (``averaging_constant`` from observer_kwargs, default 0.01)."""

    native_options = ("averaging_constant",)
    state_update = "ema_lerp"  # llm-compressor's lerp: old * (1 - c) + new * c, its rounding


_MSE_OPTIONS = ("maxshrink", "patience", "grid", "norm", "expand")


@register("llmcompressor:memoryless_mse")
class MemorylessMSEObserver(Observer, _NativeMemorylessMSE):
    """llm-compressor's MSE grid search, exactly (global patience, norm 2.4, their error sum).

    observer_kwargs maxshrink, patience, grid, norm, expand as theirs; their CUDA-only
    ``triton_error_buffer`` is accepted and ignored (the eager search is what runs on CPU).
    """

    compat_default = "llmcompressor"
    native_options = _MSE_OPTIONS

    def sync_plan(self):  # their _act_sync_dict is empty
        return {}


@register("llmcompressor:mse")
class MovingAverageMSEObserver(Observer, _NativeMSE):
    """llm-compressor's ``mse``: the exact search, then their lerp (``averaging_constant`` 0.01)."""

    compat_default = "llmcompressor"
    native_options = (*_MSE_OPTIONS, "averaging_constant")


@register("llmcompressor:nvfp4_expanded_mse")
class NVFP4ExpandedMSEObserver(Observer, _NativeNVFP4MSE):
    """llm-compressor's ``nvfp4_expanded_mse`` (expand 1.8, grid 200, patience 1000), exactly."""

    compat_default = "llmcompressor"
    native_options = _MSE_OPTIONS

    def sync_plan(self):
        return {}
