"""quantize / dequantize / fake_quantize for every format and layout.

``q = round(clamp(x / scale + zero_point, qmin, qmax))`` (half to even; float
formats round to their nearest value and saturate) and ``x' = (q - zero_point) * scale``,
computed in float32 on the layout's ``[units, elements]`` view, whatever the
input dtype; results come back in the tensor's shape, saturated to the dtype's finite
range (see :func:`_saturate`). An empty tensor gives an empty result.

``qparams`` are shaped ``spec.layout.qparam_shape(x.shape)`` (leading 1s aside: a 3-D
activation's scales apply to its 2-D rows) or flat ``(units,)`` (any one value for a single
unit), with a global scale of one value or None; another shape (another
layout's, in another order), a spec that is not a :class:`QuantSpec` or a complex tensor
raises ``ValueError`` / ``TypeError``, with ``check=False`` too (no host read).

``check=True`` (the default) reads the qparams back once. Traced by ``torch.compile`` or
``torch.export``, the same checks are asserts in the graph instead (no read, no graph break:
``fullgraph=True`` takes them), raising ``RuntimeError`` when the graph runs on bad values.
"""

from __future__ import annotations

import math

import torch

from . import kernels
from ._checks import check_bool, check_not_meta, check_real, check_spec
from .qparams import QParams
from .scales import not_encoded
from .spec import QuantSpec

__all__ = [
    "clip_edges",
    "dequantize",
    "dequantize_units",
    "fake_quantize",
    "fake_quantize_units",
    "inside_range",
    "quantize",
    "quantize_units",
]


