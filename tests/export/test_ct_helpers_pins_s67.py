"""Pins of the compressed-tensors export helpers that no test held (mutation round s67 over
exporters/ct_match.py, value_checks.py, ct_compress.py, registry.py and source_folder.py):
each test fails on one mutant the export tests let through. Expected values come from the
definitions: the docstrings (``check_shard_size`` read as huggingface_hub's
``parse_size_to_int`` reads a size, the float32 qparams while compressing, the config's names
of a renamed layer, the registry's tables, the source folder's own files) and
compressed-tensors' own matching and config fields."""

import math
import os
from types import SimpleNamespace

import pytest
import torch
from test_ct_writer_pins_s64 import _Calibration, writers  # noqa: F401 (the fixture)
from torch import nn

pytest.importorskip("compressed_tensors")


# ---- ct_compress.check_shard_size: huggingface_hub's sizes --------------------------------


@pytest.mark.parametrize("value", ["5gb", " 500mb ", "1Kb", 1, 1.0, 10**9])
def test_a_shard_size_huggingface_hub_reads_is_taken(value):
    """``parse_size_to_int`` strips the text and upper-cases its unit: ``"5gb"`` is 5 GB."""
    from quantscope.exporters.ct_compress import check_shard_size

    assert check_shard_size(value, "export") is None  # taken: no error


@pytest.mark.parametrize("value", [True, 0.5, math.inf, math.nan, "infGB", "0.5", None])
def test_a_shard_size_below_one_byte_or_unbounded_is_refused(value):
    """A bool is no number of bytes, below one byte is a shard per tensor, an infinite or NaN
    size no size, a number without a unit no text huggingface_hub reads."""
    from quantscope.exporters.ct_compress import check_shard_size

    with pytest.raises(ValueError, match=r"^export: max_shard_size must be a size of at least "
                                         r"one byte"):
        check_shard_size(value, "export")


# ---- ct_compress: the float32 qparams, save_here, the config's names -----------------------


def _with_scheme(weights):
    layer = nn.Linear(4, 2).half()
    layer.quantization_scheme = SimpleNamespace(weights=weights)
    for name in ("weight_scale", "input_scale"):
        layer.register_parameter(name, nn.Parameter(
            torch.tensor([0.1, 0.3], dtype=torch.float16), requires_grad=False))
    layer.register_parameter("weight_zero_point", nn.Parameter(
        torch.tensor([1.0, 3.0], dtype=torch.bfloat16), requires_grad=False))
    return layer


def test_weight_qparams_are_float32_while_compressing_and_their_dtype_after():
    """A quantized weight's bf16 / fp16 ``weight_*`` qparams are float32 (the same values)
    inside ``_float32_qparams``, their own dtype again after; the weight itself, an input's
    scale and a layer whose scheme quantizes no weight keep their dtypes throughout."""
    from quantscope.exporters.ct_compress import _float32_qparams

    work = nn.Sequential(_with_scheme(object()), _with_scheme(None))
    before = {n: p.detach().clone() for n, p in work.named_parameters()}
    with _float32_qparams(work):
        dtypes = {n: p.dtype for n, p in work.named_parameters()}
        assert all(torch.equal(p.float(), before[n].float())
                   for n, p in work.named_parameters())
    assert dtypes == {"0.weight": torch.float16, "0.bias": torch.float16,
                      "0.weight_scale": torch.float32, "0.input_scale": torch.float16,
                      "0.weight_zero_point": torch.float32,
                      **{n: p.dtype for n, p in before.items() if n.startswith("1.")}}
    assert {n: p.dtype for n, p in work.named_parameters()} == {
        n: p.dtype for n, p in before.items()}


def test_save_here_writes_on_whichever_process_transformers_calls_main():
    """transformers 5 asks ``should_save_on_this_rank(is_main_process)``: ``save_here`` lets
    the caller's ``is_main_process`` decide, not the global rank."""
    from quantscope.exporters.ct_compress import save_here

    class Work:
        should_save_on_this_rank = None

        def save_pretrained(self, folder, **options):
            self.said = (folder, options, self.should_save_on_this_rank(True),
                         self.should_save_on_this_rank(False))

    work = Work()
    save_here(work, "out", max_shard_size="5GB")
    assert work.said == ("out", {"max_shard_size": "5GB"}, True, False)


