"""The plugin's histogram observers reduce llm-compressor's assigned ``min_vals`` /
``max_vals`` across DDP ranks as their plan says (MIN / MAX): ``_reduce_ops`` read only dict
plans, and a histogram's ``sync_plan`` is a list of ``(buffer, Op)`` pairs and its custom
sync, so every rank kept its own range and wrote its own qparams. Runs in the peers' venv."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.peers

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs
from llmcompressor.observers import Observer

import quantscope.integrations.llmcompressor  # noqa: F401  (registers quantscope_<name>)

torch.set_num_threads(1)


@pytest.mark.parametrize("name", ["quantscope_histogram", "quantscope_percentile"])
def test_assigned_statistics_of_a_histogram_observer_are_reduced(name, monkeypatch):
    """Assigned statistics are what ``sync_activation_stats`` reduces (module doc); the
    histogram observers' plan reduces ``min_vals`` by MIN and ``max_vals`` by MAX."""
    calls = []
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda t, op, async_op: calls.append(op))
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor")
    obs = Observer.load_from_registry(name, base_name="input", args=args)
    obs.min_vals, obs.max_vals = torch.tensor([-3.0]), torch.tensor([4.0])
    obs.sync_activation_stats()
    assert calls == [torch.distributed.ReduceOp.MIN, torch.distributed.ReduceOp.MAX]
