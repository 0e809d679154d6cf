"""No code of a model folder runs unless the caller passes trust_remote_code=True (issue 37 row 2).

The folder's config names its own Python (``auto_map``) for a model_type transformers lacks;
that Python writes a marker file when imported. Every loader of quantscope (API and CLI, stdin
answering ``y``) must refuse with an error naming the option, and the marker never appears.
A positive control (transformers itself, trusting the folder) shows the marker would appear.
"""

import io
import json
import os
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")

from quantscope.calibration.run.checkpoint import empty_model
from quantscope.calibration.run.hf_loader import RemoteCodeRefused, load_config, model_class
from quantscope.demo.models import load_model

_CODE = """
import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import PretrainedConfig, PreTrainedModel
class EvilConfig(PretrainedConfig):
    model_type = "quantscope_evil"
class EvilModel(PreTrainedModel):
    config_class = EvilConfig
"""


def _evil_folder(root, model_type="quantscope_evil", quantized=False):
    folder = root / "evil"
    folder.mkdir()
    marker = root / "MARKER"
    (folder / "evil.py").write_text(_CODE.format(marker=str(marker)))
    config = {"model_type": model_type, "architectures": ["EvilModel"],
              "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel",
                           "AutoModelForCausalLM": "evil.EvilModel"}}
    if quantized:
        config["quantization_config"] = {"quant_method": "compressed-tensors",
                                         "config_groups": {}, "format": "naive-quantized"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}))
    return folder, marker


@pytest.mark.parametrize("load", [
    lambda f: load_model(f),
    lambda f: load_model(f, task="causal-lm"),
    lambda f: empty_model(f),
    lambda f: load_config(f),
], ids=["load_model", "load_model_causal", "empty_model", "load_config"])
def test_api_loaders_refuse_and_run_nothing(tmp_path, load, monkeypatch):
    folder, marker = _evil_folder(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 20))  # a prompt would get "y"
    with pytest.raises(RemoteCodeRefused, match="trust_remote_code"):
        load(folder)
    assert not marker.exists()


def test_from_compressed_tensors_refuses_and_runs_nothing(tmp_path):
    import torch
    from safetensors.torch import save_file

    from quantscope.calibration import Calibration

    folder, marker = _evil_folder(tmp_path, quantized=True)
    save_file({"x.weight": torch.zeros(1)}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="architectures|trust_remote_code"):
        Calibration.from_compressed_tensors(folder)
    assert not marker.exists()


def test_known_model_type_with_auto_map_loads_transformers_own_config(tmp_path):
    folder, marker = _evil_folder(tmp_path, model_type="bert")
    assert type(load_config(folder)).__name__ == "BertConfig"
    assert not marker.exists()


@pytest.mark.extended  # an interpreter end to end
def test_cli_refuses_even_when_stdin_says_yes(tmp_path):
    folder, marker = _evil_folder(tmp_path)
    for cmd, says in ((["calibrate", "--model", str(folder), "--out", str(tmp_path / "run")],
                       "trust_remote_code"), (["check", str(folder)], "check")):
        r = subprocess.run([sys.executable, "-m", "quantscope", *cmd], check=False,
                           input="y\n" * 20,
                           capture_output=True, text=True, cwd=tmp_path, timeout=600)
        assert r.returncode != 0, (cmd, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
        assert says in r.stderr, r.stderr
        assert not marker.exists(), cmd


@pytest.mark.extended  # interpreters end to end
def test_positive_control_transformers_trusting_the_folder_runs_it(tmp_path):
    folder, marker = _evil_folder(tmp_path)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    code = ("import sys, transformers; "
            "transformers.AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)")
    subprocess.run([sys.executable, "-c", code, str(folder)], env=env, check=True,
                   capture_output=True, timeout=600)
    assert marker.exists()  # the folder's code does run when trusted: the tests above can fail


@pytest.mark.parametrize("archs", [["set_seed"], ["AutoConfig"], ["nope"], "BertModel", [3]])
def test_architectures_resolve_only_model_classes(archs):
    with pytest.raises(ValueError, match="architectures"):
        model_class(archs, "cfg")
    assert model_class(["set_seed", "BertModel"], "cfg") is transformers.BertModel


def test_every_transformers_loader_call_in_src_goes_through_hf_loader():
    """One place decides: no other module calls ``from_pretrained``, and a ``from_config``
    call passes ``trust_remote_code=False`` itself."""
    import ast
    import pathlib

    src = pathlib.Path(__file__).resolve().parents[2] / "src" / "quantscope"
    found = []
    for path in src.rglob("*.py"):
        if path.name == "hf_loader.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                kw = {k.arg: k.value for k in node.keywords}
                trusted = isinstance(kw.get("trust_remote_code"), ast.Constant) and \
                    kw["trust_remote_code"].value is False
                if node.func.attr == "from_pretrained" or (
                        node.func.attr == "from_config" and not trusted):
                    found.append(f"{path.relative_to(src)}:{node.lineno}")
    assert found == []
