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


# ---------------------------------------------------------------- pins of the s62 mutation round
TENSOR_INPUT = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"}


def _pair(name, base_name, **fields):
    """llm-compressor's own observer ``name`` and the plugin's ``quantscope_<name>``."""
    return [Observer.load_from_registry(n, base_name=base_name, args=QuantizationArgs(**fields))
            for n in (name, f"quantscope_{name}")]


@pytest.mark.parametrize("fields, buffer", [
    ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}, 1.00),
    ({"num_bits": 8, "type": "float", "strategy": "channel"}, 0.30),
    ({"num_bits": 8, "type": "int", "strategy": "channel"}, 0.30),
])
@pytest.mark.parametrize("name", ["memoryless_mse", "mse"])
def test_mse_names_default_triton_error_buffer_as_llmcompressor(name, fields, buffer):
    """llm-compressor's MSE observers default ``triton_error_buffer`` (its CUDA search's
    patience) to 1.00 for fp4 and 0.30 otherwise; the plugin keeps the attribute, so it must
    hold the same default for the same args (and a given value as given)."""
    theirs, mine = _pair(name, "weight", symmetric=True, **fields)
    assert theirs.triton_error_buffer == buffer
    assert mine.triton_error_buffer == buffer
    given = QuantizationArgs(symmetric=True, observer_kwargs={"triton_error_buffer": 0.5},
                             **fields)
    mine = Observer.load_from_registry(f"quantscope_{name}", base_name="weight", args=given)
    assert mine.triton_error_buffer == 0.5


def test_an_empty_batch_is_ignored_as_llmcompressor_ignores_it():
    """llm-compressor's ``forward`` returns at once on an empty tensor: an empty bfloat16 batch
    after float32 data must not turn the memoryless range (the last batch's dtype) into
    bfloat16."""
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(2))
    empty = torch.empty(0, 4, 16, dtype=torch.bfloat16)
    want, got = [obs(x)(empty).get_qparams()["scale"]
                 for obs in _pair("memoryless_minmax", "input", **TENSOR_INPUT)]
    assert want.dtype == torch.float32
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax"])
def test_a_weight_observed_twice_keeps_its_first_statistics(name):
    """llm-compressor's ``forward`` skips a weight observer that has statistics (a weight is
    observed once; fused siblings may call it again): a second, wider weight must not move
    the qparams."""
    g = torch.Generator().manual_seed(3)
    w1, w2 = torch.randn(4, 16, generator=g), 3 * torch.randn(4, 16, generator=g)
    fields = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    first = _pair(name, "weight", **fields)[0](w1).get_qparams()["scale"]
    for obs in _pair(name, "weight", **fields):
        assert torch.equal(obs(w1)(w2).get_qparams()["scale"], first), obs


def test_a_batch_after_assigned_statistics_gives_its_own_memoryless_range():
    """A memoryless observer's range is its last batch's: statistics llm-compressor assigned
    before a batch are replaced by that batch's, as its own ``memoryless_minmax`` does."""
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(4))
    scales = []
    for obs in _pair("memoryless_minmax", "input", **TENSOR_INPUT):
        obs.min_vals, obs.max_vals = torch.tensor([-10.0]), torch.tensor([10.0])
        scales.append(obs(x).get_qparams()["scale"])
    assert torch.equal(scales[1], scales[0])
    assert torch.equal(scales[1], x.abs().max().reshape(1) / 127.5)


def test_integer_weights_get_scales_of_their_float32_values():
    """Integer tensors are observed as float32 (docs/guide/pipelines.md): the asymmetric int8
    scale of an int8 weight row is ``(max - min) / 255`` of its values in float32, not an
    int8 range (whose subtraction wraps)."""
    w = torch.tensor([[-100, 0, 27], [-3, 5, 120]], dtype=torch.int8)
    args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="channel")
    obs = Observer.load_from_registry("quantscope_memoryless_minmax", base_name="weight",
                                      args=args)
    scale = obs(w).get_qparams()["scale"]
    assert scale.dtype == torch.float32
    want = torch.tensor([[127.0], [123.0]]) / 255
    assert torch.allclose(scale.reshape(2, 1), want, rtol=1e-6, atol=0)


def test_one_assigned_statistic_is_not_statistics():
    """llm-compressor's ``has_statistics`` needs every statistic (``min_vals`` and
    ``max_vals``): one assigned alone is not enough, for its observers and the plugin's."""
    for obs in _pair("static_minmax", "input", **TENSOR_INPUT):
        obs.min_vals = torch.tensor([-1.0])
        assert not obs.has_statistics


def test_a_range_read_before_any_data_does_not_blame_nan():
    """Reading ``min_vals`` before any batch is the observer's "before any tensor was
    observed" error; only a NaN / inf seen is reported as "observed NaN or inf values"."""
    obs = Observer.load_from_registry("quantscope_static_minmax", base_name="input",
                                      args=QuantizationArgs(**TENSOR_INPUT))
    with pytest.raises(ValueError, match="before any tensor was observed") as e:
        obs.min_vals  # noqa: B018
    assert "NaN" not in str(e.value)


