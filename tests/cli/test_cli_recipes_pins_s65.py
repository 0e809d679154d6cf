"""Pins of the command line's recipe building (``quantscope.cli.recipes``: the --group-size
refusal's layouts, the observer label, a recipe file's ignore list, --targets narrowing, YAML
errors and the float note, the shape check as a usage error) and of what calibrate / compare
run on (``quantscope.cli.running``: phase times, --device auto, the cosine to the float
embeddings, position limits, the setup's counts, rank 0's evaluation, the paths --out spares,
torchrun's options), each found unpinned by a mutation round (session 65)."""

import re
from types import SimpleNamespace

import pytest
from torch import nn

from quantscope import QuantSpec
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.cli.checks import UsageError
from quantscope.layout import Block, Channel, Tensor

MX4 = Role(QuantSpec("fp4_e2m1", layout=Block(32)), "minmax")
I8_TENSOR = Role(QuantSpec("int8", layout=Tensor()), "minmax")
I8_CHANNEL = Role(QuantSpec("int8", layout=Channel(0)), "mse")


def test_group_size_refusal_names_each_layout_once_and_notes_blocks_where_any_role_has_them():
    """Two rules with the same roles are named once; a block among other layouts still says
    that blocks are not groups."""
    from quantscope.cli.recipes import no_groups

    rec = Recipe((Rule(("a",), weight=MX4, input=I8_TENSOR),
                  Rule(("b",), weight=MX4, input=I8_TENSOR), Rule(("c",), weight=I8_CHANNEL)),
                 name="mine")
    assert no_groups(rec, 64) == (
        "--group-size 64: recipe 'mine' has no grouped weights to change (weight block:32, "
        "input tensor, weight channel:0); blocks are not groups: their size is fixed by the "
        "number format; --group-size sets the groups of grouped recipes (W4A16, w4a8 ...)")


def test_observer_label_names_each_observer_once_and_counts_a_local_dynamic_role():
    """NVFP4's inputs (dynamic="local") calibrate a global scale with static_minmax: named;
    only dynamic=True roles are left out, and an observer run by several rules is named once."""
    from quantscope.calibration import preset
    from quantscope.cli.recipes import observer_label

    assert observer_label(preset("nvfp4")) == "memoryless_minmax/static_minmax"
    assert observer_label(preset("w8a8-dynamic")) == "memoryless_minmax"
    rec = Recipe((Rule(("a",), weight=I8_TENSOR, input=I8_TENSOR),
                  Rule(("b",), weight=I8_CHANNEL)))
    assert observer_label(rec) == "minmax/mse"


def test_two_ranks_run_distributed_and_refuse_sequential():
    """Under torchrun (world 2) the run is distributed; --sequential with it is refused."""
    from quantscope import cli
    from quantscope.cli.running import calibration_options

    args = cli.build_parser().parse_args(["calibrate"])
    args.world = 2
    assert calibration_options(args)["runtime"].distributed is True
    args = cli.build_parser().parse_args(["calibrate", "--sequential"])
    args.world = 2
    with pytest.raises(UsageError, match="--sequential does not combine with torchrun"):
        calibration_options(args)


def test_a_phase_says_its_start_and_its_time_in_tenths_of_a_second(capsys):
    from quantscope.cli.running import Phases

    assert Phases().run("loading m", lambda: 7) == 7
    start, end = capsys.readouterr().err.splitlines()
    assert start == "loading m ..."
    assert re.fullmatch(r"loading m: \d+\.\d s", end), end
    Phases(quiet=True).run("loading m", lambda: None)
    assert capsys.readouterr().err == ""


def test_device_auto_is_cuda_where_torch_sees_one(monkeypatch):
    import torch

    from quantscope.cli.running import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"


class _Positions(nn.Module):
    """A model whose config holds ``n`` positions, with no other table or ``other``."""

    def __init__(self, n, other=None):
        super().__init__()
        self.words = nn.Embedding(10, 2)
        self.other = other
        self.config = SimpleNamespace(max_position_embeddings=n)

    def get_input_embeddings(self):
        return self.words


