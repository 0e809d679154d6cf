"""Quark's histogram-MSE search (``PerTensorMSEObserver.get_min_max_by_mse``) priced for many
candidates at once: each chunk of candidates is a ``[C, B]`` block of errors, and the answer is
bitwise that of Quark's loop, which prices one candidate at a time (:func:`loop_mses`).

Why each step equals the loop's, value for value (on the CPU):

- the integer qparams of the ranges ``(0, a)`` as one vector are each candidate's (elementwise
  formulas; a NaN / inf ``a`` raises in both). A 0-dim range's scale is promoted to its eps
  buffer's dtype, a vector's is not: an exact widening, which ``.to(torch.float)`` undoes;
- the fake-quantization is ATen's per-tensor CPU kernel written out per row
  (:func:`per_tensor_rows`). Not the per-channel kernel: it casts to int64 before it clamps,
  so a product past int64's range (or NaN) lands on quant_min, where the per-tensor one clamps;
- fp8 and the error are elementwise ops, whose values do not depend on the shape; the fp8
  codes turn back through a table of torch's own conversion of all 256 (exact widenings);
- ATen's CPU ``mean`` is a sum, then ``/ n``; each row sum of a contiguous ``[C, B]`` is the
  serial 1-D sum of that row (the same vectorized inner sum, rows never split), and the
  loop's 1-D sum is serial below ``GRAIN_SIZE`` elements or on one thread. Elsewhere (and for
  rows shorter than a SIMD vector, where the 1-D sum takes another loop) each row takes its
  own 1-D ``mean``, the loop's op itself.

Off the CPU the loop prices them: CUDA's kernel and reductions have other formulas and orders.
"""

from __future__ import annotations

import torch

from . import enum_name

#: Quark's fp8 formats of its MSE search
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: elements of one chunk of errors: its temporaries (4 MiB float32) stay in cache
_CHUNK = 1 << 20
#: at::internal::GRAIN_SIZE: from this many elements a 1-D sum splits over threads
_GRAIN = 32768
#: rows shorter than this may be below a SIMD vector (AVX-512 half: 32), another sum loop
_VEC = 64


def best_candidate(obs, centers: torch.Tensor, counts: torch.Tensor,
                   amax: torch.Tensor) -> torch.Tensor:
    """The first candidate of ``amax`` with the least float32-rounded error (Quark's argmin),
    priced by ``obs`` (a ``PerTensorMSEObserver``) over the bin ``centers`` and ``counts``."""
    return amax[candidate_mses(obs, centers, counts, amax).argmin()]  # (no read-back)


