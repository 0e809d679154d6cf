"""``--model`` given a quantized checkpoint (its config.json has a ``quantization_config``: a
compressed-tensors export, GPTQ ...) is refused in one line naming the flag and the
``quant_method``, before torch is imported or a weight is read, by calibrate, compare,
evaluate and export alike (probe s42 f3: transformers loaded it decompressed, the model was
evaluated and calibrated, and the command failed late on an inference-tensor error, or in
export on the scale's float16 dtype)."""

import json
import subprocess
import sys

import pytest


def _quantized_folder(tmp_path, method):
    """A folder whose config.json says it is quantized (what --model reads before loading)."""
    model = tmp_path / f"model-{method}"
    model.mkdir()
    qc = {"quant_method": method, "format": "int-quantized", "config_groups": {}}
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                   "model_type": "llama",
                                                   "quantization_config": qc}))
    return str(model)


def _run_folder(tmp_path):
    """A folder that passes RUN's check (qparams/quantscope.json): loading it would fail."""
    (tmp_path / "run" / "qparams").mkdir(parents=True)
    (tmp_path / "run" / "qparams" / "quantscope.json").write_text("{}")
    return str(tmp_path / "run")


@pytest.mark.parametrize("method", ["compressed-tensors", "gptq"])
def test_a_quantized_checkpoint_as_model_is_refused_before_torch(tmp_path, method):
    model, run = _quantized_folder(tmp_path, method), _run_folder(tmp_path)
    argvs = [["calibrate", "--model", model, "--out", str(tmp_path / "c")],
             ["compare", "--model", model, "--out", str(tmp_path / "d")],
             ["evaluate", run, "--model", model],
             ["export", run, "--model", model, "--out", str(tmp_path / "e")]]
    code = ("import sys; from quantscope import cli\n"
            f"for argv in {argvs!r}:\n"
            "    assert cli.main(argv) == 2, argv\n"
            "    assert 'torch' not in sys.modules, ('torch imported', argv)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == len(argvs), err
    for line, argv in zip(err, argvs):
        assert line == (f"quantscope {argv[0]}: error: --model {model!r} is a quantized "
                        f"checkpoint ({model}/config.json has a quantization_config, "
                        f"quant_method {method!r}): its weights are stored as codes and "
                        f"scales, not float weights; give the float (unquantized) model it "
                        f"was made from"), line
