"""KV-cache scales in a compressed-tensors folder (probe s14/kvcache): the export refuses a
KV cache calibrated on some attention modules only, and the reader refuses a dynamic
``kv_cache_scheme`` and k_scale / v_scale on a module that is no attention."""

import pytest
import torch

from quantscope.calibration import Calibration, Recipe, calibrate

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from ct_folders import edited, kv_only_export
from tiny_models import llama

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def kv_only(tmp_path_factory):
    return kv_only_export(tmp_path_factory.mktemp("ct") / "kv")


def test_a_kv_cache_on_some_attention_layers_only_is_refused(tmp_path):
    # it wrote layer 0's scales only under a kv_cache_scheme that compressed-tensors applies
    # to every attention: layer 1 loaded with an uninitialised k_scale (logits 0.3 off)
    model, batches = llama()
    calib = calibrate(model, batches,
                      Recipe((), ignore=["model.layers.1.self_attn"], kv_cache="fp8"),
                      progress=False)
    assert set(calib.states) == {"model.layers.0.self_attn"}
    with pytest.raises(ValueError, match=r"attention modules \['model\.layers\.1\.self_attn'\] "
                                         r"have no KV-cache scales.*all attention layers or "
                                         r"of none"):
        calib.export(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [True, False], ids=["with-scales", "without-scales"])
def test_a_dynamic_kv_cache_scheme_is_refused(kv_only, tmp_path, keep):
    # it read as static: stored scales passed for calibrated ones, or (none) a kv_cache
    # Role without states, apply() leaving the cache float without a word
    def drop(t):
        for k in [k for k in t if k.endswith(("k_scale", "v_scale"))]:
            t.pop(k)

    folder = edited(kv_only, tmp_path / "dyn", None if keep else drop,
                    lambda qc: qc["kv_cache_scheme"].__setitem__("dynamic", True))
    with pytest.raises(ValueError, match=r"kv_cache_scheme\.dynamic is true: quantscope's KV "
                                         r"cache supports static scales only"):
        Calibration.from_compressed_tensors(folder)


def test_a_per_head_kv_cache_scheme_is_refused_naming_the_strategy(kv_only, tmp_path):
    # llm-compressor's attn_head KV cache ([heads, 1, 1] scales): the read named a misshapen
    # tensor, as if the folder were damaged
    def per_head(t):
        for k in [k for k in t if k.endswith(("k_scale", "v_scale"))]:
            t[k] = t[k].reshape(1, 1, 1).expand(2, 1, 1).clone()

    folder = edited(kv_only, tmp_path / "head", per_head,
                    lambda qc: qc["kv_cache_scheme"].__setitem__("strategy", "attn_head"))
    with pytest.raises(ValueError, match=r"kv_cache_scheme\.strategy is \"attn_head\": "
                                         r"quantscope's KV cache has one scale per tensor"):
        Calibration.from_compressed_tensors(folder)


_MLP = "model.layers.0.mlp"


@pytest.mark.parametrize("leaves", [("k_scale", "v_scale"), ("k_scale",)],
                         ids=["pair", "lone-k"])
def test_kv_scales_on_a_module_that_is_no_attention_are_refused(kv_only, tmp_path, leaves):
    # the pair read as the mlp's key / value states (apply() failed later); a lone k_scale
    # was refused as "has no v_scale", which names the wrong problem
    def add(t):
        for leaf in leaves:
            t[f"{_MLP}.{leaf}"] = torch.tensor([0.01])

    folder = edited(kv_only, tmp_path / "mlp", add)
    with pytest.raises(ValueError, match=rf"'{_MLP}\.k_scale' is on {_MLP} \(LlamaMLP\), "
                                         rf"which is no cached attention module: k_scale / "
                                         rf"v_scale belong to attention modules"):
        Calibration.from_compressed_tensors(folder)


def test_the_fixed_checks_leave_a_whole_kv_cache_export_readable(kv_only):
    back = Calibration.from_compressed_tensors(kv_only)
    assert set(back.states) == {f"model.layers.{i}.self_attn" for i in range(2)}
    assert back.recipe.kv_cache.dynamic is False


def test_a_folder_with_kv_scales_on_some_attention_layers_only_is_refused(kv_only, tmp_path):
    # read without a word: apply() kept layer 1's cache in float where the runtime quantizes
    # it with the one kv_cache_scheme (and an uninitialised or 1.0 scale)
    folder = edited(kv_only, tmp_path / "partial", lambda t: [
        t.pop(f"model.layers.1.self_attn.{leaf}") for leaf in ("k_scale", "v_scale")])
    with pytest.raises(ValueError, match=r"attention modules \['model\.layers\.1\.self_attn'\] "
                                         r"have no k_scale / v_scale"):
        Calibration.from_compressed_tensors(folder)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_an_integer_kv_cache_is_refused(tmp_path, fmt):
    # probe s32: it was written as an int kv_cache_scheme; vLLM's cache is fp8 (int4 refused
    # at load, int8 run as fp8 on int8's amax / 127.5 scales, not what apply() simulated)
    from quantscope import QuantSpec
    from quantscope.calibration import Role
    from quantscope.layout import Tensor

    model, batches = llama()
    calib = calibrate(model, batches, Recipe((), kv_cache=Role(QuantSpec(fmt, Tensor()),
                                                                 "minmax")), progress=False)
    with pytest.raises(ValueError, match=f"key: {fmt} tensor sym .* fp8 KV cache scale"):
        calib.export(model, tmp_path / "kv")
    assert not (tmp_path / "kv").exists()