def test_a_length_the_model_holds_exactly_is_kept_without_a_note(capsys):
    from quantscope.cli.running import Phases, fit_length, positions

    assert fit_length(_Positions(64), 64, "--max-length", Phases()) == 64
    assert capsys.readouterr().err == ""
    assert fit_length(_Positions(64), 65, "--max-length", Phases()) == 64
    assert capsys.readouterr().err == (
        "--max-length 65: the model takes 64 positions, so documents are truncated to 64 "
        "tokens\n")
    assert positions(_Positions(0)) is None  # no positions said: no limit
    assert fit_length(_Positions(0), 128, "--max-length", Phases()) == 128


def test_a_yaml_number_for_a_roles_scale_encoding_is_refused_saying_to_quote_it(tmp_path):
    """spec.scale is text (fp32, e8m0, ...): a YAML number there is refused as the other text
    fields are."""
    from quantscope.cli.recipes import read_recipe_file

    path = tmp_path / "r.yaml"
    path.write_text("name: p\nrules:\n- targets: [Linear]\n  weight:\n    spec: {format: int8, "
                    "scale: 12}\n")
    with pytest.raises(UsageError) as e:
        read_recipe_file(str(path))
    assert str(e.value) == (
        f"--recipe-file {str(path)!r}: rules[0].weight.spec.scale (line 5, column 33) is 12, "
        f'which YAML reads as a number; the field takes text: quote it, scale: "12"')


def test_a_json_file_that_does_not_parse_is_said_as_json_whatever_the_case_of_its_suffix(
        tmp_path):
    from quantscope.cli.recipes import read_recipe_file

    path = tmp_path / "r.JSON"
    path.write_text("name: x\nrules: [\n")
    with pytest.raises(UsageError) as e:
        read_recipe_file(str(path))
    assert str(e.value).startswith(f"--recipe-file {str(path)!r} is not valid JSON: ")


def test_a_yaml_syntax_error_names_its_line_and_column_from_one(tmp_path):
    from quantscope.cli.recipes import read_recipe_file

    path = tmp_path / "r.yaml"
    path.write_text("name: x\nrules: [\n")  # the list is still open at the end: line 3
    with pytest.raises(UsageError, match=r"neither JSON nor plain YAML: .* at line 3, column 1$"):
        read_recipe_file(str(path))


def _linears(*names):
    m = nn.Sequential()
    for n in names:
        m.add_module(n, nn.Linear(4, 4))
    return m


@pytest.mark.parametrize("names, said", [
    (("h1", "h2", "h3", "h4"), "h1, h2, h3, h4"),
    (("h1", "h2", "h3", "h4", "h5", "h6"), "h1, h2, h3, h4 and 2 more")])
def test_the_float_note_lists_four_top_ignored_modules_then_counts(names, said):
    from quantscope.cli.recipes import float_note

    model = _linears("body", *names)
    rec = Recipe((Rule(("Linear",), weight=I8_TENSOR),), ignore=("h*",))
    assert float_note(rec, model) == f"left in float: {said} (--ignore to change)"


def test_targets_narrow_a_file_rule_to_a_glob_named_module_alone():
    """A module whose name holds glob characters is written as an anchored regex of itself:
    it takes that module, not another whose name starts with it; a rule left with no module
    is dropped."""
    from argparse import Namespace

    from quantscope.cli.recipes import adjust_recipe_file

    model = _linears("l*", "l*x", "other")
    rec = Recipe((Rule(("l*",), weight=I8_CHANNEL), Rule(("Linear",), weight=I8_TENSOR)))
    args = Namespace(ignore=[], observer=None, targets=[r"re:l\*$"])
    got = adjust_recipe_file(rec, args, model)
    assert len(got.rules) == 1 and set(got.match(model)) == {"l*"}
    assert got.rules[0].targets == (r"re:l\*\Z",)


def test_the_cosine_compares_each_score_with_the_float_models_embeddings(monkeypatch):
    """cosine is to the fp32 embeddings: those of reference(), kept for every later score."""
    import contextlib

    import torch

    from quantscope.cli.running import Evaluator
    from quantscope.demo import data, models

    monkeypatch.setattr(data, "lee_documents", lambda: ["a", "b"])
    monkeypatch.setattr(data, "lee_pairs", lambda: ([0], [1], [0.5]))
    monkeypatch.setattr(models, "lee_correlation", lambda emb, pairs: 0.25)
    given = iter([torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[0.6, 0.8], [0.0, 1.0]])])
    monkeypatch.setattr(models, "embed", lambda *a, **k: next(given))

    class Calibration:
        def apply(self, model):
            return contextlib.nullcontext()

    ev = Evaluator("embedding", None, None, 8, False)
    assert ev.primary == "lee_r"
    assert ev.reference() == {"lee_r": 0.25, "cosine": 1.0}
    got = ev.quantized(Calibration())
    assert got["lee_r"] == 0.25 and got["cosine"] == pytest.approx((0.6 + 1.0) / 2)


