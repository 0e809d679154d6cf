"""Pins found by a mutation round (s67) on four parts of calibrate's pass, each called
directly on tiny inputs: the rows watched for a run-time role's NaN / inf and the flag read
of a large tensor (``run.non_finite``), the weights restored on any interrupt and the
smoothing each result keeps (``run.outliers``), the sample's memory plan, a promotion within
a batch's share and a sample made of given rows (``run.samples``), and sequential
calibration's spill cache, spill folder and SIGTERM guard (``run.seq_cache``)."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch
from test_run_parts_pins_s64 import _slot
from tiny_models import llama

from quantscope.calibration.options import Outliers, Runtime
from quantscope.calibration.run import non_finite, outliers
from quantscope.calibration.run.samples import PLANNED_ITEMSIZE, Capacity, RowSample, capacities
from quantscope.calibration.run.seq_cache import Cache, Contexts, sigterm_unwinds, spill_folder
from quantscope.stats.minmax import KERNEL_MIN_NUMEL


def _gen():
    return torch.Generator().manual_seed(0)


# --- non_finite -------------------------------------------------------------------------


def test_a_runtime_row_names_the_layer_of_its_check_not_the_slots():
    """``runtime_check`` is ``(layer, observer)``: the error names that layer."""
    slot = _slot({}, runtime_check=("model.q_proj", "rt"))
    (row,) = non_finite.watched([slot])
    assert (row.layer, row.role, row.observer, row.runtime) == ("model.q_proj", "input", "rt",
                                                                 True)
    assert row.holder is slot


@pytest.mark.parametrize("at", [0, KERNEL_MIN_NUMEL])
def test_flag_tensor_reads_every_element_of_a_large_float32_tensor(at):
    slot = SimpleNamespace(seen_non_finite=torch.zeros((), dtype=torch.bool))
    x = torch.ones(KERNEL_MIN_NUMEL + 1)
    x[at] = float("nan")
    non_finite.flag_tensor(x, slot)
    assert slot.seen_non_finite


# --- outliers ---------------------------------------------------------------------------


def _results(_batches):
    return {"a": SimpleNamespace(info={}), "b": SimpleNamespace(info={})}


def test_a_keyboard_interrupt_in_the_run_leaves_the_weights_unsmoothed():
    model, batches = llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def interrupted(_):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        outliers.around(model, batches, interrupted, Outliers(smooth=0.5), Runtime())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_each_result_keeps_its_own_smoothing_and_info_without_the_scales():
    """``smooth`` alone (no ``keep_float``) smooths; ``Calibration.smoothing`` holds the
    scales, ``info["smooth"]`` the alpha and the modules, each result a dict of its own."""
    model, batches = llama()
    out = outliers.around(model, batches[:1], _results, Outliers(smooth=0.5), Runtime())
    a, b = out["a"], out["b"]
    assert a.smoothing and a.smoothing == b.smoothing and a.smoothing is not b.smoothing
    assert a.info["smooth"]["alpha"] == 0.5 and a.info["smooth"]["smoothed"]
    assert "scales" not in a.info["smooth"] and a.info["smooth"] is not b.info["smooth"]


# --- samples ----------------------------------------------------------------------------


def test_capacities_refuse_zero_rows_or_zero_bytes_and_plan_no_keys_as_nothing():
    with pytest.raises(ValueError, match="must be positive"):
        capacities({"a": 4}, 0, 100)
    with pytest.raises(ValueError, match="must be positive"):
        capacities({"a": 4}, 10, 0)
    assert capacities({}, 10, 100) == {}


def test_capacities_plan_with_the_given_itemsize():
    """400 bytes of 10 values of 2 bytes: 20 rows, their 400 bytes as the budget."""
    caps = capacities({"a": 10}, 1000, 400, itemsize=2)
    assert caps == {"a": 20} and caps["a"].budget == 400
    assert capacities({"a": 10}, 1000, 400)["a"] == 400 // (10 * PLANNED_ITEMSIZE)


def test_a_promotion_within_a_share_keeps_only_the_rows_its_budget_holds():
    """8 float32 rows of 4 in 128 bytes; float64 arriving with a share of 4 more rows keeps
    4 in all."""
    s = RowSample(Capacity(8, 128), 4, _gen())
    s.add(torch.arange(40.0).reshape(10, 4))  # 2 rows
    s.add(torch.ones(0, 4))  # its share passes on
    s.add(torch.full((10, 4), -1.0, dtype=torch.float64))
    rows = s.rows()
    assert s.count == 4 and rows.shape == (4, 4) and rows.dtype == torch.float64
    assert (rows[:2] >= 0).all() and (rows[2:] == -1).all()


def test_holding_keeps_every_row_given():
    rows = torch.arange(6.0).reshape(3, 2)
    s = RowSample.holding(rows)
    assert s.count == 3 and torch.equal(s.rows(), rows)


# --- seq_cache --------------------------------------------------------------------------


def test_the_cache_keeps_no_autograd_graph(tmp_path):
    cache = Cache([10**6], str(tmp_path), "h")
    x = torch.ones(3, requires_grad=True)
    cache.put(0, {"h": x * 2})
    assert not cache.get(0)["h"].requires_grad


def test_contexts_clear_forgets_the_templates(tmp_path):
    ctx = Contexts(Cache([10**6], str(tmp_path), "c"))
    ctx.templates[0] = ((), {})
    ctx.clear()
    assert ctx.templates == {}


def test_spill_folder_names_the_folder_it_could_not_make_in(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"Sequential\.cache_dir .*file'"):
        spill_folder(blocker)
    monkeypatch.setattr("tempfile.tempdir", str(blocker))
    with pytest.raises(ValueError, match="the system's temporary folder"):
        spill_folder(None)
    made = spill_folder(tmp_path)
    assert os.path.isdir(made) and os.path.basename(made).startswith("quantscope-seq-")


def test_sigterm_unwinds_leaves_a_handler_of_the_programs_own_in_place():
    def own(signum, frame):
        pass
    before = signal.signal(signal.SIGTERM, own)
    try:
        with sigterm_unwinds() as state:
            assert signal.getsignal(signal.SIGTERM) is own
        assert signal.getsignal(signal.SIGTERM) is own and not state.fired
    finally:
        signal.signal(signal.SIGTERM, before)
