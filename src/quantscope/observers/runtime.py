"""The quantizer of one calibrated tensor at run time: :func:`runtime_qparams` decides the
qparams a role uses (stored, recomputed per call with a calibrated global scale, or by a
run-time observer), :func:`qdq_tensor` fake-quantizes with them.

Below :mod:`quantscope.calibration` (whose ``apply`` hooks models with it and whose ``report``
measures with it); ``state`` is a :class:`~quantscope.calibration.results.result.RoleState` or any
object with its fields (``spec``, ``dynamic``, ``qparams``, ``global_amax``, ``observer``,
``options``).
"""

from __future__ import annotations

import math

import torch
from torch.autograd import forward_ad

from ..qdq import fake_quantize
from ..qparams import QParams, qparams_from_range
from ..spec import QuantSpec
from ..stats.minmax import unit_minmax
from .registry import get_observer

__all__ = ["nested_rows", "qdq_tensor", "runtime_qparams"]


def runtime_qparams(x: torch.Tensor, state) -> QParams:
    """The qparams ``state`` quantizes ``x`` with. Computed on every forward for a run-time
    role, with no read-back: a unit (a token, say) holding NaN or +-inf gets a NaN scale, so
    its output is NaN, as the serving runtime's (compressed-tensors' and vLLM's per-token
    scale is then inf or NaN); block formats keep their scale rules (an MX block holding inf
    saturates, as torchao's ``to_mx``)."""
    spec = state.spec
    if state.dynamic is False:
        return state.qparams
    local = state.dynamic == "local"
    if local or (state.observer == "memoryless_minmax" and not state.options):
        # the per-unit min / max of x: a memoryless min-max observer's range (bit for bit, its
        # zero padding included: qparams take zero into every range), without building its
        # state module per call, so that a compiled model traces every preset's run-time
        # role in its graph
        lo, hi = unit_minmax(spec.layout.to_units(x.detach().float()))
        global_amax = state.global_amax.to(x.device) if local else None
    else:
        obs = get_observer(state.observer, spec, **dict(state.options)).to(x.device)
        obs(x.detach())
        # the observer's range, without its check_ready (a read-back that raises on NaN / inf)
        lo, hi = obs.calculate_range()
        global_amax = obs.global_amax()
    qp = qparams_from_range(lo, hi, spec, global_amax=global_amax, check_finite=False)
    if not spec.scale.is_block:  # (qparams_from_range clamps an inf range to a finite scale)
        finite = (lo.abs() < math.inf) & (hi.abs() < math.inf)  # NaN fails too
        qp = QParams(torch.where(finite, qp.scale, math.nan), qp.zero_point, qp.global_scale)
    return qp.reshape(spec.layout.qparam_shape(x.shape))


def qdq_tensor(x: torch.Tensor, state) -> torch.Tensor:
    """``x`` fake-quantized as ``state`` says, in ``x``'s dtype. An empty tensor (an MoE
    expert that no token was routed to) has nothing to quantize and passes through, under
    every mode (a run-time observer would have seen no value to take a range from). Under
    autograd (``x`` requires grad, grad enabled, or ``x`` carries a forward-mode tangent:
    ``torch.func.jvp``, ``jacfwd``, ``torch.autograd.forward_ad``) the result carries the
    straight-through gradient (``fake_quantize(ste=True)``): without it, every layer before a
    quantized activation would get no gradient (or a zero tangent), silently."""
    if not isinstance(getattr(state, "spec", None), QuantSpec):  # one test per forward
        raise TypeError(f"qdq_tensor: state must be a RoleState (or an object with its fields: "
                        f"spec, dynamic, qparams, ...), got {type(state).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"qdq_tensor: x must be a torch.Tensor, got {type(x).__name__}")
    if x.is_nested:  # its rows, quantized as one tensor (as calibrate observed them), put back
        parts = x.unbind()
        rows = qdq_tensor(nested_rows(x), state).split([t.numel() // t.shape[-1] for t in parts])
        return torch.nested.as_nested_tensor([r.reshape(t.shape) for r, t in zip(rows, parts)],
                                             layout=x.layout)
    if x.numel() == 0:
        return x
    ste = (x.requires_grad and torch.is_grad_enabled()) or _has_tangent(x)
    return fake_quantize(x, runtime_qparams(x, state), state.spec, ste=ste, check=False)


def nested_rows(x: torch.Tensor) -> torch.Tensor:
    """A nested tensor's rows (its components' ``[..., C]`` rows, concatenated): what an
    activation role sees of it. ``nn.TransformerEncoder`` in eval mode feeds its layers a
    batch with a padding mask as one, each sequence without its padding."""
    return torch.cat([t.reshape(-1, t.shape[-1]) for t in x.unbind()])


def _has_tangent(x: torch.Tensor) -> bool:
    """Whether ``x`` carries a forward-mode AD tangent (which ``requires_grad`` does not show,
    and no_grad does not stop). torch.func's jvp enters a forward_ad level too; without an
    open level (every plain forward) this is one global read."""
    level = forward_ad._current_level
    return level >= 0 and forward_ad.unpack_dual(x, level=level).tangent is not None
