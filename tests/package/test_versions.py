"""The oldest transformers and compressed-tensors quantscope's features were tested with:
declared in pyproject's extras and checked where a feature starts (found by probing:
transformers 4.57 left a checkpoint skeleton's rotary tables unset, so sequential
calibration ran on garbage; compressed-tensors 0.12 failed inside the reader and the export
with messages about damaged tensors or pydantic fields)."""

import re
from pathlib import Path

import pytest
import torch

from quantscope import _versions

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the test extra's backport
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_declares_the_minimums_the_code_checks():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    declared = {m.group(1): m.group(2) for reqs in extras.values() for r in reqs
                if (m := re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", r))}
    for dist, want in _versions.MINIMUM.items():
        assert declared.get(dist) == want, (dist, declared)


@pytest.mark.parametrize("version, release", [("5.15.0", (5, 15, 0)), ("5.15.0.dev0", (5, 15, 0)),
                                              ("0.19.0", (0, 19, 0)), ("0.20.1+cpu", (0, 20, 1)),
                                              ("4.57.6", (4, 57, 6)), ("bogus", ())])
def test_release(version, release):
    assert _versions.release(version) == release


@pytest.fixture
def installed(monkeypatch):
    """Pretend the given versions are installed (None: not installed)."""
    def pretend(**versions):
        names = {"transformers": "transformers", "compressed_tensors": "compressed-tensors"}
        have = {names[k]: v for k, v in versions.items()}
        monkeypatch.setattr(_versions, "_installed", lambda dist: have.get(dist, "99.0"))
    return pretend


def test_an_older_version_is_refused_naming_the_feature(installed):
    installed(transformers="4.57.6")
    with pytest.raises(ImportError, match=r"^empty_model needs transformers >= 5\.15, found "
                                          r"4\.57\.6: pip install -U 'transformers>=5\.15'"):
        _versions.require("transformers", "empty_model")
    installed(compressed_tensors=None)
    with pytest.raises(ImportError, match=r"needs compressed-tensors >= 0\.19, which is not "
                                          r"installed"):
        _versions.require("compressed-tensors", "export to compressed-tensors")
    installed(transformers="5.15.0", compressed_tensors="0.19.0")
    _versions.require("transformers", "x")
    _versions.require("compressed-tensors", "x")


def test_the_features_check_before_they_start(installed, tmp_path):
    transformers = pytest.importorskip("transformers")
    from quantscope.calibration import Calibration, calibrate
    from quantscope.calibration.run.checkpoint import empty_model
    from quantscope.calibration.structure import kv_cache

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=50)).eval()
    model.save_pretrained(tmp_path / "float")
    calib = calibrate(model, [torch.randint(0, 50, (1, 8))], "fp8-kv", progress=False)
    installed(transformers="4.57.6")
    with pytest.raises(ImportError, match="^empty_model needs transformers >= 5.15"):
        empty_model(tmp_path / "float")
    with pytest.raises(ImportError, match="^KV-cache calibration needs transformers >= 5.15"):
        kv_cache.attach(model, {"model.layers.0.self_attn": lambda role, t: t})
    with pytest.raises(ImportError, match="^from_compressed_tensors needs transformers"):
        Calibration.from_compressed_tensors(tmp_path / "float")
    installed(compressed_tensors="0.12.2")
    with pytest.raises(ImportError, match="^export to compressed-tensors needs "
                                          "compressed-tensors >= 0.19, found 0.12.2"):
        calib.export(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