def test_a_renamed_layer_is_named_by_the_checkpoint_then_the_model():
    """Where transformers renames a layer (GPT-NeoX's ``embed_out`` is ``lm_head`` on disk)
    the config names both: the checkpoint's name (vLLM's), then the model's."""
    from quantscope.exporters.ct_compress import _written

    assert _written("embed_out", "lm_head", False) == ["lm_head", "embed_out"]
    assert _written("lm_head", "lm_head", False) == ["lm_head"]


def test_an_ambiguous_name_is_the_anchored_escaped_regex_of_it_alone():
    """A module named as a class or as a ``re:`` target is written as the regex of its name
    alone: compressed-tensors' ``is_match`` takes that module, no sibling whose name begins
    with it or that the unescaped name would match as a regex."""
    from compressed_tensors.utils.match import is_match

    from quantscope.exporters.ct_compress import _written

    model = nn.Module()
    for name in ("Embedding", "Embedding2", "re:a+b", "re:aab", "re:a+b2"):
        model.add_module(name, nn.Identity())
    for name in ("Embedding", "re:a+b"):
        targets = _written(name, name, True)
        assert len(targets) == 1 and targets[0].startswith("re:")
        assert [n for n, m in model.named_children() if is_match(n, m, targets)] == [name]
    assert _written("Embedding", "embed", True) == ["re:embed$", "re:Embedding$"]


# ---- registry: the tables and the wrapped writer -------------------------------------------


@pytest.mark.usefixtures("writers")
def test_the_writers_check_gets_the_arguments_by_name_with_defaults(monkeypatch):
    """The calibration checks its model, then ``check`` runs with the writer's arguments by
    name, defaults applied, on every rank (here one that writes nothing)."""
    from quantscope import comm
    from quantscope.exporters.registry import register

    seen = []

    class Checked(_Calibration):
        def check_model(self, model, what):
            seen.append((what, model))

    def check(calibration, model, path, level):
        seen.append((model, path, level))

    @register("s67-test", check)
    def export_s67(calibration, model, path, *, level=3):
        raise AssertionError("written on a rank that writes nothing")

    monkeypatch.setattr(comm, "writes_here", lambda rank, who, path: False)
    export_s67(Checked(), "m", "out")
    assert seen == [("export", "m"), ("m", "out", 3)]


@pytest.mark.usefixtures("writers")
def test_register_returns_the_checked_writer_and_exporter_finds_a_new_format():
    """The decorator returns (and registers) the wrapped writer, which refuses what is no
    Calibration; a format registered at run time is found though no table names it."""
    from quantscope.exporters.registry import exporter, register

    @register("s67-test")
    def export_s67(calibration, model, path):
        raise AssertionError("written")

    assert exporter("s67-test") is export_s67
    with pytest.raises(TypeError, match=r"^export s67-test: calibration must be a "
                                        r"Calibration"):
        export_s67(object(), None, "out")


def test_register_reader_returns_the_reader_it_registers(monkeypatch):
    from quantscope.exporters import registry

    monkeypatch.setattr(registry, "_readers", dict(registry._readers))

    @registry.register_reader("s67-test")
    def read_s67(path):
        return path

    assert read_s67("x") == "x" and registry.reader("s67-test") is read_s67


def test_an_unknown_format_is_refused_naming_the_known_ones():
    from quantscope.exporters.registry import exporter, reader

    with pytest.raises(ValueError, match=r"^export: unknown format 'gguf'; expected one of "
                                         r"\['compressed-tensors', 'onnx'\]$"):
        exporter("gguf")
    with pytest.raises(ValueError, match=r"^read: unknown format 'onnx'; expected one of "
                                         r"\['compressed-tensors'\]$"):
        reader("onnx")


# ---- source_folder: which folder, which files ----------------------------------------------


def _model_folder(path, config=True):
    path.mkdir(parents=True)
    if config:
        (path / "config.json").write_text("{}")
    return path