def _per_unit(qparams: QParams, spec: QuantSpec, shape, who: str = "qparams", device=None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[units, 1]`` float32 scale and zero point, after the checks that read nothing back
    (so ``check=False`` keeps them): the types, the device (``device``: the input's), and each
    tensor shaped ``layout.qparam_shape(shape)`` or flat ``(units,)`` (what
    ``qparams_from_range`` gives on flat ranges); a count alone would take another layout's
    qparams in another order."""
    _check_fields(qparams, spec, who)
    if device is not None and device != qparams.scale.device or (
            qparams.zero_point.device != qparams.scale.device):
        sd, zd = qparams.scale.device, qparams.zero_point.device
        on = sd if sd == zd else f"{sd} (scale) and {zd} (zero_point)"
        arg = "q" if who == "dequantize" else "x"
        meta = "; meta tensors hold no data" if "meta" in (sd.type, zd.type, str(device)) else ""
        raise ValueError(f"{who}: {arg} is on {device} but qparams on {on}: move them to one "
                         f"device, e.g. qparams.to({arg}.device){meta}")
    qshape = tuple(spec.layout.qparam_shape(shape))
    units = math.prod(qshape)
    scale = qparams.effective_scale
    if scale.numel() != units or qparams.zero_point.numel() != units:
        raise ValueError(
            f"qparams: scale has {scale.numel()} values and zero_point "
            f"{qparams.zero_point.numel()}, but {spec.layout} on a tensor of shape "
            f"{tuple(shape)} has {units} units")
    for name in ("scale", "zero_point"):
        got = tuple(getattr(qparams, name).shape)
        # leading 1s aside: a [B, T, C] activation's (1, 1, C) scales run on its [N, C] rows;
        # the flat form exactly (a (1, N) is another layout's row of scales, not flat)
        if units > 1 and got != (units,) and _lstrip_ones(got) != _lstrip_ones(qshape):
            raise ValueError(f"{who}: qparams.{name} must have shape {qshape} ({spec.layout} "
                             f"on a tensor of shape {tuple(shape)}) or ({units},), got {got}")
    zp = qparams.zero_point
    if scale.requires_grad or zp.requires_grad:  # constants, as torch's fake-quantize takes
        scale, zp = scale.detach(), zp.detach()  # them: no gradient flows to them
    return scale.reshape(units, 1).float(), zp.reshape(units, 1).float()


def _lstrip_ones(shape: tuple) -> tuple:
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape


def _check_fields(qparams: QParams, spec: QuantSpec, who: str) -> None:
    """``TypeError`` / ``ValueError`` on a spec or qparams of the wrong kind: real tensors, a
    global scale of one value (or None)."""
    check_spec(who, spec)
    if not isinstance(qparams, QParams):
        raise TypeError(f"{who}: qparams must be a QParams, got {type(qparams).__name__}")
    for name in ("scale", "zero_point", "global_scale"):
        t = getattr(qparams, name)
        if t is None and name == "global_scale":
            continue
        if not isinstance(t, torch.Tensor) or t.is_complex():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{who}: qparams.{name} must be a real torch.Tensor, got {got}")
    gs = qparams.global_scale
    if gs is not None and gs.numel() != 1:  # more would broadcast into the block scales
        raise ValueError(f"{who}: qparams.global_scale must have one value (shape (1,)), got "
                         f"shape {tuple(gs.shape)}")


def _check_qparams(qparams: QParams, spec: QuantSpec, who: str, data=None) -> None:
    """Raise unless ``qparams`` can run: finite positive scales (and global scale), integer
    zero points in the code range (0 for float formats), as torch's fake-quantize demands.
    One host read; the library's own callers, whose qparams come from the formulas, skip
    it (``check=False``: no read, so a CUDA graph can hold the call). After
    :func:`_per_unit`, which checks the types, shapes and devices. ``data``: ``(flag, error)``,
    a bool tensor read in the same read (True: raise ``error``), for the input's check (and
    an error of constants alone for a traced call, if ``error`` formats more)."""
    check_not_meta(who, "pass check=False", qparams.scale)  # the input is on its device
    if (qparams.global_scale is None) == spec.scale.has_global_scale:
        # QDQ divides the block scales by a global scale: without one NVFP4's run 1 / gs off
        raise ValueError(f"{who}: qparams.global_scale must be "
                         f"{'given' if spec.scale.has_global_scale else 'None'} for {spec}")
    zp = qparams.zero_point
    held = (qparams.scale, zp, *(() if data is None else data[:1]),
            *(() if qparams.global_scale is None else (qparams.global_scale,)))
    if not (torch.compiler.is_compiling() or kernels.real(*held)):
        # fakes, vmap tensors, a trace: no values to read (shapes and dtypes were checked);
        # torch.compile and torch.export get the checks as asserts in the graph (below)
        return
    lo, hi = (0, 0) if spec.is_float else (spec.qmin, spec.qmax)
    # one aminmax pass per tensor (NaN propagates and fails every comparison): the check
    # costs 1-2 % of a fake-quantize even with one scale per 16 elements (NVFP4)
    ends = {name: torch.aminmax(t.reshape(-1)) for name, t in
            (("scale", qparams.scale), ("global_scale", qparams.global_scale),
             ("zero_point", zp)) if t is not None and t.numel()}
    tests = {name: ~((mn > 0) & (mx < math.inf)) for name, (mn, mx) in ends.items()
             if name != "zero_point"}
    if "scale" in tests:  # a scale its encoding cannot store (an MX scale of 0.3)
        tests["scale"] |= not_encoded(qparams.scale, spec.scale).any()
    if "zero_point" in ends:
        mn, mx = ends["zero_point"]
        tests["zero_point"] = ~((mn >= lo) & (mx <= hi))
        if zp.is_floating_point():  # between integers
            tests["zero_point"] |= (zp != torch.round(zp)).any()
    if data is not None:
        tests["data"] = data[0]

    def error(name: str, traced: bool = False) -> str:
        if name == "data":  # (its message, and one of constants alone if it has two)
            return f"{who}: {data[-1] if traced else data[1]}"
        # (a traced message holds only constants: the tracers cannot format the spec)
        of = "" if traced else f" of {spec}"
        stored = "" if traced else f" and values its {spec.scale} encoding stores"
        want = {"zero_point": f"integers in the code range [{lo}, {hi}]{of}",
                "scale": f"finite, > 0{stored}"}.get(name, "finite and > 0")
        return f"{who}: qparams.{name} must be {want}"

    if torch.compiler.is_compiling():  # asserts in the graph: no read, no graph break (so
        for name, b in tests.items():  # fullgraph=True and torch.export take the check)
            torch._assert_async(~b, error(name, traced=True))
        return
    bad = torch.stack(list(tests.values())).tolist() if tests else []
    for name, b in zip(tests, bad):
        if b:
            raise ValueError(error(name))


_NAN_INPUT = ("x holds NaN (non-finite input), which has no code (+-inf saturate to the range's "
              "ends); fix the input, or pass check=False to get NaN codes")


def _fits(t: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether ``other`` broadcasts into ``t`` in place (its shape does not grow ``t``)."""
    shape = getattr(other, "shape", ())
    n = len(shape)  # the common case by hand: torch.broadcast_shapes costs ~8 us a call
    if n <= t.dim() and all(o in (1, d) for o, d in zip(shape, t.shape[t.dim() - n:])):
        return True
    return torch.broadcast_shapes(t.shape, shape) == t.shape  # False, or torch's error


def quantize_units(u: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                   spec: QuantSpec, out: torch.Tensor | None = None, *,
                   clamp: bool = True) -> torch.Tensor:
    """Codes of float32 ``u [U, E]`` with per-unit ``scale``, ``zero_point`` (``[U, 1]`` or
    broadcastable); ``out``: a float32 ``[U, E]`` buffer to compute them in (``u`` itself
    only where the caller no longer needs it).
    ``clamp=False``: rounded alike but not clamped to the code range (what would clip)."""
    # a fresh tensor (or out): the steps below work in place on it
    t = u / scale if out is None else torch.div(u, scale, out=out)
    unbounded = () if clamp else (-math.inf, math.inf)
    if spec.is_float:
        return spec.format.round(t, *unbounded, inplace=True)
    t = t.add_(zero_point) if _fits(t, zero_point) else t + zero_point
    return spec.format.round(t, *(unbounded or (spec.qmin, spec.qmax)), inplace=True)


def dequantize_units(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor):
    """``(q - zero_point) * scale`` on a units view (the inverse of :func:`quantize_units`)."""
    return (q - zero_point) * scale


def fake_quantize_units(u: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                        spec: QuantSpec, out: torch.Tensor | None = None) -> torch.Tensor:
    """``dequantize(quantize(u))`` on a units view: what the searches score candidates with.

    One output allocation (plus the float rounding's temporaries), or none into ``out`` (a
    search scoring many candidates reuses one buffer): the codes are dequantized in place.
    """
    q = quantize_units(u, scale, zero_point, spec, out)
    if spec.is_float:  # zero point 0
        return q.mul_(scale) if _fits(q, scale) else q * scale
    if _fits(q, zero_point) and _fits(q, scale):
        return q.sub_(zero_point).mul_(scale)
    return dequantize_units(q, scale, zero_point)


def _saturate(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clamp float32 values ``t`` (in place) to ``dtype``'s finite range.

    A symmetric integer scale maps ``amax`` to ``(qmax - qmin) / 2`` (127.5 for int8), so
    the code ``qmin`` (-128) dequantizes to ``-128 / 127.5 * amax``: past the largest
    finite value when ``amax`` is near it (65504 in float16, float32's max). Such values
    saturate at that max, as the float formats' own rounding does, rather than become inf.
    """
    fmax = torch.finfo(t.dtype).max  # float64's max is not a float32 bound: float32's is
    if dtype.is_floating_point:
        fmax = min(fmax, torch.finfo(dtype).max)
    return t.clamp_(-fmax, fmax)


def _check_input(x: torch.Tensor, who: str):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who}: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{who}: x must be a floating-point tensor, got {x.dtype}")


def quantize(x: torch.Tensor, qparams: QParams, spec: QuantSpec, *,
             check: bool = True) -> torch.Tensor:
    """Quantization codes of ``x`` as float32, shaped like ``x``.

    Integer formats give integer-valued codes in ``[qmin, qmax]``; float formats
    give their representable values (cast them with ``.to(torch.float8_e4m3fn)``
    to store fp8); +-inf saturate to the range's ends. ``check``: raise ``ValueError`` on
    qparams that cannot run (a scale not finite and positive, a zero point off the code
    range) and on NaN in ``x``, which has no code; one host read (``check=False``: none,
    and NaN gives NaN codes).
    """
    _check_input(x, "quantize")
    check_bool("quantize", "check", check)
    scale, zp = _per_unit(qparams, spec, x.shape, "quantize", x.device)
    u = spec.layout.to_units(x.float())
    if check:  # one reduction, read with the qparams' flags
        _check_qparams(qparams, spec, "quantize", (u.isnan().any(), _NAN_INPUT))
    return _as_input(spec.layout.to_shape(quantize_units(u, scale, zp, spec), x.shape), x,
                     torch.float32)


def dequantize(q: torch.Tensor, qparams: QParams, spec: QuantSpec,
               dtype: torch.dtype = torch.float32, *, check: bool = True) -> torch.Tensor:
    """Values of codes ``q`` (as returned by :func:`quantize`, or stored integer codes), in
    the floating-point ``dtype``. ``check``: raise ``ValueError`` on qparams that cannot run
    (as :func:`quantize`) and on ``q`` holding NaN, a value outside ``[qmin, qmax]`` or, for
    integer formats, a non-integer; one host read (``check=False``: none)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"dequantize: q must be a torch.Tensor, got {type(q).__name__}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dequantize: dtype must be a floating-point torch.dtype (the values "
                        f"are not codes), got {dtype!r}")
    check_real("dequantize", q=q)
    check_bool("dequantize", "check", check)
    scale, zp = _per_unit(qparams, spec, q.shape, "dequantize", q.device)
    u = spec.layout.to_units(q.float())
    if check:  # an integer code is its own rounding (NaN is not): one pass, one read
        # with the qparams'; float formats: the range only (a value between their codes
        # dequantizes as the value it is)
        rounded = spec.format.round if not spec.is_float else torch.clamp
        off = (rounded(u, spec.qmin, spec.qmax) != u).any()
        kind = "values" if spec.is_float else "integers"
        codes = f"{kind} in [{spec.qmin}, {spec.qmax}] (got NaN or a value outside them)"
        _check_qparams(qparams, spec, "dequantize", (
            off, f"q must hold codes of {spec}: {codes}; pass check=False to skip this check",
            f"q must hold codes: {codes}"))  # (traced: no spec in it)
    out = _saturate(dequantize_units(u, scale, zp), dtype)
    return _as_input(spec.layout.to_shape(out, q.shape), q, dtype)


def _as_input(out: torch.Tensor, x: torch.Tensor, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """``out`` in ``dtype`` (default ``x``'s) and in ``x``'s memory format: channels-last where
    ``x`` is in one, as torch's ``fake_quantize_per_*`` keep it (a conv net run channels-last
    would convert back), else contiguous. A layout's ``to_shape`` may give a view (a slice of
    padded units, a moved axis): it is copied, so no result holds the padding's buffer or
    strides of its own (``.to`` alone keeps a view whose suggested format already matches)."""
    fmt = torch.contiguous_format
    if x.dim() in (4, 5) and not x.is_contiguous():
        last = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        fmt = last if x.is_contiguous(memory_format=last) else fmt
    dtype = x.dtype if dtype is None else dtype  # one copy at most
    return out.to(dtype, memory_format=fmt) if out.dtype != dtype else \
        out.contiguous(memory_format=fmt)


def fake_quantize(x: torch.Tensor, qparams: QParams, spec: QuantSpec, *,
                  ste: bool = False, check: bool = True) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype (QDQ).

    With ``ste=True`` the result carries a straight-through gradient for
    quantization-aware training: ``d out / d x`` is 1 where ``x`` lies inside the
    quantizer's range and 0 where it was clipped (:func:`inside_range`). For integers that
    is ``torch.ao``'s FakeQuantize rule on quantscope's own rounding, ``round(x / scale +
    zero_point)`` (compressed-tensors'), where torch.ao rounds ``x * (1 / scale)`` and adds
    the zero point after: where that lands on a rounding tie (a reciprocal's rounding, or an
    odd zero point: ``0.5`` with zero point 1 is code 2 here, 1 there) the values, and at the
    range's ends the masks, can differ. No gradient flows to the
    qparams: they are constants, as torch's ``fake_quantize_per_tensor_affine`` takes them.
    ``check``: raise ``ValueError`` on qparams that cannot run, as :func:`quantize`; NaN in
    ``x`` stays NaN (documented QDQ behaviour: it has values, not codes, to give).
    """
    _check_input(x, "fake_quantize")
    check_bool("fake_quantize", "ste", ste)
    check_bool("fake_quantize", "check", check)
    scale, zp = _per_unit(qparams, spec, x.shape, "fake_quantize", x.device)
    if check:
        _check_qparams(qparams, spec, "fake_quantize")
    u = spec.layout.to_units(x.detach().float())
    # a half x's float32 copy is this call's own: QDQ runs in it (one fresh tensor fewer)
    own = x.dtype != torch.float32 and not ste
    out = _saturate(fake_quantize_units(u, scale, zp, spec, u if own else None), x.dtype)
    out = _as_input(spec.layout.to_shape(out, x.shape), x)
    if not ste:
        return out
    inside = spec.layout.to_shape(inside_range(u, scale, zp, spec), x.shape)
    # where, not a product: at x = +-inf, (x - x) * 0 is NaN; minus a +0.0, not plus one,
    # keeps a -0.0 result's sign (the forward's bits as without ste)
    return out - torch.where(inside, x.detach() - x, 0)


def inside_range(u: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                 spec: QuantSpec) -> torch.Tensor:
    """Where QDQ does not clip ``u``: its code, rounded as QDQ rounds it but not clamped, lies
    in ``[qmin, qmax]``. A value that rounding alone puts on the range's edge is inside (fp8
    min-max: the absmax, 1 ulp past ``448 x scale`` in float32); +-inf and NaN are not."""
    codes = quantize_units(u, scale, zero_point, spec, clamp=False)
    return (codes >= spec.qmin) & (codes <= spec.qmax)


def clip_edges(qparams: QParams, spec, units: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-unit ``[U, 1]`` smallest and largest values the quantizer represents."""
    scale = qparams.effective_scale.reshape(units, 1).float()
    zp = qparams.zero_point.reshape(units, 1).float()
    return dequantize_units(spec.qmin, scale, zp), dequantize_units(spec.qmax, scale, zp)
