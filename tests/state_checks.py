"""How the cached-step tests hold an observer's state to its general-path twin's: the
buffers, name for name, bit for bit."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers (so -0.0 is not 0.0, and NaN equals its own bits)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_buffers(a, b, versions: bool = True) -> None:
    """``a``'s buffers are ``b``'s: the same names, shapes, dtypes, values (NaN where NaN,
    floats bit for bit), inference-ness and, with ``versions``, in-place versions (an
    inference tensor keeps none)."""
    assert set(a._buffers) == set(b._buffers)
    for name, buf in a._buffers.items():
        other = b._buffers[name]
        assert buf.shape == other.shape and buf.dtype == other.dtype, name
        assert torch.equal(buf, other) or bool(((buf == other) | buf.isnan() & other.isnan())
                                                .all()), name
        if buf.is_floating_point():
            assert torch.equal(bits(buf), bits(other)), name
        assert buf.is_inference() == other.is_inference(), name
        if versions and not buf.is_inference():
            assert buf._version == other._version, (name, buf._version, other._version)
