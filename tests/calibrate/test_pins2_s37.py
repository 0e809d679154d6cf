"""Session 37's second mutation round: pins of behaviour no earlier test held (an extra's
link to a sibling folder, a dangling extra, the masked KL rows, the scored tokens of a
sequential block, the auto report rows, a meta parameter in the NaN check, a partial or
over-full histogram state, a record's empty layout, the real batches of a dropped piece)."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from calib_checks import padded_batches
from tiny_models import llama
from torch import nn

import quantscope
from quantscope import QuantSpec, get_observer
from quantscope.calibration import Auto
from quantscope.calibration.choice.auto import OutputDivergence
from quantscope.calibration.choice.references import summary as _summary
from quantscope.calibration.run.batches import nan_parameter
from quantscope.exporters.source_folder import own_file as _own_file

TWO = Auto(candidates=("minmax", "percentile"))


def _calibrate(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantscope.calibrate(*args, progress=False, **kw)


# ----------------------------------------------------------------------------- export extras


def test_own_file_refuses_a_link_into_a_sibling_folder_sharing_the_name_prefix(tmp_path):
    src, private = tmp_path / "m1", tmp_path / "m1-private"
    src.mkdir()
    private.mkdir()
    (private / "tokenizer.json").write_text("{}")
    (src / "tokenizer.json").symlink_to(private / "tokenizer.json")
    (src / "inside.json").write_text("{}")
    (src / "vocab.json").symlink_to(src / "inside.json")
    assert not _own_file(str(src), str(src / "tokenizer.json"))  # "m1-private" is not "m1/"
    assert _own_file(str(src), str(src / "vocab.json"))  # a link into the folder is its own


def test_own_file_refuses_a_dangling_link(tmp_path):
    src = tmp_path / "m1"
    src.mkdir()
    (src / "chat_template.jinja").symlink_to(src / "gone.jinja")  # inside, but gone
    assert not _own_file(str(src), str(src / "chat_template.jinja"))


# ----------------------------------------------------------------------------- auto scoring


def test_summary_keeps_only_the_masked_positions_of_the_logits():
    logits = torch.randn(2, 4, 6)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    kind, rows = _summary({"logits": logits}, mask)
    assert kind == "kl" and rows.shape == (3, 6)
    torch.testing.assert_close(rows, torch.stack([logits[0, 0], logits[0, 1], logits[1, 0]]))


def test_sequential_score_tokens_count_the_real_tokens_of_the_users_batches():
    model, _ = llama()
    batches = padded_batches()
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    calib = _calibrate(model, batches, "w8a8", observer="auto", sequential=True, auto=TWO)
    for block, info in calib.info["auto"]["blocks"].items():
        assert info["score_tokens"] == real, block


def test_auto_stats_hold_one_row_per_layer_role_from_its_supplier():
    model, batches = llama()
    calib = _calibrate(model, batches, "w8a8", observer="auto", auto=TWO)
    n = collections.Counter((r["layer"], r["role"]) for r in calib.stats)
    assert set(n.values()) == {1}
    assert set(n) == {(layer, role) for layer, roles in calib.states.items() for role in roles}


def test_drop_non_finite_drops_the_real_batch_with_its_piece():
    batches = [{"input_ids": torch.tensor([[1, 2]])}, {"input_ids": torch.tensor([[3, 4]])}]
    real = [{"attention_mask": torch.tensor([[1, 1]])}, {"attention_mask": torch.tensor([[1, 0]])}]
    refs = [("kl", torch.tensor([[float("nan"), 0.0]])), ("kl", torch.zeros(1, 2))]
    score = OutputDivergence(nn.Linear(2, 2), batches, references=refs, real=real)
    assert score.drop_non_finite() == 1
    assert [id(b) for b in score.batches] == [id(batches[1])]
    assert [id(r) for r in score.real] == [id(real[1])]  # its mask stays with its piece


# ----------------------------------------------------------------------------- NaN weights


def test_nan_parameter_skips_a_meta_parameter():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    m.register_parameter("spare", nn.Parameter(torch.empty(3, device="meta")))
    assert nan_parameter(m) is None


# ----------------------------------------------------------------------------- histogram state


def test_partial_histogram_state_without_hist_lo_is_named():
    spec = QuantSpec("int8", "tensor", symmetric=False)
    torch.manual_seed(0)
    obs = get_observer("percentile", spec)
    obs(torch.randn(64, 16) - 2)
    state = {k: v for k, v in obs.state_dict().items() if k != "hist_lo"}
    with pytest.raises(RuntimeError, match="a partial state"):
        get_observer("percentile", spec).load_state_dict(state, strict=False)


def test_histogram_count_bound_is_per_unit_and_excludes_2_pow_62():
    spec = QuantSpec("int8", "channel")
    torch.manual_seed(0)
    obs = get_observer("percentile", spec)
    obs(torch.randn(2, 64) * 3 - 1)
    sd = obs.state_dict()
    counts = torch.zeros_like(sd["hist_counts"])
    counts[:, 0] = 3 * 2 ** 60  # each unit 0.75 * 2**62: each under the bound, together over
    get_observer("percentile", spec).load_state_dict({**sd, "hist_counts": counts})
    counts[:, 0] = 2 ** 62  # at the bound: refused
    with pytest.raises(ValueError, match="total under 2\\*\\*62 per unit"):
        get_observer("percentile", spec).load_state_dict({**sd, "hist_counts": counts})


# ----------------------------------------------------------------------------- record


def test_empty_layout_record_error_names_the_observer():
    spec = QuantSpec("int8", "channel")
    saved = get_observer("minmax", spec)
    saved(torch.randn(4, 16))
    extra = torch.frombuffer(bytearray(b'{"layout": ""}'), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^MovingAverageMinMaxObserver\(.*holds no layout"):
        get_observer("minmax", spec).load_state_dict(
            {**saved.state_dict(), "_extra_state": extra})
