"""The estimators' and qparams' own C paths read only tensors with memory (kernels.real):
fakes passed to them directly (outside any mode) take the torch path, where torch's own
fake-tensor rules answer with a Python error, never a crash of the process. The cases run
in a child process (one for all: it names each case before running it, so a crash names the
case): the old code died of SIGSEGV reading a fake's null data pointer."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from quantscope import estimators, kernels
from quantscope.stats.histogram import Hist

_CHILD = textwrap.dedent("""
    import sys, torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from quantscope import estimators, presets
    from quantscope.qparams import qparams_from_range
    from quantscope.stats.histogram import Hist
    fake = FakeTensorMode().from_tensor
    g = torch.Generator().manual_seed(0)
    lo, hi = -torch.rand(64, generator=g), torch.rand(64, generator=g)
    counts = torch.randint(0, 100, (64, 2048), generator=g)
    hist = Hist(fake(counts), fake(lo), fake(hi))
    for case, name in zip(sys.argv[1::2], sys.argv[2::2]):
        spec = presets.get(name)
        calls = {
            "qparams": lambda: qparams_from_range(fake(lo), fake(hi), spec, check_finite=False),
            "l2": lambda: estimators.l2_range(hist),
            "error": lambda: estimators.histogram_error(hist, fake(lo[:, None]),
                                                        fake(hi[:, None]), spec),
            "entropy": lambda: estimators.entropy_range(hist),
        }
        print(case, name, end=": ", flush=True)
        try:
            calls[case]()
            print("returned", flush=True)
        except (AssertionError, RuntimeError, ValueError) as e:  # torch's fake-tensor rules
            print(type(e).__name__, flush=True)
""")


CASES = [("qparams", "int8"), ("qparams", "mxfp4"), ("qparams", "nvfp4"), ("l2", "int8"),
         ("error", "int8"), ("entropy", "int8")]


@pytest.mark.skipif(not kernels.available("int_qparams"), reason="no C kernels")
def test_fakes_given_directly_never_crash_the_process():
    run = subprocess.run([sys.executable, "-c", _CHILD, *(a for case in CASES for a in case)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-2000:]}"  # the last case crashed
    assert len(run.stdout.splitlines()) == len(CASES), run.stdout  # each case ran to its end


def test_choose_refuses_a_forced_kernel_on_fakes_and_says_why():
    fake = FakeTensorMode().from_tensor(torch.zeros(4, 8, dtype=torch.int64))
    hist = Hist(fake, torch.zeros(4), torch.ones(4))
    with pytest.raises(ValueError, match="cannot run while tracing"):
        estimators.l2_range(hist, backend="kernel")
    assert kernels.choose(None, "l2_walk", "test", True, (torch.zeros(2),)) is not None \
        or not kernels.available("l2_walk")
    assert kernels.choose(None, "l2_walk", "test", True, (fake,)) is None
