"""Probe s29 (hostile files): four ways a crafted input file escaped docs/SECURITY.md.

(1) JSON nested 10**5 levels deep (a saved calibration's quantscope.json, a checkpoint's
config.json or index, a recipe file, a compare report) raised a bare RecursionError naming
no file: now one reader (``quantscope._jsonfile``) makes it a ValueError naming the file.
(2) A shard name of ``model.safetensors.index.json`` such as ``../x.safetensors`` or an
absolute path was read from outside the model folder: refused.
(3) A ``re:`` target or ignore entry with nested quantifiers hung
``from_compressed_tensors`` (catastrophic backtracking): refused before matching.
(4) A 30 KB checkpoint whose config.json claims a huge hidden size allocated the claimed
weight before its shape was compared: the shapes are compared on the meta device first."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import quantscope

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from quantscope._checks import PATTERN_MAX, PATTERN_REPEATS, regex_problem
from quantscope.calibration import Calibration, calibrate
from quantscope.calibration.results.io import load
from quantscope.calibration.run.checkpoint import Checkpoint, empty_model
from quantscope.calibration.run.hf_loader import load_config
from quantscope.cli.checks import UsageError
from quantscope.cli.compare import _read_report
from quantscope.cli.recipes import read_recipe_file
from quantscope.exporters import check

DEEP = "[" * 100_000 + "]" * 100_000
SRC = str(Path(quantscope.__file__).resolve().parents[1])  # the quantscope under test


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny Llama's float folder, its calibration and its compressed-tensors export."""
    root = tmp_path_factory.mktemp("hostile")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=50)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(root / "float")
    batches = [{"input_ids": torch.randint(0, 50, (1, 8))} for _ in range(2)]
    calib = calibrate(model, batches, "w8a8", progress=False)
    calib.save(str(root / "calib"))
    calib.export(model, str(root / "ct"))
    return root


def _copy(made, kind, tmp_path) -> Path:
    shutil.copytree(made / kind, tmp_path / kind, symlinks=True)
    return tmp_path / kind


def _nest(path: Path, depth_text: str = DEEP) -> None:
    """``path``'s JSON object with one more key holding ``depth_text``."""
    text = path.read_text().rstrip().removesuffix("}")
    path.write_text(text + ', "x": ' + depth_text + "}")


# -- (1) deeply nested JSON --------------------------------------------------------------

def _deep_load(made, tmp, text=DEEP):
    d = _copy(made, "calib", tmp)
    _nest(d / "quantscope.json", text)
    return lambda: load(str(d)), d / "quantscope.json"


def _deep_ct(made, tmp, text=DEEP):
    d = _copy(made, "ct", tmp)
    _nest(d / "config.json", text)
    return lambda: Calibration.from_compressed_tensors(str(d)), d / "config.json"


def _deep_check(made, tmp, text=DEEP):
    d = _copy(made, "ct", tmp)
    _nest(d / "config.json", text)
    return lambda: check(str(d)), d / "config.json"


def _deep_index(made, tmp, text=DEEP):
    d = _copy(made, "float", tmp)
    (d / "model.safetensors.index.json").write_text('{"weight_map": ' + text + "}")
    return lambda: Checkpoint(d), d / "model.safetensors.index.json"


def _deep_ckpt_config(made, tmp, text=DEEP):
    d = _copy(made, "float", tmp)
    _nest(d / "config.json", text)
    return lambda: Checkpoint(d), d / "config.json"


def _deep_empty_model(made, tmp, text=DEEP):
    d = _copy(made, "float", tmp)
    _nest(d / "config.json", text)
    return lambda: empty_model(d), d / "config.json"


def _deep_load_config(made, tmp, text=DEEP):
    d = _copy(made, "float", tmp)
    _nest(d / "config.json", text)
    return lambda: load_config(d), d / "config.json"


def _deep_recipe_json(made, tmp, text=DEEP):
    f = tmp / "recipe.json"
    f.write_text('{"rules": ' + text + "}")
    return lambda: read_recipe_file(str(f)), f


def _deep_recipe_yaml(made, tmp, text=DEEP):
    pytest.importorskip("yaml")
    f = tmp / "recipe.yaml"
    f.write_text("rules: " + text + "\n")
    return lambda: read_recipe_file(str(f)), f


def _deep_report(made, tmp, text=DEEP):
    f = tmp / "report.json"
    f.write_text('{"runs": ' + text + "}")
    return lambda: _read_report(str(tmp)), f


@pytest.mark.parametrize("case", [
    _deep_load, _deep_ct, _deep_check, _deep_index, _deep_ckpt_config, _deep_empty_model,
    _deep_load_config, _deep_recipe_json, _deep_recipe_yaml, _deep_report])
