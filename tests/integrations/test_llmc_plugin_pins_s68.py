"""Pins of the llm-compressor plugin (``quantscope.integrations.llmcompressor``) from mutation
round s68: a range read never written in place by a later batch, the DDP reduction of
assigned statistics as llm-compressor's own observers reduce them, the global amax the
imatrix fallback reports to the NVFP4 fusion group, and a float16 searched global amax past
65504 reported finite. Runs in the peers' venv."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.peers

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs
from llmcompressor.observers import Observer

import quantscope
import quantscope.integrations.llmcompressor as qsl

torch.set_num_threads(1)

TENSOR_INPUT = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"}
NVFP4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
         "group_size": 16, "scale_dtype": torch.float8_e4m3fn, "zp_dtype": torch.float8_e4m3fn}


def test_a_range_read_is_not_written_in_place_by_a_later_batch():
    """A ``max_vals`` read stays what it was when read (module doc: a read is never written
    in place afterwards) while the running range grows with a wider batch."""
    obs = Observer.load_from_registry("quantscope_static_minmax", base_name="input",
                                      args=QuantizationArgs(**TENSOR_INPUT))
    obs(torch.tensor([[[-1.0, 2.0]]]))
    lo, hi = obs.min_vals, obs.max_vals
    obs(torch.tensor([[[-5.0, 7.0]]]))
    assert lo.tolist() == [-1.0] and hi.tolist() == [2.0]
    assert obs.min_vals.tolist() == [-5.0] and obs.max_vals.tolist() == [7.0]


@pytest.mark.parametrize("name", ["static_minmax", "minmax"])
def test_assigned_statistics_are_reduced_as_llmcompressors_own(name, monkeypatch):
    """Assigned ``min_vals`` / ``max_vals`` go through llm-compressor's all-reduce with the
    ops its own observer of that name uses (static: MIN / MAX; moving average: AVG)."""
    calls = []
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda t, op, async_op: calls.append((t.clone(), op)))
    args = QuantizationArgs(**TENSOR_INPUT)
    theirs = Observer.load_from_registry(name, base_name="input", args=args)
    mine = Observer.load_from_registry(f"quantscope_{name}", base_name="input", args=args)
    mine.min_vals, mine.max_vals = torch.tensor([-3.0]), torch.tensor([4.0])
    mine.sync_activation_stats()
    want = [theirs._act_sync_dict["min_vals"], theirs._act_sync_dict["max_vals"]]
    assert [op for _, op in calls] == want
    assert [t.item() for t, _ in calls] == [-3.0, 4.0]


def test_imatrix_fallback_reports_the_global_amax_it_searched_under():
    """Without importance ``quantscope_imatrix_mse`` runs ``quantscope_memoryless_mse``'s
    search; on NVFP4 its statistics report that search's global amax (module doc: the amax
    the ranges were chosen under) as ``global_amax`` and as ``-amax`` / ``amax``."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 64, generator=g)
    args = QuantizationArgs(**NVFP4, observer_kwargs={"grid": 20, "maxshrink": 0.5})
    obs = Observer.load_from_registry("quantscope_imatrix_mse", base_name="weight",
                                      args=args.model_copy())
    with pytest.warns(UserWarning, match="Falling back to uniform MSE"):
        obs(w)
    options = {k: v for k, v in obs._uniform_options.items() if v is not None}
    native = quantscope.get_observer("memoryless_mse", qsl.units_spec(args, "weight"), **options)
    native(w.reshape(-1, 16))
    amax = native.global_amax().reshape(())
    stats = obs.get_statistics()
    assert torch.equal(stats["global_amax"], amax)
    assert torch.equal(stats["max_vals"], amax) and torch.equal(stats["min_vals"], -amax)


@pytest.mark.parametrize("seed", [0, 2])
def test_a_float16_searched_amax_past_65504_is_reported_finite(seed):
    """The NVFP4 MSE search's global amax may exceed a float16 weight's absmax (65504 here);
    it is reported in float16 where float16 holds it, else in float32 (module doc: inf
    there gave a global scale of 0), so the global scale is finite and positive."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 64, generator=g)
    w = (w / w.abs().max() * 65504).half()
    obs = Observer.load_from_registry("quantscope_mse", base_name="weight",
                                      args=QuantizationArgs(**NVFP4))
    obs(w)
    amax = obs.quantscope.global_amax().reshape(()).float()
    got = obs.get_statistics()["global_amax"]
    assert torch.isfinite(got) and got.float() == amax
    assert got.dtype == (torch.float16 if amax <= 65504 else torch.float32)
    scale = obs.get_global_scale()
    assert torch.isfinite(scale).all() and (scale > 0).all()
