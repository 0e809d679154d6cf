"""Where ``exact_histc`` emulates torch.histc: on CUDA under deterministic algorithms alone.

torch lists ``torch.histc`` "when called on a CUDA tensor" among the ops that raise
RuntimeError under ``torch.use_deterministic_algorithms(True)`` (its docstring); the CPU's histc
is deterministic. The other tests force ``_histc_refused`` with a monkeypatch, so a mutation
round found none failing where it always said no. ``quantscope::ao_histc``'s CUDA
implementation bins through ``exact_histc``, so it takes the emulation there too.
"""

from types import SimpleNamespace

import pytest
import torch

from quantscope.stats import ao_histogram
from quantscope.stats import histogram as H


@pytest.fixture
def deterministic():
    was, warn_only = (torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn_only)


def test_histc_is_refused_on_cuda_under_deterministic_algorithms_only(deterministic):
    cuda = SimpleNamespace(device=torch.device("cuda"))  # (only its device is read)
    assert H._histc_refused(cuda)
    assert not H._histc_refused(torch.zeros(3))
    torch.use_deterministic_algorithms(False)
    assert not H._histc_refused(cuda)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_exact_histc_on_cuda_under_deterministic_algorithms(deterministic):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError):
        torch.histc(x.cuda(), 64, -3.0, 3.0)  # what the emulation stands in for
    got = H.exact_histc(x.cuda(), 64, -3.0, 3.0)
    assert torch.equal(got.cpu(), torch.histc(x, 64, -3.0, 3.0).long())


@pytest.mark.parametrize("lo, hi", [(-2.0, 3.0), (0.0, 0.0), (1.5, 1.5)])
def test_ao_histc_cuda_implementation_bins_where_histc_is_refused(monkeypatch, lo, hi):
    """``quantscope::ao_histc``'s CUDA implementation still gives torch.histc's counts where
    torch.histc raises (there: CUDA under deterministic algorithms; here: forced on the CPU),
    a degenerate span included (the data's range)."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 2
    want = torch.histc(x, 16, lo, hi)
    monkeypatch.setattr(H, "_histc_refused", lambda t: True)

    def refused(*a, **k):
        raise RuntimeError("histc_cuda does not have a deterministic implementation")
    monkeypatch.setattr(torch, "histc", refused)
    got = ao_histogram._cuda_histc(x, 16, lo, hi)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ao_histc_on_cuda_under_deterministic_algorithms(deterministic):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    got = ao_histogram.ao_histc(x.cuda(), 64, -3.0, 3.0)
    assert torch.equal(got.cpu(), torch.histc(x, 64, -3.0, 3.0))