def candidate_mses(obs, centers, counts, amax) -> torch.Tensor:
    """Quark's error of each candidate (:func:`loop_mses`'s values), in chunks of candidates
    on the CPU, by :func:`loop_mses` elsewhere."""
    if centers.device.type != "cpu":
        return loop_mses(obs, centers, counts, amax)
    step = max(1, _CHUNK // max(1, centers.numel()))
    work: dict[str, torch.Tensor] = {}  # buffers the chunks share (new ones fault pages in)
    return torch.cat([_chunk_mses(obs, centers, counts, a, work) for a in amax.split(step)])


def loop_mses(obs, centers, counts, amax) -> torch.Tensor:
    """Quark's loop: one candidate at a time, its fake-quantizer and a float32 ``mean``."""
    zero = torch.tensor(0, device=centers.device)  # Quark's lower end of each range
    return torch.stack([((obs.scaling_fp8(centers, a) if obs.spec.is_float else
                          obs.int_fake_tensor_quant(centers, zero, a)) - centers).pow(2)
                        .mul(counts).mean() for a in amax])


def _chunk_mses(obs, centers, counts, amax, work):
    if obs.spec.is_float:
        fake = _fp8_fake(obs, centers, amax, work)
    else:
        fake = _int_fake(obs, centers, amax)
        if fake is None:  # qparams the per-tensor kernel refuses: the loop raises as it
            return loop_mses(obs, centers, counts, amax)
    err = fake.sub_(centers).pow_(2)  # (fake: new or a buffer, centers' dtype)
    err = err.mul_(counts) if err.dtype == torch.promote_types(err.dtype, counts.dtype) \
        else err.mul(counts)
    if _VEC <= err.shape[-1] and (err.shape[-1] < _GRAIN or torch.get_num_threads() == 1):
        return err.mean(-1)
    return torch.stack([row.mean() for row in err])  # (each row a contiguous 1-D tensor)


def _fp8_fake(obs, x: torch.Tensor, amax: torch.Tensor, work) -> torch.Tensor:
    """Row ``i``: Quark's ``scaling_fp8(x, amax[i])``; its fp8 codes turn back through a table
    (torch's e4m3 cast back is several times slower than the lookup)."""
    fp8 = FP8_DTYPES.get(enum_name(obs.dtype))
    if fp8 is None:  # (scaling_fp8's error)
        return obs.scaling_fp8(x, amax[0])
    scale = (amax / obs.quant_max)[:, None]
    y = torch.div(x, scale, out=_buffer(work, "y", amax.numel(), x, x.dtype))
    y.clamp_(min=obs.quant_min, max=obs.quant_max)
    codes = _buffer(work, "codes", amax.numel(), x, fp8).copy_(y)  # (.to(fp8)'s cast)
    index = _buffer(work, "index", amax.numel(), x, torch.int32).copy_(codes.view(torch.uint8))
    table = torch.arange(256, dtype=torch.uint8, device=x.device).view(fp8).to(x.dtype)
    torch.index_select(table, 0, index.view(-1), out=y.view(-1))
    return y.mul_(scale)


def _buffer(work: dict, name: str, rows: int, row: torch.Tensor, dtype) -> torch.Tensor:
    """``[rows, len(row)]`` of ``dtype`` from ``work``'s buffer ``name`` (grown as needed)."""
    size = rows * row.numel()
    buf = work.get(name)
    if buf is None or buf.numel() < size:
        buf = work[name] = torch.empty(size, dtype=dtype, device=row.device)
    return buf[:size].view(rows, row.numel())


def _int_fake(obs, x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor | None:
    """Row ``i``: ``torch.fake_quantize_per_tensor_affine(x, *obs's qparams of (0, amax[i]))``
    as its CPU kernel computes it; None where that kernel would raise."""
    zero = torch.zeros(amax.shape, dtype=torch.int64, device=amax.device)  # Quark's tensor(0)
    scale, zp = obs.calculate_int_quant_params(zero, amax)
    qmin, qmax = obs.quant_min, obs.quant_max
    if not (type(qmin) is int and type(qmax) is int and qmin <= qmax  # (kernel's checks)
            and bool(((zp >= qmin) & (zp <= qmax)).all())):
        return None
    return per_tensor_rows(x, scale.to(torch.float), zp.to(torch.int), qmin, qmax)


def per_tensor_rows(x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, qmin: int,
                    qmax: int) -> torch.Tensor:
    """Row ``i`` of ``[C, B]``: ATen's CPU ``fake_quantize_per_tensor_affine(x, scale[i],
    zp[i], qmin, qmax)`` (``x``: ``[B]``; ``scale``: float32 ``[C]``; ``zp``: int32 ``[C]``):
    ``zp + nearbyint(x * (1.0f / scale))`` in float (double for float64 ``x``), clamped by
    ``fmax`` / ``fmin`` (NaN -> qmin) before its int64 cast, then ``(q - zp) * scale`` in
    float, stored in ``x``'s dtype."""
    scale, zp = scale[:, None], zp[:, None]
    inv = scale.reciprocal()  # 1.0f / scale
    wide = x.double() if x.dtype == torch.float64 else x.float()  # scalar_t * float's type
    q = torch.mul(wide, inv.to(wide.dtype)).round_()  # nearbyint: half to even
    # zero points all 0: adding and taking them off only turns -0.0 into 0.0 (squared alike)
    shifted = bool(zp.any())
    if shifted:
        q.add_(zp)  # zp + q in q's type, as the kernel's
    if bool(inv.isfinite().all()) and bool(x.isfinite().all()):  # no NaN: clamp is fmax / fmin
        q.clamp_(qmin, qmax)
    else:
        q = q.fmax(torch.tensor(qmin, dtype=q.dtype)).fmin(torch.tensor(qmax, dtype=q.dtype))
    if shifted:
        q.sub_(zp)
    return q.float().mul_(scale).to(x.dtype)  # (q - zp) * scale in float