def test_loaded_from_lists_model_folders_the_models_own_first(tmp_path):
    """The model's own folder (``config._name_or_path``), then the calibration's record; a
    folder with no config.json, a file or an empty path is no model folder."""
    from quantscope.exporters.source_folder import loaded_from, source_dir

    own, recorded = _model_folder(tmp_path / "own"), _model_folder(tmp_path / "rec")
    bare = _model_folder(tmp_path / "bare", config=False)
    model = SimpleNamespace(config=SimpleNamespace(_name_or_path=str(own)))
    cal = SimpleNamespace(info={"model": str(recorded)})
    assert loaded_from(cal, model) == [str(own), str(recorded)]
    assert source_dir(cal, model, None) == source_dir(cal, model, "") == str(own)
    model.config._name_or_path = str(bare)
    cal.info["model"] = str(own / "config.json")
    assert loaded_from(cal, model) == []
    with pytest.raises(ValueError, match=r"is not a model folder"):
        source_dir(cal, model, bare)


def test_only_a_hugging_face_caches_blobs_are_a_snapshots_own_files(tmp_path):
    """A link from ``models--org--name/snapshots/rev`` is the folder's own where it leads into
    the repository's ``blobs/``; into another folder of the repository, or from a
    ``snapshots/rev`` of a folder that is no cache repository, it is not."""
    from quantscope.exporters.source_folder import own_file

    for repo, own in (("models--org--name", True), ("org--name", False)):
        src = _model_folder(tmp_path / repo / "snapshots" / "rev")
        for sub in ("blobs", "refs"):
            (tmp_path / repo / sub).mkdir(exist_ok=True)
            (tmp_path / repo / sub / "abc").write_text("{}")
        os.symlink(tmp_path / repo / "blobs" / "abc", src / "tokenizer.json")
        os.symlink(tmp_path / repo / "refs" / "abc", src / "vocab.json")
        assert own_file(str(src), str(src / "tokenizer.json")) is own, repo
        assert own_file(str(src), str(src / "vocab.json")) is False, repo


