"""Fixes of the s54 integrations probe in the llm-compressor plugin (``quantscope_<name>``):
MX (E8M0) block scales on float16 models (the float32 power of two cast to float16 flushed
zero and tiny blocks' scales to 0: NaN in the quantized model, +-6 in the checkpoint), the
meta-device pass of ``model_free_ptq``'s memory estimate, and errors in the recipe's words.
Runs in the peers' venv."""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch

pytestmark = pytest.mark.peers

llmc = pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.observers import Observer
from test_integrations_llmcompressor import _llama, _loader, _tokenizer

import quantscope.integrations.llmcompressor as qsl
from quantscope.compat import llmcompressor as lc

torch.set_num_threads(1)

MX = ["MXFP4A16", "MXFP8A16"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
#: float16's subnormal amaxes 1.5 * 2**-15 and up carry into its smallest normal, 2**-14
CARRY = 1.5 * 2.0 ** -15


def _amaxes(dtype) -> list[float]:
    """Block maxima: zero, below float16's subnormals, every float16 subnormal, around its
    smallest normal, normals (float16's up to 57000: its scale past that, below)."""
    top = [57000.0] if dtype == torch.float16 else [57344.0, 65504.0, 1e10, 1e30]
    return ([0.0, 1e-30, 2.0 ** -130, 2.0 ** -126, 2.0 ** -25, 2.0 ** -24]
            + [m * 2.0 ** -24 for m in range(1, 1024)]
            + [2.0 ** -14 * (1 + k / 16) for k in range(16)]
            + [1e-5, 6e-5, 1e-3, 0.02, 1.0, 1.74, 1.75, 1.76, 3.0, 1000.0] + top)


def _blocks(dtype, amaxes) -> torch.Tensor:
    """One 32-element block per amax, ``-amax .. amax``."""
    return (torch.linspace(-1, 1, 32) * torch.tensor(amaxes, dtype=torch.float64)[:, None]).to(
        dtype)


def _scale(name, preset, w, registry=Observer):
    obs = registry.load_from_registry(name, base_name="weight",
                                      args=PRESET_SCHEMES[preset]["weights"].model_copy(deep=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # imatrix_mse without importance falls back, warning
        obs(w)
        return obs.get_qparams()["scale"]


# ------------------------------------------------------------------ MX on float16 models
@pytest.mark.parametrize("kind", ["memoryless_minmax", "static_minmax"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preset", MX)
def test_mx_block_scales_equal_llmcompressor_in_every_dtype(preset, dtype, kind):
    # float16: zero blocks and those below 2**-22 (fp4) / 2**-16 (fp8) got scale 0, the other
    # subnormal-amax blocks float32's power of two where compressed-tensors' is 1 (its
    # rounding keeps float16's exponent bits: 0 for a subnormal, 2**-14 from 1.5 * 2**-15)
    w = _blocks(dtype, _amaxes(dtype))
    theirs, ours = _scale(kind, preset, w), _scale(f"quantscope_{kind}", preset, w)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs)
    assert bool((ours > 0).all())


@pytest.mark.parametrize("preset", MX)
def test_float16_mx_blocks_past_57344_keep_their_finite_scale(preset):
    # known difference: compressed-tensors' float16 rounding of 1.75 * 2**15 .. 65504 carries
    # into float16's inf exponent (an inf scale: NaN after fake quantization); quantscope's is
    # the float32 power of two, 2**16 scaled into the element format
    w = _blocks(torch.float16, [57344.0, 65504.0])
    theirs, ours = _scale("memoryless_minmax", preset, w), _scale(
        "quantscope_memoryless_minmax", preset, w)
    assert bool(theirs.isinf().all())
    assert torch.equal(ours.float(), torch.full_like(ours, 2.0 ** (16 - (2 if "FP4" in preset
                                                                        else 8))).float())


@pytest.mark.parametrize("preset", MX)
def test_every_name_gives_llmcompressors_scale_on_zero_and_tiny_float16_blocks(preset):
    # every quantscope_* name went through the same cast (scale 0); a block below
    # 1.5 * 2**-15 has compressed-tensors' scale 1 on float16 (these stay below it searched:
    # pow2_mse's range reaches 4x the amax, fouroversix's 1.8x)
    tiny = [0.0, 2e-7, 1e-5]
    w = torch.cat([_blocks(torch.float16, tiny),
                   torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).half()])
    for name in qsl.observer_names():
        scale = _scale(name, preset, w)
        assert scale.dtype == torch.float16, name
        assert bool((scale > 0).all()), name
        assert bool((scale[:len(tiny)] == 1).all()), (name, scale[:len(tiny)])


#: bfloat16 / float32 subnormal block amaxes (float16 reads them as 0)
SUBNORMAL32 = [2.0 ** -149, 2.0 ** -140, 2.0 ** -133, 2.0 ** -129, 1.5 * 2.0 ** -127,
               1.75 * 2.0 ** -127, 1.9 * 2.0 ** -127]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preset", MX)
def test_compat_mx_block_scales_equal_llmcompressor_below_the_normal_amaxes(preset, dtype):
    # compat.llmcompressor gave float32's power of two where compressed-tensors' float16 is 1
    # (MXFP8 on amaxes the dtype holds as normal numbers: the documented e4m3-mantissa
    # rounding, not compared here: MXFP8 takes those below the dtype's smallest normal)
    amaxes = [a for a in _amaxes(dtype) + SUBNORMAL32
              if a < torch.finfo(dtype).tiny or preset == "MXFP4A16"]
    w = _blocks(dtype, amaxes)
    ours = _scale("memoryless_minmax", preset, w, registry=lc.Observer)
    assert torch.equal(ours, _scale("memoryless_minmax", preset, w))


def test_compat_mse_prices_float16_mx_candidates_as_llmcompressor():
    # the search's candidate scales: float32's power of two (2**-24 .. ) where theirs is 1
    g = torch.Generator().manual_seed(0)
    w = torch.cat([torch.randn(1, 64, generator=g) * 2.0 ** e for e in range(-30, 2)]).half()
    for name in ("memoryless_mse", "mse"):
        ours = _scale(name, "MXFP4A16", w, registry=lc.Observer)
        assert torch.equal(ours, _scale(name, "MXFP4A16", w)), name


def test_oneshot_mxfp4_float16_model_is_llmcompressors_and_finite(tmp_path):
    # q_proj blocks of zeros and of +-2e-7: scale 0 made q_proj's output and the logits NaN,
    # and the checkpoint dequantized the tiny block to +-6
    from transformers import LlamaForCausalLM

    cls = _llama(tmp_path / "llama")
    model = cls.from_pretrained(tmp_path / "llama")
    with torch.no_grad():
        q = model.model.layers[0].self_attn.q_proj.weight
        q[0, :32], q[1, :32] = 0.0, torch.linspace(-2e-7, 2e-7, 32)
    model.save_pretrained(tmp_path / "tiny")
    runs, ids = {}, torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    for obs in ("memoryless_minmax", "quantscope_memoryless_minmax"):
        m = LlamaForCausalLM.from_pretrained(tmp_path / "tiny", dtype=torch.float16,
                                             attn_implementation="eager")
        oneshot(model=m, recipe=QuantizationModifier(
            targets="Linear", scheme="MXFP4A16", ignore=["lm_head"], weight_observer=obs),
            dataset=_loader(), processor=_tokenizer())
        with torch.no_grad():
            assert bool(m(ids).logits.isfinite().all()), obs
        runs[obs] = {n: p.detach().clone() for n, p in m.named_parameters()
                     if n.endswith("weight_scale")}
    ours, theirs = runs["quantscope_memoryless_minmax"], runs["memoryless_minmax"]
    assert ours.keys() == theirs.keys() and ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert ours["model.layers.0.self_attn.q_proj.weight_scale"][:2, 0].tolist() == [1.0, 1.0]


# ------------------------------------------------------------------ model_free_ptq's meta pass
META_SCHEMES = ["W4A16", "W4A16_ASYM", "FP8", "NVFP4A16", "MXFP4A16", "FP8_BLOCK"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("preset", META_SCHEMES)
def test_every_name_gives_meta_qparams_on_meta(preset, dtype):
    # quantscope_*'s get_qparams raised "its state is on the meta device"; llm-compressor's
    # own observers return meta qparams, which its memory estimate measures
    args = PRESET_SCHEMES[preset]["weights"]
    w = torch.empty(64, 128, device="meta", dtype=dtype)
    ref = Observer.load_from_registry("memoryless_minmax", base_name="weight",
                                      args=args.model_copy(deep=True))
    ref(w)
    want = ref.get_qparams()
    for name in qsl.observer_names():
        if name in ("quantscope_linear_mse", "quantscope_horizon_mse") and not args.symmetric:
            continue  # symmetric only
        obs = Observer.load_from_registry(name, base_name="weight",
                                          args=args.model_copy(deep=True))
        obs(w)
        got = obs.get_qparams()
        for key, value in want.items():
            if value is None:
                assert got[key] is None, (name, key)
                continue
            assert got[key].is_meta, (name, key)
            assert (got[key].shape, got[key].dtype) == (value.shape, value.dtype), (name, key)


@pytest.mark.parametrize("preset", ["W4A16_G32", "NVFP4A16"])
def test_model_free_ptq_estimates_memory_with_quantscope_names(tmp_path, preset):
    # the estimate failed (a traceback per shard, a 2.5x-size guess); NVFP4 runs the
    # microscale path, whose fused observers report their statistics on meta too
    from llmcompressor.entrypoints.model_free import model_free_ptq
    from loguru import logger

    _llama(tmp_path / "src")
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=32) if preset == "W4A16_G32" else \
        PRESET_SCHEMES[preset]["weights"].model_copy(deep=True)
    args.observer = "quantscope_mse"
    messages = []
    sink = logger.add(lambda m: messages.append(str(m)), level="WARNING")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            model_free_ptq(tmp_path / "src", tmp_path / "out", ignore=["lm_head"], device="cpu",
                           scheme=QuantizationScheme(targets=["Linear"], weights=args))
    finally:
        logger.remove(sink)
    assert "Traceback" not in err.getvalue()
    assert not [m for m in messages if "estimate memory" in m]
    assert list((tmp_path / "out").glob("*.safetensors"))


# ------------------------------------------------------------------ messages
def test_symmetric_only_search_names_the_recipe_and_the_names_to_use():
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group",
                            group_size=32)
    for name in ("quantscope_linear_mse", "quantscope_horizon_mse"):
        with pytest.raises(ValueError) as e:
            Observer.load_from_registry(name, base_name="weight", args=args.model_copy())
        text = str(e.value)
        assert name in text and "symmetric: false" in text and "group_size: 32" in text
        assert "quantscope_memoryless_mse" in text and "quantscope_mse" in text
        assert "channel:0" not in text


def test_nan_input_says_how_a_recipe_skips_it():
    x = torch.randn(1, 8, 64)
    x[0, 0, 0] = float("nan")
    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False)
    obs = Observer.load_from_registry("quantscope_static_minmax", base_name="input",
                                      args=args.model_copy())
    obs(x)
    with pytest.raises(ValueError, match="observed NaN or inf") as e:
        obs.get_qparams()
    text = str(e.value)
    assert "quantscope_static_minmax" in text and "input_activations" in text
    assert "observer_kwargs: {non_finite: ignore}" in text and "strategy: tensor" in text
    assert "channel:0" not in text and "construct" not in text
    # the advice works
    args.observer_kwargs = {"non_finite": "ignore"}
    obs = Observer.load_from_registry("quantscope_static_minmax", base_name="input", args=args)
    obs(x)
    with pytest.warns(UserWarning, match="ignored 1 NaN"):
        assert bool(obs.get_qparams()["scale"].isfinite().all())
