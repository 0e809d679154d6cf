"""Pins found by a mutation round (s68) on the distributed pass, the transformers loader and
the ``imatrix_mse`` roles. A distributed calibration on a world of threads (the ``ranks``
fixture) names the global index of a bad batch, keeps the report rows on rank 0 only, samples
for ``auto`` the rows and the budget of one process, reports the experts' global token
counts and weighs weight-only ``imatrix_mse`` roles with every rank's inputs; the remote-code
guard of the tokenizer reads no model config and refuses non-string model types and configs
that are no JSON object; a config transformers cannot read is an error naming it;
``model_class`` takes the first class named; only the waiting ``imatrix_mse`` observers are
held for the sync, marked unweighted or given their importance along the input dim."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Auto, Runtime, Sampling
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.calibration.run import hf_loader, imatrix_roles
from quantscope.calibration.run.observe import observer_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from test_sync_pins_s64 import _ok, ranks  # noqa: F401 -- ranks: the fixture

DIST = Runtime(distributed=True)
TENSOR_AUTO = Auto(candidates=("minmax", "mse"), metric="tensor")  # decides on the samples


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _xs(n=4):
    return [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(n)]


# ---- dist_pass: a world of threads ---------------------------------------------------------------

@pytest.mark.parametrize("bad", [2, 3])
def test_a_bad_batch_is_named_by_its_index_in_every_ranks_list(ranks, bad):  # noqa: F811
    """Rank ``r`` runs batches ``r, r + 2, ...``: the NaN of batch ``bad`` is named ``bad``
    (the one process's count) on both ranks, not its index in the rank's own shard."""
    w, model, xs = ranks(2), _mlp(), _xs()
    xs[bad][1, 2] = float("nan")

    def run(r):
        quantscope.calibrate(copy.deepcopy(model), xs, "w8a8", progress=False, runtime=DIST)
    errors = w.run(run)
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert all(f"calibration batch {bad} (counting from 0)" in str(e) for e in errors), errors


def test_without_auto_the_activation_rows_are_rank_0s_own_sample(ranks):  # noqa: F811
    """The report rows of the inputs come from rank 0's own batches (0 and 2: 8 rows of 8);
    the other ranks report their weights only."""
    w, model, xs = ranks(2), _mlp(), _xs()

    def run(r):
        c = quantscope.calibrate(copy.deepcopy(model), xs, "w8a8", progress=False,
                                 runtime=DIST)
        return {(s["layer"], s["role"]): s["numel"] for s in c.stats}
    got = _ok(w.run(run))
    weights = {("0", "weight"): 64, ("2", "weight"): 32}
    assert got[0] == {**weights, ("0", "input"): 64, ("2", "input"): 64}
    assert got[1] == weights


def test_auto_samples_the_tokens_of_one_process_over_the_ranks(ranks):  # noqa: F811
    """``auto`` deciding on the sampled rows, ``Sampling(tokens=3)`` over 2 ranks: each
    samples its ceil share (2), the gathered rows cut to 3 on every rank, what one process
    keeps (3 rows of 8 values)."""
    w, model, xs = ranks(2), _mlp(), _xs()

    def run(r):
        c = quantscope.calibrate(copy.deepcopy(model), xs, "w8a8", observer="auto",
                                 auto=TENSOR_AUTO, progress=False,
                                 runtime=DIST, sampling=Sampling(tokens=3))
        return {(s["layer"], s["role"]): s["numel"] for s in c.stats}
    for got in _ok(w.run(run)):
        assert got[("0", "input")] == got[("2", "input")] == 3 * 8


def test_auto_samples_within_one_processs_budget_over_the_ranks(ranks):  # noqa: F811
    """``Sampling.budget_mb`` bounds every rank's rows together: 256 bytes for two inputs of
    8 float32 values are 4 rows each in one process, and 4 rows gathered from 2 ranks (on
    every rank: ``auto`` decides on the gathered sample)."""
    w, model, xs = ranks(2), _mlp(), _xs()
    budget = Sampling(budget_mb=256 / 2**20)

    def run(r):
        c = quantscope.calibrate(copy.deepcopy(model), xs, "w8a8", observer="auto",
                                 auto=TENSOR_AUTO, progress=False,
                                 runtime=DIST, sampling=budget)
        return {(s["layer"], s["role"]): s["numel"] for s in c.stats}
    one = quantscope.calibrate(copy.deepcopy(model), xs, "w8a8", observer="auto",
                               auto=TENSOR_AUTO, progress=False,
                               sampling=budget)
    assert {(s["layer"], s["role"]): s["numel"] for s in one.stats}[("0", "input")] == 4 * 8
    for got in _ok(w.run(run)):
        assert got[("0", "input")] == got[("2", "input")] == 4 * 8


def test_every_rank_reports_the_experts_token_counts_of_every_batch(ranks):  # noqa: F811
    """``info["experts"]``: each expert's tokens over every rank's batches, on every rank,
    as one process given all the batches counts them."""
    from tiny_models import qwen2_moe

    w, (model, batches) = ranks(2), qwen2_moe()
    batches = batches[:2]  # one a rank
    one = quantscope.calibrate(copy.deepcopy(model), batches, "w8a8", progress=False)

    def run(r):
        return quantscope.calibrate(copy.deepcopy(model), batches, "w8a8", progress=False,
                                    runtime=DIST).info["experts"]
    assert _ok(w.run(run)) == [one.info["experts"]] * 2


def test_weight_only_imatrix_runs_the_pass_for_its_importance(ranks):  # noqa: F811
    """A recipe of ``imatrix_mse`` weights alone needs no activation, yet the ranks forward
    their shards for the importance: the scales are those of one process given every batch,
    none searched unweighted."""
    w, model, xs = ranks(2), _mlp(), _xs()
    recipe = Recipe((Rule(("0", "2"), weight=Role(QuantSpec("int4", "channel"),
                                                  "imatrix_mse")),), name="imx")

    def run(r):
        c = quantscope.calibrate(copy.deepcopy(model), xs, recipe, progress=False,
                                 runtime=DIST)
        return c.info.get("imatrix_unweighted"), {k: v["weight"].qparams.scale
                                                  for k, v in c.states.items()}
    one = quantscope.calibrate(copy.deepcopy(model), xs, recipe, progress=False)
    for unweighted, scales in _ok(w.run(run)):
        assert not unweighted
        for k, s in scales.items():
            torch.testing.assert_close(s, one.states[k]["weight"].qparams.scale)


# ---- hf_loader -----------------------------------------------------------------------------------

def _write(folder, name, data):
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(json.dumps(data))
    return folder


def test_a_config_that_is_no_json_object_is_a_valueerror_naming_it(tmp_path):
    folder = _write(tmp_path / "m", "config.json", ["llama"])
    with pytest.raises(ValueError, match=r"here: .*config\.json holds a list, not a JSON object"):
        hf_loader.check_no_remote_code(folder, "here")


def test_a_model_type_that_is_no_string_is_no_model_type_transformers_has(tmp_path):
    folder = _write(tmp_path / "m", "config.json", {"model_type": ["llama"]})
    with pytest.raises(hf_loader.RemoteCodeRefused, match=r"has no model_type \['llama'\]"):
        hf_loader.check_no_remote_code(folder)


def test_a_config_without_model_type_needs_code_only_through_its_auto_map(tmp_path):
    hf_loader.check_no_remote_code(_write(tmp_path / "a", "config.json",
                                          {"architectures": ["LlamaForCausalLM"]}))
    folder = _write(tmp_path / "b", "config.json", {"auto_map": {"AutoModel": "m.M"}})
    with pytest.raises(hf_loader.RemoteCodeRefused, match=r"auto_map names the folder's own"):
        hf_loader.check_no_remote_code(folder)


def test_load_tokenizer_reads_no_model_config(tmp_path):
    """A model config of a model_type transformers lacks does not stop the tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "m"
    tok = Tokenizer(WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    _write(folder, "config.json", {"model_type": "quantscope-nope"})
    with pytest.raises(hf_loader.RemoteCodeRefused):
        hf_loader.check_no_remote_code(folder)
    assert hf_loader.load_tokenizer(folder) is not None


def test_a_config_transformers_cannot_read_is_a_valueerror_naming_the_file(tmp_path):
    """A null model_type fails in transformers naming no file: the error names config.json."""
    folder = _write(tmp_path / "n", "config.json", {"model_type": None})
    with pytest.raises(ValueError, match=rf"here: {folder / 'config.json'}: transformers "
                                         r"cannot read it \(ValueError: "):
        hf_loader.load_config(folder, "here")


def test_model_class_is_the_first_model_class_named():
    import transformers

    first, second = transformers.LlamaModel, transformers.LlamaForCausalLM
    assert hf_loader.model_class(["LlamaModel", "LlamaForCausalLM"], "here") is first
    assert hf_loader.model_class(["LlamaForCausalLM", "LlamaModel"], "here") is second


# ---- imatrix_roles -------------------------------------------------------------------------------

SPEC = QuantSpec("int8", "channel")


def _imatrix_slot(module, layer="l"):
    """A weight slot of ``module`` with a waiting ``imatrix_mse`` observer and a ``minmax``
    one: ``(slot, imatrix key, minmax key)``."""
    imx = observer_key("imatrix_mse", Role(SPEC, "imatrix_mse"), module)
    mm = observer_key("minmax", Role(SPEC, "minmax"), module)
    slot = SimpleNamespace(layer=layer, role="weight", module=module, waiting=[],
                           unweighted={}, observers={imx: SimpleNamespace(),
                                                     mm: SimpleNamespace()})
    return slot, imx, mm


def test_only_the_waiting_observers_are_held_and_marked_unweighted():
    """A weight with an ``imatrix_mse`` and a ``minmax`` observer: the first alone is synced
    after the pass and, its layer unseen, searched unweighted."""
    slot, imx, _ = _imatrix_slot(nn.Linear(4, 6))
    slots = {("l", "weight"): slot}
    assert imatrix_roles.held(slots) == [slot.observers[imx]]
    imatrix_roles.observe_waiting(slots, {})
    assert list(slot.unweighted) == [imx]
    assert "never seen" in slot.unweighted[imx]


def test_an_importance_of_another_width_is_not_used():
    slot, imx, _ = _imatrix_slot(nn.Linear(4, 6))
    imatrix_roles.observe_waiting({("l", "weight"): slot}, {"l": torch.ones(6)})
    assert slot.unweighted == {imx: "its input has 6 channels, its weight's input dim 4"}
    assert not hasattr(slot.observers[imx], "importance")


def test_a_conv1d_weights_observer_takes_its_importance_along_dim_0():
    from transformers.pytorch_utils import Conv1D

    slot, imx, mm = _imatrix_slot(Conv1D(6, 4))  # weight [4 in, 6 out]
    imatrix_roles.observe_waiting({("l", "weight"): slot}, {"l": torch.ones(4)})
    obs = slot.observers[imx]
    assert obs.input_dim == 0 and torch.equal(obs.importance, torch.ones(4))
    assert not slot.unweighted and not hasattr(slot.observers[mm], "importance")


def test_no_waiting_observer_gathers_no_importance_and_runs_no_pass():
    """Without a waiting ``imatrix_mse`` observer there is nothing to hook (None), and a
    weight-only recipe forwards no batch."""
    slot, imx, _ = _imatrix_slot(nn.Linear(4, 6))
    del slot.observers[imx]
    assert imatrix_roles.gather(nn.Sequential(slot.module), {("l", "weight"): slot}) is None
    recipe = Recipe((Rule(("0", "2"), weight=Role(SPEC, "minmax")),), name="w")
    c = quantscope.calibrate(_mlp(), _xs(1), recipe, progress=False)
    assert c.info["batches"] == 0