def test_copy_extras_copies_the_patterns_files_in_name_order(tmp_path):
    """``*.model`` (a sentencepiece model) is one of EXPORT_EXTRAS' patterns; the copied
    names come sorted, whatever order the folder lists them in; other files stay behind."""
    from quantscope.exporters.source_folder import copy_extras

    src, dst = _model_folder(tmp_path / "src"), _model_folder(tmp_path / "dst", config=False)
    extras = ["vocab.txt", "added_tokens.json", "tokenizer.json", "spiece.model",
              "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "merges.txt", "generation_config.json", "vocab.json"]
    for name in [*extras, "notes.txt"]:
        (src / name).write_text(name)
    assert copy_extras(str(src), str(dst)) == sorted(extras)
    assert (dst / "spiece.model").read_text() == "spiece.model"
    assert not (dst / "notes.txt").exists()


def _entries(tmp_path, tensors):
    from safetensors.torch import save_file

    from quantscope.exporters.read_checks import safetensors_headers

    save_file(tensors, str(tmp_path / "model.safetensors"))
    return safetensors_headers(tmp_path, "check")


def test_every_scale_leaf_is_checked_and_its_first_bad_value_reported(tmp_path):
    """An input scale and a KV scale are scales too (SCALE_LEAVES); each problem names the
    tensor, its layer's first value that is not finite and > 0, and is a non-finite one."""
    from quantscope.exporters.value_checks import scale_problems

    entries = _entries(tmp_path, {
        "a.weight_scale": torch.tensor([1.0, 2.0]), "a.weight": torch.tensor([0.0, -1.0]),
        "a.input_scale": torch.tensor([0.5, 0.0, -1.0]),
        "b.k_scale": torch.tensor([2.0, math.inf, -3.0])})
    got = sorted(scale_problems(entries), key=lambda p: p["tensor"])
    assert got == [
        {"tensor": "a.input_scale", "values": {"a": 0.0}, "non_finite": True,
         "why": "a.input_scale holds a scale <= 0 (0.0)"},
        {"tensor": "b.k_scale", "values": {"b": math.inf}, "non_finite": True,
         "why": "b.k_scale holds NaN or inf (inf)"}]


def _qconfig(fmt="int-quantized", **groups):
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    def args(bits):
        return None if bits is None else QuantizationArgs(
            num_bits=bits, type="int", symmetric=False, strategy="tensor", dynamic=False)

    return QuantizationConfig(format=fmt, config_groups={
        name: QuantizationScheme(targets=targets, weights=args(w), input_activations=args(i),
                                 output_activations=args(o), format=gfmt)
        for name, (targets, w, i, o, gfmt) in groups.items()})


def _zero_point_whys(qconfig, tmp_path, tensors):
    from quantscope.exporters.value_checks import zero_point_problems

    return [p["why"] for p in zero_point_problems(qconfig, _entries(tmp_path, tensors))]


def test_each_zero_point_is_checked_against_its_own_roles_args(tmp_path):
    """``input_zero_point`` is the input activations' (int4: [-8, 7]), ``output_zero_point``
    the output activations' (int8); a zero point stored as uint8 is read as its integers."""
    qconfig = _qconfig(g=(["Linear"], None, 4, 8, None))
    assert _zero_point_whys(qconfig, tmp_path, {
        "l.input_zero_point": torch.tensor([100], dtype=torch.int8),
        "l.output_zero_point": torch.tensor([100], dtype=torch.int8),
        "m.input_zero_point": torch.tensor([3], dtype=torch.uint8)}) == [
        "l.input_zero_point holds values that are no integers in [-8, 7] (int4 tensor asym)"]


def test_only_a_pack_quantized_weights_zero_points_are_left_to_the_reader(tmp_path):
    """A ``pack-quantized`` group's (its own format first, else the config's) weight zero
    points are packed and not read; its input zero point is checked as any other."""
    packed = torch.tensor([0x77777777], dtype=torch.int32)
    why = "l.input_zero_point holds values that are no integers in [-8, 7] (int4 tensor asym)"
    for qconfig in (_qconfig("pack-quantized", g=(["Linear"], 4, 4, None, None)),
                    _qconfig("int-quantized", g=(["Linear"], 4, 4, None, "pack-quantized"))):
        assert _zero_point_whys(qconfig, tmp_path, {
            "l.weight_zero_point": packed,
            "l.input_zero_point": torch.tensor([100], dtype=torch.int8)}) == [why]


def test_a_layer_two_groups_select_alike_is_left_to_the_groups_check(tmp_path):
    """Read without the model, a target with no dot (a class name) may select any layer: with
    two such groups no one group is the layer's (as vLLM resolves it), so its zero point is
    checked against neither."""
    qconfig = _qconfig(g1=(["Linear"], None, 4, None, None),
                       g2=(["Embedding"], None, 4, None, None))
    assert _zero_point_whys(qconfig, tmp_path, {
        "l.input_zero_point": torch.tensor([100], dtype=torch.int8)}) == []


def test_a_zero_point_of_args_no_quantscope_format_has_is_left_to_the_reader(tmp_path):
    """int32 is no quantscope format (``llmcompressor_spec`` raises ValueError): skipped."""
    qconfig = _qconfig(g=(["Linear"], None, 32, None, None))
    assert _zero_point_whys(qconfig, tmp_path, {
        "l.input_zero_point": torch.tensor([2**20], dtype=torch.int32)}) == []


# ---- ct_match: the rules in compressed-tensors' order, the modules they match --------------


def _rule(*targets):
    from quantscope import Channel, QuantSpec
    from quantscope.calibration import Role, Rule

    return Rule(targets, weight=Role(QuantSpec("int8", Channel(0)), "minmax"))


def test_matched_leaves_out_what_the_configs_ignore_takes():
    """``matched`` is ``match_named_modules`` with the config's ``ignore``: a module it lists
    is in no group even where the recipe's own ignore is empty."""
    from quantscope.exporters.ct_match import matched

    model = nn.Module()
    model.proj, model.lm_head = nn.Linear(2, 2), nn.Linear(2, 2)
    qconfig = SimpleNamespace(config_groups={"g": SimpleNamespace(targets=["Linear"])},
                              ignore=["lm_head"])
    rule = _rule("Linear")
    got = [(n, g) for n, _, g, _ in matched(qconfig, [rule], (), ["g"], model)]
    assert got == [("proj", "g")]


def test_precedence_orders_exact_names_then_regexes_then_class_names():
    """Targets naming a module exactly (as quantscope patterns), then ``re:`` ones, then class
    names, each kind sorted; a target two groups name is the later group's; a top-level
    module named as a class (``Embedding``) is taken by its name and by the class; a run of
    one group's targets is one rule."""
    from quantscope.exporters.ct_match import precedence

    model = nn.Module()
    model.a = nn.Sequential()
    model.a.add_module("b", nn.Linear(2, 2))
    model.lm_head, model.Embedding = nn.Linear(2, 2), nn.Linear(2, 2)
    model.emb = nn.Embedding(4, 2)
    qconfig = SimpleNamespace(config_groups={
        "g1": SimpleNamespace(targets=["Linear", "re:.*b$", "lm_head"]),
        "g2": SimpleNamespace(targets=["lm_head", "a.b", "Embedding"])})
    rule = _rule("x")
    rules, groups = precedence(qconfig, {"g1": (rule,), "g2": (rule,)}, model)
    assert [(g, r.targets) for g, r in zip(groups, rules, strict=True)] == [
        ("g2", ("re:Embedding$", "a.b", "lm_head")), ("g1", ("re:.*b$",)),
        ("g2", ("Embedding",)), ("g1", ("Linear",))]


def test_a_kv_cache_alone_is_a_compressed_dense_config_with_no_groups():
    """No scheme attached: compressed-tensors has no config (None without a KV cache); with
    one, the config is empty ``config_groups`` of the written (``compressed``) ``dense``
    checkpoint beside the ``kv_cache_scheme``."""
    from compressed_tensors.quantization import QuantizationArgs

    from quantscope.exporters.ct_compress import ct_compressor

    kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False)
    assert ct_compressor(nn.Sequential(nn.Linear(2, 2)), None).quantization_config is None
    config = ct_compressor(nn.Sequential(nn.Linear(2, 2)), kv).quantization_config
    assert (config.config_groups, config.format, config.quantization_status.value) == (
        {}, "dense", "compressed")
    assert config.kv_cache_scheme is kv


