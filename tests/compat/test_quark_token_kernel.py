"""compat.quark's token count by the C kernel (``qs_nonzero_rows``, csrc/unit_minmax.c): Quark's
``(x != 0).any(-1).sum()`` on every row layout the kernel's pieces of 64 values cut (a value
first found in any piece, at its edges, in a short tail), NaN, inf, -0.0 and subnormals
(denormals flushed too: as torch's compare reads them), float32 / bf16 / fp16 / float64, and
each input it does not read (strided, negative views, other dtypes, a FakeTensor outside its
mode) counted by the paths before it; a row read only up to its first value. The code before
counted with numpy (float32 / float64 / small fp16) or torch: 4-40 us a batch where the kernel
takes 2-3 (8 x 64 to 256 x 1024, one thread). No Quark needed."""

from __future__ import annotations

import pytest
import torch
from op_names import OpNames

from quantscope import kernels
from quantscope.compat.quark_scales import quark_token_count

pytestmark = pytest.mark.skipif(not kernels.available("unit_minmax"), reason="no kernel")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _quarks(x):
    return int(x.ne(0).any(-1).sum())


def _placed(dtype, cols: int) -> torch.Tensor:
    """One row per position of a single value (the rest zeros, a -0.0 among them), several
    kinds of value, plus all-zero and all -0.0 rows."""
    tiny = torch.finfo(dtype).smallest_normal / 4  # a subnormal (fp16: a normal float32)
    values = [1.0, -3.0, float("nan"), float("inf"), float("-inf"), tiny, -tiny]
    rows = []
    for at in sorted({0, 1, 7, 8, 63, 64, 65, 127, 128, cols - 1} & set(range(cols))):
        for v in values:
            row = torch.zeros(cols, dtype=dtype)
            row[cols // 2] = -0.0
            row[at] = v
            rows.append(row)
    rows += [torch.zeros(cols, dtype=dtype), torch.full((cols,), -0.0, dtype=dtype)]
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", [1, 5, 8, 63, 64, 65, 130, 200])
@pytest.mark.parametrize("flush", [False, True], ids=["denormals", "flushed"])
def test_every_position_and_value(dtype, cols, flush):
    x = _placed(dtype, cols)
    torch.set_flush_denormal(flush)
    try:
        got, want = quark_token_count(x), _quarks(x)
    finally:
        torch.set_flush_denormal(False)
    assert isinstance(got, int) and got == want


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_leading_dims_are_rows(dtype):
    x = _placed(dtype, 70)[:57].reshape(-1, 3, 70)  # (19, 3, 70)
    assert quark_token_count(x) == _quarks(x)


def test_no_tensor_op():
    x = torch.randn(64, 256)
    with OpNames() as mode:
        got = quark_token_count(x)
    assert got == 64 and mode.order == []


@pytest.mark.parametrize("make", [
    lambda x: x.t(),  # strided: numpy's or torch's count
    lambda x: torch._neg_view(x),  # its memory holds -x (the same zeros: torch counts)
    lambda x: x.to(torch.float8_e4m3fn),  # no kernel dtype
    lambda x: x[:, ::2],
])
def test_inputs_the_kernel_does_not_read(make):
    x = make(_placed(torch.float32, 70))
    assert int(quark_token_count(x)) == _quarks(x.float() if x.element_size() == 1 else x)


def test_a_fake_tensor_outside_its_mode_gets_the_fake_count():
    """A FakeTensor used after its FakeTensorMode exited (kernels.lib is not None there) has
    no values in its memory: the kernel does not read it, torch's path gives a 0-dim count."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        fake = torch.randn(8, 64)
    got = quark_token_count(fake)
    assert isinstance(got, FakeTensor) and got.dim() == 0


_FIRST_PIECE_ONLY = r"""
import ctypes, mmap, torch
from quantscope.compat.quark_scales import quark_token_count
PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    m = mmap.mmap(-1, 2 * PAGE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    x = torch.frombuffer(m, dtype=dtype)
    x.zero_()
    x[0] = 1.0  # the row's first piece holds a value
    assert libc.mprotect(x.data_ptr() + PAGE, PAGE, 0) == 0  # the rest unreadable
    print(quark_token_count(x.view(1, -1)))
"""


def test_a_row_is_read_up_to_its_first_value():
    """The kernel's speed contract (a few ns on most rows): a row whose first piece of 64
    values holds a value is not read further. Its second page is made unreadable (PROT_NONE):
    a kernel reading on faults. In a child process, so that a fault fails only this test."""
    import os
    import subprocess
    import sys

    if not hasattr(__import__("mmap"), "PROT_READ"):
        pytest.skip("no mmap protections here")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))  # this quantscope
    run = subprocess.run([sys.executable, "-c", _FIRST_PIECE_ONLY], capture_output=True,
                         text=True, timeout=120, check=False, env=env)
    assert run.returncode == 0 and run.stdout.split() == ["1"] * 4, run.stderr[-1500:]