def test_deeply_nested_json_is_a_valueerror_naming_the_file(made, tmp_path, case):
    call, file = case(made, tmp_path)
    cli = case in (_deep_recipe_json, _deep_recipe_yaml, _deep_report)
    with pytest.raises(UsageError if cli else ValueError) as e:
        call()
    assert str(file) in str(e.value) or repr(str(file)) in str(e.value)
    assert "nested too deeply to parse (RecursionError)" in str(e.value)


@pytest.mark.parametrize("case", [
    _deep_load, _deep_ct, _deep_check, _deep_index, _deep_ckpt_config, _deep_empty_model,
    _deep_load_config, _deep_recipe_json, _deep_recipe_yaml, _deep_report])
def test_an_integer_too_long_for_python_is_a_valueerror_naming_the_file(made, tmp_path, case):
    # probe s40: Python's int() refuses over 4300 digits with a bare ValueError, which json
    # and PyYAML pass on: it named neither the file nor the caller
    call, file = case(made, tmp_path, "9" * 5000)
    cli = case in (_deep_recipe_json, _deep_recipe_yaml, _deep_report)
    with pytest.raises(UsageError if cli else ValueError) as e:
        call()
    assert str(file) in str(e.value) or repr(str(file)) in str(e.value)
    assert "cannot be read: Exceeds the limit (4300 digits)" in str(e.value)


def test_json_nested_a_few_levels_still_reads(made, tmp_path):
    """The reader refuses what the parser cannot hold, not nesting as such."""
    d = _copy(made, "calib", tmp_path)
    _nest(d / "quantscope.json", "[" * 50 + "]" * 50)
    want = load(str(made / "calib"))
    got = load(str(d))
    assert set(got.states) == set(want.states)


# -- (2) index shard names outside the folder --------------------------------------------

def _index(folder: Path, target: str) -> None:
    import safetensors.torch as st

    t = st.load_file(folder / "model.safetensors")
    t.pop("model.embed_tokens.weight")
    st.save_file(t, folder / "model.safetensors")
    wm = {k: "model.safetensors" for k in t}
    wm["model.embed_tokens.weight"] = target
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))


@pytest.mark.parametrize("target", ["../outside.safetensors", "{root}/outside.safetensors",
                                    "sub/outside.safetensors", "..", "sub\\x.safetensors"])
def test_an_index_shard_outside_the_folder_is_refused(made, tmp_path, target):
    import safetensors.torch as st

    d = _copy(made, "float", tmp_path)
    st.save_file({"model.embed_tokens.weight": torch.full((50, 32), 7.0)},
                 tmp_path / "outside.safetensors")
    (d / "sub").mkdir()
    shutil.copy(tmp_path / "outside.safetensors", d / "sub" / "outside.safetensors")
    _index(d, target.format(root=tmp_path))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: weight_map\["
                                         r"'model\.embed_tokens\.weight'\] is .* not a shard "
                                         r"file name of the folder"):
        Checkpoint(d)
    with pytest.raises(ValueError, match="not a shard file name of the folder"):
        empty_model(d)


def test_a_symlinked_shard_inside_the_folder_still_reads(made, tmp_path):
    """A Hugging Face cache snapshot's files are links into ``blobs/``: the name is the
    folder's own, wherever the link points."""
    import safetensors.torch as st

    d = _copy(made, "float", tmp_path)
    value = torch.full((50, 32), 7.0)
    st.save_file({"model.embed_tokens.weight": value}, tmp_path / "blob")
    os.symlink(tmp_path / "blob", d / "embed.safetensors")
    _index(d, "embed.safetensors")
    ckpt = Checkpoint(d)
    assert torch.equal(ckpt.get("model.embed_tokens.weight"), value)


# -- (3) backtracking re: patterns ------------------------------------------------------

@contextmanager
def _deadline(seconds: int):
    """Fail (not hang) where a call runs past ``seconds`` (re checks signals as it runs)."""
    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("field", ["ignore", "targets"])
