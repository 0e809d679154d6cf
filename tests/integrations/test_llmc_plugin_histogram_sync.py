"""The plugin's histogram observers reduce llm-compressor's assigned ``min_vals`` /
``max_vals`` across DDP ranks as their plan says (MIN / MAX): ``_reduce_ops`` read only dict
plans, and a histogram's ``sync_plan`` is a list of ``(buffer, Op)`` pairs and its custom
sync, so every rank kept its own range and wrote its own qparams. The memoryless observers
reduce too, where llm-compressor's own do not (a choice). Runs in the peers' venv."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.peers

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs
from llmcompressor.observers import Observer

import quantscope.integrations.llmcompressor  # noqa: F401  (registers quantscope_<name>)

torch.set_num_threads(1)


MIN, MAX, AVG = (torch.distributed.ReduceOp.MIN, torch.distributed.ReduceOp.MAX,
                 torch.distributed.ReduceOp.AVG)
ARGS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"}


def _reduce_ops(name, monkeypatch) -> list:
    """The ops ``sync_activation_stats`` all-reduces assigned ``min_vals`` / ``max_vals`` with."""
    calls = []
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda t, op, async_op: calls.append(op))
    obs = Observer.load_from_registry(name, base_name="input", args=QuantizationArgs(**ARGS))
    obs.min_vals, obs.max_vals = torch.tensor([-3.0]), torch.tensor([4.0])
    obs.sync_activation_stats()
    return calls


@pytest.mark.parametrize("name", ["quantscope_histogram", "quantscope_percentile"])
def test_assigned_statistics_of_a_histogram_observer_are_reduced(name, monkeypatch):
    """Assigned statistics are what ``sync_activation_stats`` reduces (module doc); the
    histogram observers' plan reduces ``min_vals`` by MIN and ``max_vals`` by MAX."""
    assert _reduce_ops(name, monkeypatch) == [MIN, MAX]


@pytest.mark.parametrize("name, ops", [("memoryless_minmax", [MIN, MAX]),
                                       ("memoryless_mse", [AVG, AVG]),
                                       ("nvfp4_expanded_mse", [AVG, AVG])])
def test_memoryless_observers_reduce_where_llmcompressors_keep_each_ranks_range(
        name, ops, monkeypatch):
    """docs/guide/pipelines.md (a choice): llm-compressor's memoryless observers all-reduce
    nothing, so each rank keeps its own range; quantscope's reduce by their ``sync_plan``
    (min-max by MIN / MAX, the MSE searches by AVG), so every rank holds the same qparams."""
    assert _reduce_ops(name, monkeypatch) == []
    assert _reduce_ops(f"quantscope_{name}", monkeypatch) == ops
