"""Fixes of the s55 review in the llm-compressor plugin (``quantscope_<name>``): a bad
``observer_kwargs`` value is refused in the recipe's words as an unknown key is, and an
observer whose state went to the meta device (``model_free_ptq``'s estimate) observes real
data afterwards, as llm-compressor's own do. Runs in the peers' venv."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.peers

llmc = pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs
from llmcompressor.observers import Observer

import quantscope.integrations.llmcompressor  # noqa: F401  (registers quantscope_<name>)

torch.set_num_threads(1)

WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}


@pytest.mark.parametrize("name, kwargs, error, said", [
    ("quantscope_histogram", {"bins": -1}, ValueError, "bins must be an integer in [16, "),
    ("quantscope_static_minmax", {"non_finite": "propagate"}, ValueError,
     "non_finite must be one of ('error', 'ignore'), got 'propagate'"),
    ("quantscope_minmax", {"averaging_constant": 2.0}, ValueError,
     "averaging_constant must be a finite number in (0, 1], got 2.0"),
    ("quantscope_mse", {"expand": 0.5}, ValueError, "expand value must be at least 1.0, got 0.5"),
    ("quantscope_static_minmax", {"bogus": 1}, TypeError, "unexpected keyword argument 'bogus'"),
])
def test_a_bad_observer_kwargs_value_names_the_observer_and_the_recipe(name, kwargs, error,
                                                                        said):
    # a ValueError of the quantscope observer's own checks named its class (L2HistogramObserver
    # for quantscope_histogram), neither the name the recipe wrote nor the recipe's fields
    args = QuantizationArgs(**WEIGHTS, observer_kwargs=kwargs)
    with pytest.raises(error) as e:
        Observer.load_from_registry(name, base_name="weight", args=args)
    text = str(e.value)
    assert type(e.value) is error
    assert text.startswith(f"observer {name} for weights {{num_bits: 8, type: int, "
                           f"symmetric: true, strategy: channel}} with observer_kwargs "
                           f"{kwargs}: "), text
    assert said in text  # the observer's own message after it
    assert isinstance(e.value.__cause__, error)  # chained, not hidden


@pytest.mark.parametrize("base_name, preset", [("weight", "W4A16"), ("weight", "MXFP4A16"),
                                               ("weight", "NVFP4A16"), ("input", "FP8")])
@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "quantscope_mse",
                                  "quantscope_histogram"])
def test_an_observer_read_on_meta_then_fed_real_data_gives_the_datas_qparams(name, base_name,
                                                                              preset):
    # model_free_ptq's estimate leaves an observer whose state went to meta; fed a real tensor
    # after get_qparams every quantscope_* name raised "Cannot copy out of meta tensor", where
    # llm-compressor's own give the real data's qparams on its device
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    role = "weights" if base_name == "weight" else "input_activations"
    shape = (64, 128) if base_name == "weight" else (2, 8, 128)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).half()

    def observer():
        args = PRESET_SCHEMES[preset][role].model_copy(deep=True)
        return Observer.load_from_registry(
            name if name.startswith("quantscope_") else f"quantscope_{name}",
            base_name=base_name, args=args)

    fresh, reused = observer(), observer()
    reused(torch.empty(shape, dtype=torch.float16, device="meta"))
    assert reused.get_qparams()["scale"].is_meta
    reused(x)
    got, want = reused.get_qparams(), fresh(x).get_qparams()
    assert not got["scale"].is_meta and got["scale"].device == x.device
    for key, value in want.items():
        assert (got[key] is None) if value is None else torch.equal(got[key], value), key
    if not name.startswith("quantscope_"):  # and llm-compressor's own min-max the same
        args = PRESET_SCHEMES[preset][role].model_copy(deep=True)
        theirs = Observer.load_from_registry(name, base_name=base_name, args=args)
        theirs(torch.empty(shape, dtype=torch.float16, device="meta"))
        theirs.get_qparams()
        assert torch.equal(theirs(x).get_qparams()["scale"], got["scale"])


def test_a_meta_state_fed_real_data_before_it_is_read_starts_afresh():
    # an activation observer whose meta batches were never read: llm-compressor's own mix
    # the devices and raise; quantscope's meta state holds no values, so it starts afresh
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    x = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(1))
    obs = [Observer.load_from_registry("quantscope_static_minmax", base_name="input",
                                       args=PRESET_SCHEMES["FP8"]["input_activations"]
                                       .model_copy(deep=True)) for _ in range(2)]
    obs[0](torch.empty(2, 8, 128, device="meta"))
    assert torch.equal(obs[0](x).get_qparams()["scale"], obs[1](x).get_qparams()["scale"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("preset, finite", [("MXFP4A16", [2.0 ** 126]),
                                            ("MXFP8A16", [2.0 ** 119, 2.0 ** 120])])
def test_bfloat16_and_float32_mx_blocks_from_1_75_times_2_127_as_documented(preset, finite,
                                                                            dtype):
    # the documented difference beside float16's from 57344 (pins the docs, no fix): their
    # power of two carries into the dtype's inf exponent; the compat classes keep a finite
    # E8M0 scale, the plugin (their rounding of its float32 range) their inf
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    from quantscope.compat import llmcompressor as lc

    w = torch.tensor([1.75 * 2.0 ** 127, 3.0e38, 3.3e38]).repeat_interleave(32).reshape(3, 32)

    def scale(registry, name):
        obs = registry.load_from_registry(
            name, base_name="weight", args=PRESET_SCHEMES[preset]["weights"].model_copy(deep=True))
        obs(w.to(dtype))
        return obs.get_qparams()["scale"].float().reshape(-1)

    theirs = scale(Observer, "memoryless_minmax")
    assert bool(theirs.isinf().all())
    assert torch.equal(scale(Observer, "quantscope_memoryless_minmax"), theirs)
    assert set(scale(lc.Observer, "memoryless_minmax").tolist()) <= set(finite)