def test_statistics_deleted_after_qparams_forget_the_assigned_ones():
    """llm-compressor's ``get_qparams`` deletes the statistics it read: assigned ``min_vals`` /
    ``max_vals`` are gone afterwards, so the next weight observed gives its own qparams."""
    w = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    fields = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    scales = []
    for obs in _pair("static_minmax", "weight", **fields):
        obs.min_vals, obs.max_vals = torch.full((4, 1), -9.0), torch.full((4, 1), 9.0)
        obs.get_qparams()
        assert not obs.has_statistics
        scales.append(obs(w).get_qparams()["scale"])
    assert torch.equal(scales[1], scales[0])
    assert torch.equal(scales[1], w.abs().amax(1, keepdim=True) / 127.5)


def test_a_fused_weights_forward_observes_its_siblings():
    """llm-compressor's ``forward`` on a fused observer (q / k / v sharing an NVFP4 global
    scale) observes its siblings' weights too (``FusionHandler.get_fused_statistics``): after
    the first forward every observer of the group holds statistics, theirs and the plugin's."""
    from llmcompressor.observers.fusion import FusionHandler

    args = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group",
                            group_size=16)
    mods = [torch.nn.Linear(32, 16, bias=False) for _ in range(2)]
    for name in ("memoryless_minmax", "quantscope_memoryless_minmax"):
        obs = [Observer.load_from_registry(name, base_name="weight", args=args.model_copy())
               for _ in mods]
        FusionHandler.fuse(zip(obs, mods))
        obs[0](mods[0].weight)
        assert obs[1].has_statistics, name


def test_a_range_read_before_the_ddp_sync_is_not_kept_after_it():
    """``sync_activation_stats`` reduces the state across ranks; a range read before it
    (``min_vals`` mid-calibration) must not be served afterwards. The reduction is stood in
    for by the other rank's batch observed into the state (a MAX of maxima, a MIN of minima)."""
    g = torch.Generator().manual_seed(6)
    mine, other = torch.randn(2, 4, 16, generator=g), 4 * torch.randn(2, 4, 16, generator=g)
    obs = Observer.load_from_registry("quantscope_static_minmax", base_name="input",
                                      args=QuantizationArgs(**TENSOR_INPUT))
    obs(mine)
    assert torch.equal(obs.max_vals, mine.max().reshape(1))  # read (and kept) before the sync
    obs.quantscope.sync = lambda: obs.quantscope(other.reshape(1, -1))  # the reduction
    assert obs.sync_activation_stats() == []
    assert torch.equal(obs.max_vals, torch.maximum(mine.max(), other.max()).reshape(1))


def test_weight_observers_take_no_part_in_the_ddp_sync():
    """Weights are not synced (docs: every rank holds the same weights, and llm-compressor
    observes each weight on one rank): a weight observer's ``sync_activation_stats`` runs no
    reduction and returns no handles."""
    fields = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    obs = Observer.load_from_registry("quantscope_static_minmax", base_name="weight",
                                      args=QuantizationArgs(**fields))
    obs(torch.randn(4, 16, generator=torch.Generator().manual_seed(7)))
    calls = []
    obs.quantscope.sync = lambda: calls.append(1)
    assert obs.sync_activation_stats() == [] and calls == []


def test_imatrix_fallback_searches_with_the_norm_given():
    """Without importance ``quantscope_imatrix_mse`` falls back to ``quantscope_memoryless_mse``'s
    search over its own grid with the ``norm`` given in ``observer_kwargs``
    (docs/guide/pipelines.md): its scales are memoryless_mse's with that norm, which on this
    weight (one large column) are not the default norm 2's."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(8, 64, generator=g)
    w[:, 0] *= 8
    options = {"maxshrink": 0.95, "grid": 20, "patience": 5}
    fields = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}

    def scale(name, norm):
        args = QuantizationArgs(**fields, observer_kwargs={**options, "norm": norm})
        obs = Observer.load_from_registry(name, base_name="weight", args=args)
        return obs(w).get_qparams()["scale"]

    with pytest.warns(UserWarning, match="Falling back to uniform MSE"):
        fallback = scale("quantscope_imatrix_mse", 1.0)
    assert torch.equal(fallback, scale("quantscope_memoryless_mse", 1.0))
    assert not torch.equal(fallback, scale("quantscope_memoryless_mse", 2.0))


def test_the_placeholder_is_not_offered_to_recipes():
    """Every native observer is registered but ``placeholder``, which observes nothing
    (docs/guide/pipelines.md): no ``quantscope_placeholder`` name, listed or registered."""
    from compressed_tensors.registry.registry import standardize_lookup_name

    from quantscope.integrations.llmcompressor import observer_names

    assert "quantscope_placeholder" not in observer_names()
    assert standardize_lookup_name("quantscope_placeholder") not in Observer.registered_names()
