"""Every native observer on the torch path (what runs on CUDA): forward reads nothing back to
the host, and the qparams equal those of the CPU path, kernels included.

On a machine with CUDA the ``cuda`` cases run the observers on the device; elsewhere they
skip, and the ``cpu-torch`` cases check the same torch path on CPU with every C kernel
off (the code CUDA tensors take: the kernels only accept CPU tensors).
"""

import pytest
import torch

import quantscope
from quantscope import QuantSpec, kernels, presets
from quantscope.layout import Channel, Group

NATIVE = [n for n in quantscope.list_observers() if ":" not in n]
SPECS = {"int8-channel": QuantSpec("int8", Channel(0)),
         "int4-g32-asym": QuantSpec("int4", Group(32), symmetric=False),
         "nvfp4": presets.NVFP4}
# observers for one kind of format only
ONLY = {"fouroversix": {"nvfp4"}, "nvfp4_expanded_mse": {"nvfp4"}}


def _cases():
    for name in NATIVE:
        for sid in SPECS:
            if sid not in ONLY.get(name, SPECS):
                continue
            yield name, sid


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 64, generator=g) * (1 + i) for i in range(2)]


def _observe(name, spec, device, sync_guard=None):
    try:
        obs = quantscope.get_observer(name, spec)
    except (ValueError, TypeError) as e:  # a layout / format the observer does not take
        pytest.skip(f"{name} does not take {spec}: {e}")
    obs.to(device)
    xs = [x.to(device) for x in _batches()]
    if sync_guard is not None:
        sync_guard()
    for x in xs:
        obs(x)
    return obs


@pytest.mark.parametrize("device", ["meta", "cuda"])
@pytest.mark.parametrize(("name", "sid"), list(_cases()))
def test_forward_off_cpu_has_no_host_sync(name, sid, device, forbid_host_sync, monkeypatch):
    """On CUDA the observers take their device branches (no CPU-only early stops) and the
    torch path; so they do on the meta device, where any read of data fails in torch."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if device == "meta" and sid == "nvfp4" and ("mse" in name or name == "fouroversix"):
        pytest.skip("the NVFP4 searches run thousands of ops: minutes on meta (CUDA only)")
    spec = SPECS[sid]
    obs = _observe(name, spec, device, forbid_host_sync)
    monkeypatch.undo()  # calculate_qparams may read back (once, not per batch)
    if device == "cuda":
        qp = obs.calculate_qparams()
        assert qp.scale.is_cuda
        ref = _observe(name, spec, "cpu").calculate_qparams()  # kernels where they apply
        assert torch.equal(qp.scale.cpu(), ref.scale)
        assert torch.equal(qp.zero_point.cpu(), ref.zero_point)


@pytest.mark.parametrize(("name", "sid"), list(_cases()))
def test_torch_path_equals_the_kernel_path(name, sid):
    """Every kernel off (the code CUDA tensors run): the same qparams on CPU."""
    spec = SPECS[sid]
    saved = kernels._libs
    kernels._libs = dict.fromkeys(kernels.SIGNATURES)
    try:
        qp = _observe(name, spec, "cpu").calculate_qparams()
    finally:
        kernels._libs = saved
    ref = _observe(name, spec, "cpu").calculate_qparams()
    assert torch.equal(qp.scale, ref.scale) and torch.equal(qp.zero_point, ref.zero_point)


@pytest.mark.parametrize("device", ["meta", "cuda"])
@pytest.mark.parametrize("non_finite", ["error", "ignore"])
@pytest.mark.parametrize("name", ["minmax", "static_minmax", "memoryless_minmax"])
def test_min_max_observers_off_cpu_keep_no_scratch_pair(name, non_finite, device):
    """Off the CPU the min / max ops make their own per-unit pair (the scratch pair is the C
    kernels' and torch's CPU out= memory): no call keeps one, the first nor a fused update
    (``non_finite="ignore"`` takes the general path there). Each was the state's size again,
    kept for the observer's life and never written."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    obs = quantscope.get_observer(name, QuantSpec("int8", Channel(0)), non_finite=non_finite)
    obs.to(device)
    for x in _batches() * 2:
        obs(x.to(device))
        assert "_scratch" not in obs.__dict__
    assert obs.min_vals.shape == (16,) and obs.min_vals.device.type == device
