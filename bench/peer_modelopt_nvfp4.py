"""ModelOpt's NVFP4 weight-MSE block-scale sweep, called as its calibrator is (bench only).

``sweep(w)`` runs ``NVFP4MSECalibrator`` (nvidia-modelopt 0.47,
``modelopt.torch.quantization.calib.mse``) on a weight ``w`` (last dimension a multiple of 16)
the way its ``mse_calibrate(..., fp8_scale_sweep=True)`` does for a static NVFP4 weight: the
initial amax is each block's max |w|, the global amax the tensor's, and ``collect`` on the
blocked ``[n_blocks, 16]`` view chooses each block's amax among the 126 fp8 e4m3 scales.
On CUDA with Triton that is one fused kernel (``nvfp4_fp8_scale_sweep``, their PR #1387);
elsewhere their reference Python sweep, which calls a fake-quant function: ModelOpt's own
(``static_blockwise_fp4_fake_quant``) exists only in Triton on CUDA, so a CPU dry run passes
one in (``quant_func``) and the result says which path ran.
"""

from __future__ import annotations

import torch

BLOCK = 16


def blocks(w: torch.Tensor) -> torch.Tensor:
    """``w`` as ModelOpt's calibrator sees a static NVFP4 weight: ``[n_blocks, 16]``."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"sweep: w's last dimension must be a multiple of {BLOCK}, "
                         f"got shape {tuple(w.shape)}")
    return w.reshape(-1, BLOCK)


def calibrator(x: torch.Tensor, quant_func=None):
    """A fresh ``NVFP4MSECalibrator`` for the blocked weight ``x`` (per-block amax kept on
    axis 0, as ModelOpt's block quantizer keeps it)."""
    from modelopt.torch.quantization.calib.mse import NVFP4MSECalibrator

    amax = x.detach().abs().amax(dim=1).float()
    return NVFP4MSECalibrator(amax=amax, global_amax=amax.max(), axis=0, quant_func=quant_func)


def path(w: torch.Tensor, quant_func=None) -> str:
    """Which of ModelOpt's sweeps ``sweep`` runs on ``w`` here."""
    x = blocks(w)
    if calibrator(x, quant_func)._can_use_triton_fast_path(x):
        return "fused Triton sweep"
    return "reference Python sweep"


def sweep(w: torch.Tensor, quant_func=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-block amax ModelOpt chooses ``[n_blocks]``, the global amax it searched under)."""
    x = blocks(w)
    cal = calibrator(x, quant_func)
    if quant_func is None and not cal._can_use_triton_fast_path(x):
        raise RuntimeError("ModelOpt's NVFP4 sweep needs CUDA and Triton here (its fake quant "
                           "is Triton-only); pass quant_func for the reference sweep")
    cal.collect(x)
    return cal.compute_amax(), cal._global_amax