def test_the_file_ignore_and_the_default_ignore_join_each_pattern_once():
    from argparse import Namespace

    from quantscope.cli.names import DEFAULT_IGNORE
    from quantscope.cli.recipes import adjust_recipe_file

    rec = Recipe((Rule(("Linear",), weight=I8_TENSOR),), ignore=("*lm_head*", "mine"))
    args = Namespace(ignore=list(DEFAULT_IGNORE), observer=None, targets=None)
    got = adjust_recipe_file(rec, args, _linears("a"))
    assert got.ignore == ("*lm_head*", "mine", "*pooler*")


@pytest.mark.parametrize("rank", [0, 1])
def test_the_setup_counts_the_documents_taken_and_only_rank_0_evaluates(llama_dir, tmp_path,
                                                                       monkeypatch, rank):
    """--calib-docs 5 of a two-document file takes 2, as the setup says; under torchrun only
    rank 0 scores the float model (the others get None)."""
    from quantscope import cli
    from quantscope.cli import running

    class Evaluator:
        def __init__(self, task, model, tok, max_length, progress):
            self.docs, self.pairs = ["x"] * 3, None

        def reference(self):
            return {"perplexity": 2.0}

    monkeypatch.setattr(running, "Evaluator", Evaluator)
    calib = tmp_path / "calib.txt"
    calib.write_text("the cat sat on the mat\na dog ran far away\n")
    args = cli.build_parser().parse_args([
        "calibrate", "--model", llama_dir, "--calib-file", str(calib), "--calib-docs", "5",
        "--max-length", "8", "--batch-size", "2", "--device", "cpu", "--no-progress"])
    args.rank = rank
    _, batches, _, fp, setup, _ = running.load_setup(args, running.Phases(quiet=True))
    assert setup["calib_docs"] == 2 and setup["eval_docs"] == 3
    assert sum(len(b["input_ids"]) for b in batches) == 2
    assert fp == ({"perplexity": 2.0} if rank == 0 else None)


def test_the_inputs_out_must_spare_are_the_calib_and_recipe_files_not_a_demo_name(
        tmp_path, monkeypatch):
    from quantscope.cli.running import command_inputs

    monkeypatch.chdir(tmp_path)  # no folder named minilm here: the demo model
    args = SimpleNamespace(model="minilm", calib_file="c.txt", recipe_file="r.yaml")
    assert command_inputs(args) == ["c.txt", "r.yaml"]
    args = SimpleNamespace(model="./mine", calib_file=None, recipe_file=None)
    assert command_inputs(args) == ["./mine"]


def test_a_conv_kernel_a_group_would_run_along_is_a_usage_error_before_any_forward():
    """calibrate's shape check, run as the recipe is built: a usage error naming the layer."""
    from quantscope import cli
    from quantscope.cli.recipes import build_recipe

    args = cli.build_parser().parse_args(["calibrate", "--scheme", "W4A16", "--targets", "Conv2d",
                                          "--group-size", "16"])
    with pytest.raises(UsageError, match=r"^calibrate: layer '0' \(Conv2d\) weight of shape "
                                         r"\(8, 3, 3, 3\) cannot take int4 group:16"):
        build_recipe(args, nn.Sequential(nn.Conv2d(3, 8, 3)))


def test_a_table_whose_padding_row_leaves_no_position_is_no_position_table():
    """RoBERTa's positions start after its padding row (n - padding_idx - 1 of them); a table
    of n rows padding at its last row would leave none: the config's n holds."""
    from quantscope.cli.running import positions

    assert positions(_Positions(8, nn.Embedding(8, 2, padding_idx=1))) == 6
    assert positions(_Positions(8, nn.Embedding(8, 2, padding_idx=7))) == 8