def test_annotate_writes_a_module_named_as_a_target_kind_as_its_regex(tmp_path):
    """The config's module names as written: one named like a ``re:`` target or like a class
    the model holds (``Embedding``) is the anchored regex of its name; a plain name, a real
    regex and a class name stay."""
    import json

    from quantscope.exporters.ct_compress import annotate

    work = nn.Module()
    for name in ("re:x", "xy", "Embedding"):
        work.add_module(name, nn.Linear(2, 2))
    work.emb = nn.Embedding(4, 2)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "config_groups": {"g": {"targets": ["re:x", "Embedding", "xy", "re:.*y", "Linear"]}},
        "ignore": ["xy"]}}))
    calibration = SimpleNamespace(recipe=SimpleNamespace(name="r"), label=None, smoothing={})
    annotate(str(tmp_path), calibration, [], None, work)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["g"]["targets"] == [
        "re:re:x$", "re:Embedding$", "xy", "re:.*y", "Linear"]
    assert qc["ignore"] == ["xy"]


def test_the_compressors_config_ignores_a_float_layer_of_a_targets_subclass():
    """Targets ``Linear`` beside a quantized ``FalconLinear`` (a subclass): the plain Linear
    left in float is matched by the target (compressed-tensors' and vLLM's matching take
    subclasses), so the config lists it in ``ignore``."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        QuantizationStatus,
    )

    from quantscope.exporters.ct_compress import ct_compressor

    class FalconLinear(nn.Linear):
        pass

    work = nn.Sequential(FalconLinear(2, 2), nn.Linear(2, 2))
    work[0].quantization_scheme = QuantizationScheme(targets=["Linear"], weights=(
        QuantizationArgs(num_bits=8, symmetric=True, strategy="channel")))
    work[0].quantization_status = QuantizationStatus.FROZEN
    assert ct_compressor(work, None).quantization_config.ignore == ["1"]


def test_a_link_to_no_file_inside_the_folder_is_no_own_file(tmp_path):
    """Only a file is the folder's own: a link to one of its folders, or a dangling link into
    it, is not (copying it would copy no file)."""
    from quantscope.exporters.source_folder import copy_extras, own_file

    src, dst = _model_folder(tmp_path / "src"), _model_folder(tmp_path / "dst", config=False)
    (src / "sub").mkdir()
    os.symlink(src / "sub", src / "tokenizer.json")
    os.symlink(src / "gone.json", src / "vocab.json")
    assert not own_file(str(src), str(src / "tokenizer.json"))
    assert not own_file(str(src), str(src / "vocab.json"))
    assert copy_extras(str(src), str(dst)) == []
