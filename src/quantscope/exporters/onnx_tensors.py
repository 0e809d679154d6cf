"""Integer initializers of the ONNX export, stored as ONNX stores them on disk: little-endian
``raw_data``, one byte per int8 / uint8 code, two bytes per int16 / uint16 code, two int4 /
uint4 codes per byte (the first in the low nibble, the ONNX spec's packing). ``make_tensor``
with a Python list writes ``int32_data`` varints instead: 5.5 bytes per int8 weight code on
average (a negative code takes 10), an "int8" model larger than its float32 one."""

from __future__ import annotations

import numpy as np
import torch

# ONNX integer type -> the numpy type of its codes; the 4-bit types are packed by hand
# (numpy has no int4; onnx's own int4 arrays need ml_dtypes, missing before onnx 1.18)
_NUMPY = {"INT8": np.int8, "UINT8": np.uint8, "INT16": np.int16, "UINT16": np.uint16}
_NIBBLES = ("INT4", "UINT4")


def code_tensor(name: str, dtype: int, codes: torch.Tensor):
    """An ``onnx.TensorProto`` of integer ``codes`` (any integer torch dtype, values already
    in ``dtype``'s range) in ``raw_data``, shaped as ``codes``."""
    from onnx import TensorProto, helper

    kind = TensorProto.DataType.Name(dtype)
    flat = codes.detach().cpu().contiguous().reshape(-1).to(torch.int32).numpy()
    if kind in _NIBBLES:
        raw = pack_nibbles(flat)
    elif kind in _NUMPY:
        raw = flat.astype(np.dtype(_NUMPY[kind]).newbyteorder("<")).tobytes()
    else:
        raise ValueError(f"onnx export: {name}: no integer storage for ONNX type {kind} "
                         f"(expected one of {[*_NIBBLES, *_NUMPY]})")
    return helper.make_tensor(name, dtype, list(codes.shape), raw, raw=True)


def pack_nibbles(flat: np.ndarray) -> bytes:
    """4-bit codes two per byte, element ``2i`` in the low nibble of byte ``i`` (an odd count
    leaves the last high nibble 0); signed codes as their two's complement nibble."""
    nib = (flat.astype(np.int64) & 0xF).astype(np.uint8)
    if nib.size % 2:
        nib = np.append(nib, np.uint8(0))
    return (nib[0::2] | (nib[1::2] << 4)).tobytes()
