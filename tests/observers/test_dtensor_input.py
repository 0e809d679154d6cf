"""An observer fed a ``torch.distributed.tensor.DTensor`` (an FSDP2 / tensor-parallel weight)
raises a ``TypeError`` naming the observer and the two ways out (``x.full_tensor()``,
``x.to_local()``), whatever its family or placement, instead of one shard's statistics or an
error from deep inside (``aten.copy_.default got mixed torch.Tensor and DTensor``, a bare
``AssertionError``). A DTensor needs a process group: one of world size 1 (gloo, a file
rendezvous) in this process."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import quantscope
from quantscope.compat import horizon as hz
from quantscope.compat import llmcompressor_legacy as legacy
from quantscope.compat import quark
from quantscope.observers import observe_many

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is absent")

INT8 = quantscope.QuantSpec("int8", "tensor")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    rendezvous = tmp_path_factory.mktemp("pg") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _dtensor(mesh, placement):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    p = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}[placement]
    return distribute_tensor(torch.randn(8, 256, generator=torch.Generator().manual_seed(0)),
                             mesh, [p])


OBSERVERS = {
    "static_minmax": lambda: quantscope.get_observer("static_minmax", INT8),
    "memoryless_minmax": lambda: quantscope.get_observer("memoryless_minmax", INT8),
    "minmax": lambda: quantscope.get_observer("minmax", INT8),
    "mse": lambda: quantscope.get_observer("mse", INT8),
    "percentile": lambda: quantscope.get_observer("percentile", INT8),
    "histogram": lambda: quantscope.get_observer("histogram", INT8),
    "quark": lambda: quark.PerTensorMinMaxObserver({"dtype": "int8"}),
    "llmcompressor_legacy": lambda: legacy.Observer.load_from_registry(
        "minmax", base_name="weight", args={"num_bits": 8, "type": "int", "symmetric": True}),
    "horizon": lambda: hz.MinMaxObserver(),
}


def _refusal(obs, placement: str) -> str:
    shown = {"shard0": r"Shard\(dim=0\)", "shard1": r"Shard\(dim=1\)",
             "replicate": r"Replicate\(\)"}[placement]
    return (rf"^{type(obs).__name__}\({obs.name!r}, .*\): got a DTensor \(placements "
            rf"\({shown},\)\).* x\.full_tensor\(\) .* x\.to_local\(\)")


@pytest.mark.parametrize("placement", ["shard0", "shard1", "replicate"])
@pytest.mark.parametrize("name", sorted(OBSERVERS))
def test_a_dtensor_is_refused_with_the_observers_name(mesh, name, placement):
    obs = OBSERVERS[name]()
    x = _dtensor(mesh, placement)
    with pytest.raises(TypeError, match=_refusal(obs, placement)):
        obs(x)
    assert not obs.has_observed  # refused before anything was recorded


def test_the_suggested_full_tensor_gives_the_plain_tensors_qparams(mesh):
    x = _dtensor(mesh, "shard0")
    obs, ref = (quantscope.get_observer("static_minmax", INT8) for _ in range(2))
    obs(x.full_tensor())
    ref(torch.randn(8, 256, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(obs.calculate_qparams().scale, ref.calculate_qparams().scale)


def test_observe_many_refuses_a_dtensor_pair(mesh):
    obs = quantscope.get_observer("memoryless_minmax", INT8)
    with pytest.raises(TypeError, match=_refusal(obs, "shard0")):
        observe_many([(obs, _dtensor(mesh, "shard0"))])


def test_the_check_never_imports_the_dtensor_module(monkeypatch):
    # no DTensor exists before its module is imported: the check looks it up, never loads it
    monkeypatch.delitem(sys.modules, "torch.distributed.tensor", raising=False)
    obs = quantscope.get_observer("static_minmax", INT8)
    obs(torch.nn.Parameter(torch.randn(4, 8)))  # not a plain Tensor: past the fast path
    assert "torch.distributed.tensor" not in sys.modules
    assert obs.has_observed


def test_torch_ao_histogram_refuses_a_dtensor(mesh):
    """The torch.ao compat histogram's kernels read a tensor's memory: a DTensor's is its local
    shard, read as the whole (the process died of a segfault)."""
    from quantscope.compat import torch_ao

    obs = torch_ao.HistogramObserver()
    with pytest.raises(TypeError, match=r"^HistogramObserver: got a DTensor .*full_tensor"):
        obs(_dtensor(mesh, "shard0"))
    assert int(obs.histogram.sum()) == 0
