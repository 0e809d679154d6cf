"""Where a model's weights are. quantscope observes, fake-quantizes and exports whole tensors
held in memory; two placements hold less, and are refused up front, naming the parameter:

* a **DTensor** (FSDP2's ``fully_shard``, tensor parallelism): each rank holds a shard, and
  a tensor-parallel layer's hooks see each rank's slice of its activations, so every range
  would be one rank's. Calibrate the whole model on each rank with
  ``Runtime(distributed=True)`` instead (batches, not tensors, are split).
* the **meta device** (a skeleton, or accelerate's offload: ``device_map`` with CPU / disk
  offload, ``cpu_offload``, where a weight is loaded only inside its module's forward):
  there is no data to observe or quantize. A skeleton calibrates block by block from its
  checkpoint (``sequential=Sequential(checkpoint=folder)``, which loads each block itself);
  an offloaded model is loaded without offload, or calibrated the same way from its folder.
"""

from __future__ import annotations

from torch import nn

from ...observers.base import is_dtensor

__all__ = ["check_placement"]

_SEQUENTIAL = ("calibrate it block by block from its checkpoint: calibrate(empty_model(folder), "
               "..., sequential=Sequential(checkpoint=folder))")


def check_placement(model: nn.Module, who: str, *, calibrating: bool = False,
                    skeleton: bool = False) -> None:
    """Raise ``ValueError`` naming the first parameter or buffer of ``model`` that is a
    DTensor or lies on the meta device (``calibrating``: the error suggests a sequential
    calibration). ``skeleton``: meta tensors are expected (a sequential calibration loads
    them), but not under accelerate's offload hooks, which would move the loaded weights
    back to the meta device after each forward."""
    also = f", or {_SEQUENTIAL}" if calibrating or skeleton else ""
    for prefix, module in model.named_modules():
        offloaded = hasattr(module, "_hf_hook")  # accelerate's hook on a dispatched model
        for name, t in [*module.named_parameters(recurse=False),
                        *module.named_buffers(recurse=False)]:
            full = f"{prefix}.{name}" if prefix else name
            if is_dtensor(t):
                raise ValueError(
                    f"{who}: {full!r} is a DTensor sharded across ranks ({t.placements}, by "
                    f"FSDP2 or tensor parallelism): quantscope works on whole tensors; load the "
                    f"whole model on each rank (calibrate's Runtime(distributed=True) splits "
                    f"the batches instead: docs/guide/distributed.md)")
            if t.device.type != "meta" or (skeleton and not offloaded):
                continue
            if offloaded:
                raise ValueError(
                    f"{who}: {full!r} is offloaded by accelerate (device_map with CPU / disk "
                    f"offload, cpu_offload: on the meta device between forwards); load the "
                    f"model without offload{also}")
            raise ValueError(f"{who}: {full!r} is on the meta device (no data); load the "
                             f"weights{also}")
