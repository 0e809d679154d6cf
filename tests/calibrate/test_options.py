"""The calibration options as objects (quantscope.calibration.options): each validates its
fields; the flat keywords of before give bitwise the same calibration with one
DeprecationWarning; calibrate_many's signature stays short."""

from __future__ import annotations

import argparse
import inspect
import math
import warnings

import pytest
import torch
import transformers

from quantscope.calibration import (
    Auto,
    MoE,
    Outliers,
    Runtime,
    Sampling,
    Sequential,
    calibrate,
    calibrate_many,
)
from quantscope.calibration.options import KEYWORDS, Options, as_sequential, from_keywords
from quantscope.cli.running import calibration_options


def _llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    batches = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    return model, batches


@pytest.mark.parametrize(("make", "field"), [
    (lambda: Sampling(tokens=0), "Sampling.tokens"),
    (lambda: Sampling(tokens=True), "Sampling.tokens"),
    (lambda: Sampling(budget_mb=math.nan), "Sampling.budget_mb"),
    (lambda: Sampling(budget_mb=-1), "Sampling.budget_mb"),
    (lambda: Auto(metric="mse"), "Auto.metric"),
    (lambda: Auto(candidates="minmax"), "Auto.candidates"),
    (lambda: Auto(loss=3), "Auto.loss"),
    (lambda: Auto(score_tokens=0), "Auto.score_tokens"),
    (lambda: MoE(min_tokens=0), "MoE.min_tokens"),
    (lambda: Outliers(keep_float=-1), "Outliers.keep_float"),
    (lambda: Outliers(fallback="int8"), "Outliers.fallback"),
    (lambda: Outliers(smooth=1.5), "alpha"),
    (lambda: Sequential(mode="fast"), "Sequential.mode"),
    (lambda: Sequential(cache_budget_mb=math.inf), "Sequential.cache_budget_mb"),
    (lambda: Runtime(missing="drop"), "Runtime.missing"),
    (lambda: Runtime(time_groups=["a"]), "Runtime.time_groups"),
    (lambda: Runtime(time_groups={"g": "w8a8"}), "Runtime.time_groups"),  # not its letters
    (lambda: MoE(all_experts="no"), "MoE.all_experts"),  # would read as True
    (lambda: MoE(all_experts=1), "MoE.all_experts"),
    (lambda: Runtime(distributed="no"), "Runtime.distributed"),  # as MoE.all_experts
    (lambda: Runtime(distributed=1), "Runtime.distributed"),
    (lambda: Options(progress="no"), "Options.progress"),
    (lambda: Auto(candidates=3), "Auto.candidates"),  # not iterable: named, not a bare error
    (lambda: Sampling(seed=2**64), "Sampling.seed"),  # torch.manual_seed's overflow, named
    (lambda: Sampling(seed=-(2**63) - 1), "Sampling.seed"),
    (lambda: Sequential(device="bogus", checkpoint="ckpt"), "Sequential.device"),
    (lambda: Sequential(device="cuda:x", checkpoint="ckpt"), "Sequential.device"),
    (lambda: Sequential(device="cpu"), "Sequential.device"),  # moves nothing without it
    (lambda: Sequential(checkpoint=5), "Sequential.checkpoint"),  # failed inside the pass
    (lambda: Sequential(cache_dir=5), "Sequential.cache_dir"),
    (lambda: Sequential(blocks=["layers"]), "Sequential.blocks"),
])
def test_each_object_validates_its_fields(make, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()


def test_seed_must_be_an_integer():
    with pytest.raises(TypeError, match=r"Sampling\.seed"):
        Sampling(seed=1.5)
    with pytest.raises(TypeError, match=r"Sampling\.seed"):
        Sampling(seed=True)


@pytest.mark.parametrize("seed", [-(2**63), -1, 2**64 - 1])
def test_every_seed_torch_takes_is_accepted(seed):
    """The ends of torch.manual_seed's documented range [-0x8000_0000_0000_0000,
    0xffff_ffff_ffff_ffff]: torch itself takes them, and so does the calibration."""
    torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    calibrate(model, [torch.randn(4, 8)], "w8a8", sampling=Sampling(seed=seed), progress=False)


def test_candidates_from_a_generator_are_kept():
    """Checked as a tuple, so the check does not consume a generator (stored as () before)."""
    a = Auto(candidates=(n for n in ["mse", "minmax"]), metric="tensor")
    assert a.candidates == ("mse", "minmax")
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    c = calibrate(model, [torch.randn(4, 8)], "w8a8", observer="auto", auto=a, progress=False)
    chosen = {row["observer"] for row in c.report().rows}
    assert chosen <= {"mse", "minmax", "memoryless_mse", "memoryless_minmax"}, chosen


def test_objects_are_frozen_and_options_hold_their_kinds():
    with pytest.raises(AttributeError):
        Sampling().tokens = 3
    with pytest.raises(TypeError, match=r"sampling must be Sampling\(\.\.\.\)"):
        Options(sampling=Auto())
    assert Auto(candidates=["minmax", "mse"]).candidates == ("minmax", "mse")
    o = Options().but(sampling__seed=4, progress=False)
    assert (o.sampling.seed, o.sampling.tokens, o.progress) == (4, 2048, False)


def test_but_names_a_path_it_cannot_follow():
    with pytest.raises(ValueError, match=r"sequential__mode: sequential is None \(off\)"):
        Options().but(sequential__mode="quantized")  # changing a field does not turn it on
    o = Options().but(sequential=Sequential(), sequential__mode="quantized")
    assert o.sequential == Sequential(mode="quantized")
    with pytest.raises(TypeError, match="'a__b__c' is not object__field"):
        Options().but(a__b__c=1)
    with pytest.raises(TypeError, match="'sampling__seed__x': Sampling has no field 'seed__x'"):
        Options().but(sampling__seed__x=1)
    with pytest.raises(TypeError, match="'progress__x' is not object__field"):
        Options().but(progress__x=1)


def test_sequential_shorthands():
    assert as_sequential(True) == Sequential()
    assert as_sequential("quantized") == Sequential(mode="quantized")
    assert as_sequential(None) is None and as_sequential(False) is None
    with pytest.raises(ValueError, match="sequential must be"):
        as_sequential("fast")


def test_every_old_keyword_maps_to_a_field():
    for kind, name in KEYWORDS.values():
        owner = {"sampling": Sampling, "auto": Auto, "moe": MoE, "outliers": Outliers,
                 "sequential": Sequential, "runtime": Runtime}[kind]
        assert name in inspect.signature(owner).parameters


def test_keywords_map_with_one_warning_naming_the_new_spelling():
    with pytest.warns(DeprecationWarning) as got:
        o = from_keywords(Options(), {"sample_tokens": 7, "auto_metric": "joint", "smooth": 0.5})
    assert len(got) == 1
    text = str(got[0].message)
    assert "Sampling(tokens=...)" in text and "Auto(metric=...)" in text
    assert (o.sampling.tokens, o.auto.metric, o.outliers.smooth) == (7, "joint", 0.5)


@pytest.mark.parametrize(("objects", "keywords", "said"), [
    ({"outliers": Outliers(keep_float=1)}, {"keep_float": 0},
     r"keep_float=0 and outliers=Outliers\(keep_float=1\) both set outliers\.keep_float"),
    ({"sampling": Sampling(tokens=5, seed=7)}, {"sample_tokens": 10},
     r"sample_tokens=10 and sampling=Sampling\(tokens=5\) both set sampling\.tokens"),
])
def test_an_object_and_a_keyword_for_the_same_field_are_refused(objects, keywords, said):
    """Neither silently wins (the keyword did)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    with pytest.raises(ValueError, match=said):
        calibrate(model, [torch.randn(4, 8)], "w8a8", progress=False, **objects, **keywords)


def test_a_keyword_beside_an_object_that_leaves_its_field_alone_applies():
    with pytest.warns(DeprecationWarning):
        o = from_keywords(Options(outliers=Outliers(smooth=0.5)), {"keep_float": 2})
    assert o.outliers == Outliers(smooth=0.5, keep_float=2)


def test_bad_keywords_are_refused():
    model, batches = _llama()
    with pytest.raises(TypeError, match="unexpected keyword argument 'sample_token'"):
        calibrate(model, batches, "w8a8", progress=False, sample_token=3)
    with pytest.raises(TypeError, match="options of sequential calibration"):
        calibrate(model, batches, "w8a8", progress=False, blocks="model.layers")


def test_calibrate_many_takes_a_handful_of_parameters():
    params = inspect.signature(calibrate_many).parameters
    named = [p for p in params.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert len(named) <= 10, list(params)
    assert {"sampling", "auto", "moe", "outliers", "sequential", "runtime"} <= set(params)


CASES = [  # (old keywords, the same as objects)
    ({"sample_tokens": 64, "seed": 3}, {"sampling": Sampling(tokens=64, seed=3)}),
    ({"observer": "auto", "auto_metric": "joint", "sample_budget_mb": 1},
     {"observer": "auto", "auto": Auto(metric="joint"), "sampling": Sampling(budget_mb=1)}),
    ({"observer": "auto", "smooth": 0.6, "keep_float": 1},
     {"observer": "auto", "outliers": Outliers(smooth=0.6, keep_float=1)}),
    ({"keep_float": 2, "fallback": "float", "missing": "float"},
     {"outliers": Outliers(keep_float=2, fallback="float"), "runtime": Runtime(missing="float")}),
    ({"sequential": True, "blocks": "model.layers"},
     {"sequential": Sequential(blocks="model.layers")}),
]


@pytest.mark.parametrize(("old", "new"), CASES)
def test_old_keywords_give_the_same_calibration(old, new):
    model, batches = _llama()
    with pytest.warns(DeprecationWarning) as got:
        a = calibrate(model, batches, "w8a8", progress=False, **old)
    dep = [w for w in got if w.category is DeprecationWarning]
    assert [w.filename for w in dep] == [__file__]  # once, at the caller's line
    params_a = {k: v.clone() for k, v in model.state_dict().items()}
    model, batches = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        b = calibrate(model, batches, "w8a8", progress=False, **new)
    assert a.quantizes_like(b) and a.info.get("keep_float") == b.info.get("keep_float")
    assert all(torch.equal(params_a[k], v) for k, v in model.state_dict().items())


def test_the_callable_package_warns_at_the_callers_line():
    import quantscope

    model, batches = _llama()
    with pytest.warns(DeprecationWarning) as got:
        quantscope.calibrate(model, batches, "w8a8", progress=False, seed=1)
    assert [w.filename for w in got if w.category is DeprecationWarning] == [__file__]


def test_sequential_does_not_combine_with_outliers_or_distributed():
    model, batches = _llama()
    with pytest.raises(ValueError, match="keep_float"):
        calibrate(model, batches, "w8a8", progress=False, sequential=True,
                  outliers=Outliers(keep_float=1))
    with pytest.raises(ValueError, match="distributed"):
        calibrate(model, batches, "w8a8", progress=False, sequential=True,
                  runtime=Runtime(distributed=True))


def test_the_cli_builds_the_objects():
    args = argparse.Namespace(sample_tokens=32, sample_budget_mb=None, seed=2, smooth=0.5,
                              keep_float=1, fallback="float", sequential=None,
                              no_progress=True, auto_metric="fisher", score_tokens=16)
    got = calibration_options(args, ["minmax"])
    assert got["sampling"] == Sampling(32, None, 2)
    assert got["auto"] == Auto(("minmax",), "fisher", score_tokens=16)
    assert got["outliers"] == Outliers(0.5, 1, "float")
    assert got["runtime"] == Runtime() and got["progress"] is False


def test_sequential_device_is_a_torch_device_and_flat_keywords_set_it_with_checkpoint():
    assert Sequential(device="cpu", checkpoint="c").device == torch.device("cpu")
    # device= without checkpoint= is refused: the two flat keywords are applied together
    with pytest.warns(DeprecationWarning):
        o = from_keywords(Options(sequential=Sequential()), {"device": "cpu", "checkpoint": "c"})
    assert (o.sequential.device, o.sequential.checkpoint) == (torch.device("cpu"), "c")


@pytest.mark.parametrize(("device", "count", "said"), [
    ("cuda", 0, "this torch sees no cuda device"),
    ("cuda:7", 2, r"this machine has 2 cuda devices \(cuda:0 to cuda:1\)"),
])
def test_a_device_this_torch_cannot_use_is_refused_when_calibration_starts(
        monkeypatch, tmp_path, device, count, said):
    """Before the checkpoint is read or any block runs (the folder is empty), not silently
    on the CPU; the object itself is made (options may be written on another machine)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    seq = Sequential(device=device, checkpoint=tmp_path)
    model, batches = _llama()
    with pytest.raises(ValueError, match=r"Sequential\.device " + device + ": " + said):
        calibrate(model, batches, "w8a8", progress=False, sequential=seq)


def test_a_cache_dir_this_machine_lacks_is_refused_when_calibration_starts(tmp_path):
    model, batches = _llama()
    seq = Sequential(cache_dir=tmp_path / "absent")
    with pytest.raises(ValueError, match=r"Sequential\.cache_dir .*absent.* not an existing"):
        calibrate(model, batches, "w8a8", progress=False, sequential=seq)


def test_a_cache_dir_no_folder_can_be_made_in_is_named(monkeypatch, tmp_path):
    # probe s59: a read-only or special file system (/proc, /sys) gave mkdtemp's bare OSError
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    model, batches = _llama()
    with pytest.raises(ValueError, match=r"^calibrate: cannot make the spill folder in "
                                         r"Sequential\.cache_dir .* \(Operation not permitted\)"):
        calibrate(model, batches, "w8a8", progress=False,
                  sequential=Sequential(cache_budget_mb=0, cache_dir=tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["sampling", "auto", "moe", "outliers", "runtime"])
@pytest.mark.parametrize("value", [{}, 0, [], "", False])
def test_a_falsy_value_of_another_type_is_refused_not_taken_for_the_defaults(name, value):
    model, batches = _llama()
    with pytest.raises(TypeError, match=name):
        calibrate(model, batches, "w8a8", progress=False, **{name: value})


def test_an_unknown_auto_candidate_is_named_as_one():
    model, batches = _llama()
    with pytest.raises(ValueError, match=r"Auto\.candidates names 'nosuch': .*unknown observer"):
        calibrate(model, batches, "w8a8", observer="auto", progress=False,
                  auto=Auto(candidates=["minmax", "nosuch"]))


def test_sequential_device_places_the_checkpoints_weights(tmp_path):
    from quantscope.calibration.run.checkpoint import empty_model

    model, batches = _llama()
    model.save_pretrained(tmp_path)
    whole = calibrate(model, batches, "w8a8", progress=False)
    seq = calibrate(empty_model(tmp_path), batches, "w8a8", progress=False,
                    sequential=Sequential(checkpoint=tmp_path, device="cpu"))
    assert seq.quantizes_like(whole)


def test_time_groups_name_recipe_labels():
    model, batches = _llama()
    out = calibrate_many(model, batches, {"a": "w8a8", "b": "w4a16"}, progress=False,
                         runtime=Runtime(time_groups={"both": ("a", "b")}))
    assert set(out["a"].info["group_seconds"]) == {"both"}