@pytest.mark.parametrize("reader", ["from_compressed_tensors", "check"])
def test_a_backtracking_pattern_is_refused_before_matching(made, tmp_path, field, reader):
    d = _copy(made, "ct", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg["quantization_config"]
    group = next(iter(qc["config_groups"]))
    bad = "re:(.|.)*(.|.)*X"
    if field == "ignore":
        qc["ignore"] = ["lm_head", bad]
        where = r"quantization_config\.ignore\[1\]"
    else:
        qc["config_groups"][group]["targets"] = [bad]
        where = rf"quantization_config\.config_groups\.{group}\.targets\[0\]"
    (d / "config.json").write_text(json.dumps(cfg))
    call = Calibration.from_compressed_tensors if reader == "from_compressed_tensors" else check
    with _deadline(20), pytest.raises(ValueError, match=rf"config\.json: {where}: "
                                                        r"'re:\(\.\|\.\)\*\(\.\|\.\)\*X' "
                                                        r"repeats a part that itself holds"):
        call(str(d))


# every re: pattern the tests use, and those llm-compressor / compressed-tensors write
LEGIT = [".*lm_head", ".*mlp.gate$", r".*self_attn.(q|k|v)_proj$", r".*mlp\.gate$",
         ".*experts.*", ".*vision_tower.*", ".*multi_modal_projector.*",
         r".*attention.*(query|key|value|dense)", r".*layers\.1\.mlp\.down_proj",
         r".*layers\.0\.mlp\.experts.*", "layers.0.self_attn", ".*mlp.gate", "(up|down)",
         r".*self_attn\.[qkv]_proj$", ".*router", r".*(k|v)_proj$", ".*q_proj$", ".*",
         ".*pos_conv_embed.*", "layers.0.mlp.gate$", ".*up", ".*proj", r".*mlp\.", "b", "0",
         "", r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj",
         ".*block_sparse_moe.gate", "[a", "(q|k_proj"]


@pytest.mark.parametrize("pattern", LEGIT)
def test_the_patterns_toolkits_write_pass(pattern):
    assert regex_problem(pattern) is None


@pytest.mark.parametrize("pattern, said", [
    ("(.|.)*X", "holds a repeat or alternatives"), ("(a+)+b", "holds a repeat"),
    (r"(\w+\.)*X", "holds a repeat"), ("(a{1,3}){2,}", "holds a repeat"),
    (".*" * (PATTERN_REPEATS + 1) + "X", f"has {PATTERN_REPEATS + 1} repeats"),
    ("a" * (PATTERN_MAX + 1), f"is {PATTERN_MAX + 1} characters long")])
def test_patterns_that_backtrack_are_named(pattern, said):
    assert said in regex_problem(pattern)


def test_a_legit_pattern_in_a_config_still_reads(made, tmp_path):
    d = _copy(made, "ct", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg["quantization_config"]
    for scheme in qc["config_groups"].values():  # the same layers as "Linear" takes
        scheme["targets"] = [r"re:.*self_attn.(q|k|v|o)_proj$",
                             r"re:.*mlp\.(gate|up|down)_proj$", "re:.*lm_head"]
    (d / "config.json").write_text(json.dumps(cfg))
    got = Calibration.from_compressed_tensors(str(d))
    want = Calibration.from_compressed_tensors(str(made / "ct"))
    assert set(got.states) == set(want.states) and len(want.states) >= 7
    for layer, roles in want.states.items():
        assert torch.equal(got.states[layer]["weight"].qparams.scale,
                           roles["weight"].qparams.scale)


# -- (4) a config claiming a huge module -------------------------------------------------

def test_a_config_claiming_a_huge_layer_is_refused_without_allocating_it(made, tmp_path):
    """q_proj claimed 16384 x 16384 (1 GiB of float32) beside its stored 32 x 32: refused
    with the shapes, and the peak memory grows by far less than the claimed weight."""
    d = _copy(made, "ct", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(hidden_size=2**14, num_attention_heads=4, num_key_value_heads=2, head_dim=2**12)
    (d / "config.json").write_text(json.dumps(cfg))
    code = textwrap.dedent(f"""
        import resource, warnings
        warnings.simplefilter("ignore")
        import torch
        from quantscope.calibration import Calibration
        torch.zeros(1)  # torch's own start-up allocations before the baseline
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            Calibration.from_compressed_tensors({str(d)!r})
            print("accepted")
        except ValueError as e:
            print("ValueError", e)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print("GROWN_KB", grown)
    """)
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": SRC}).stdout
    assert "ValueError" in out and "q_proj: weight" in out and "are stored as" in out, out
    assert "16384" in out.split("are stored as")[1], out
    grown_kb = int(out.split("GROWN_KB")[1])
    claimed_kb = 2**14 * 2**14 * 4 // 1024
    assert grown_kb < claimed_kb // 4, out


def test_a_saved_calibration_with_a_backtracking_pattern_is_refused_at_load(tmp_path):
    """A stranger's quantscope.json reached apply() with a pattern that hangs re.match; a
    recipe built in Python is its author's own and keeps any pattern."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 8))
    calib = calibrate(model, None, calibrate.preset("w4a16", ignore=["re:(a+)+b"]),
                      progress=False)
    calib.save(tmp_path / "c")
    meta = json.loads((tmp_path / "c" / "quantscope.json").read_text())
    assert meta["recipe"]["ignore"] == ["re:(a+)+b"]
    with pytest.raises(ValueError, match=r"quantscope\.json.*recipe\.ignore.*\(a\+\)\+b"):
        load(tmp_path / "c")


def test_a_deeply_nested_model_config_is_a_usage_error(tmp_path):
    from quantscope.cli.checks import check_model_arg

    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UsageError, match="config.json cannot be read: its data is nested"):
        check_model_arg(str(tmp_path))
