"""compat ``imatrix_mse`` / ``nvfp4_expanded_imatrix`` and the ``quantscope_imatrix_mse`` plugin
where a read-only probe (llmc2) found them differ from llm-compressor 0.14 or from the other
quantscope observers: the NVFP4 global scale of half-precision weights, ``tensor_group``
without importance, non-finite weights, the plugin's fallback options, float ``patience``,
``expand`` checks, and bfloat16 candidates priced as emitted. Runs in the peers' venv."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.peers

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs
from llmcompressor.observers import Observer as TheirObserver

import quantscope.integrations.llmcompressor  # noqa: F401  (registers quantscope_*)
from quantscope.compat import llmcompressor as lc

NVFP4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
         "group_size": 16}
INT4_ASYM = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
             "group_size": 16}
INT4_SYM = {**INT4_ASYM, "symmetric": True}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _observer(impl, name, fields, **kwargs):
    return impl.load_from_registry(name, base_name="weight", args=QuantizationArgs(
        **fields, observer_kwargs=kwargs))


def _observe(obs, lin, x=None):
    """Attach ``obs`` to ``lin``, run ``x`` through it (None: no importance), observe."""
    obs.attach(lin)
    if x is not None:
        lin(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning
        obs(lin.weight)
    obs.detach(lin)
    return obs


def _linear(seed, rows=16, cols=64, dtype=torch.float32, scale=0.05):
    lin = torch.nn.Linear(cols, rows, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(rows, cols, generator=_gen(seed)) * scale)
    return lin.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["imatrix_mse", "nvfp4_expanded_imatrix"])
def test_imatrix_global_scale_in_the_weight_dtype(dtype, name):
    # item 1: the importance sums (float32, int64) promoted the global scale's dtype to float32
    lin = _linear(0, 8, 64, dtype, scale=0.37)
    x = torch.randn(3, 64, generator=_gen(1)).to(dtype)
    theirs = _observe(_observer(TheirObserver, name, NVFP4), lin, x)
    ranges = theirs.min_vals.clone(), theirs.max_vals.clone()
    ours = _observe(_observer(lc.Observer, name, NVFP4), lin, x)
    ours.min_vals, ours.max_vals = ranges  # the very same statistics
    expected = theirs.get_qparams()["global_scale"]
    assert torch.equal(ours.get_qparams()["global_scale"], expected)


@pytest.mark.parametrize("name", ["imatrix_mse", "nvfp4_expanded_imatrix"])
@pytest.mark.parametrize("module", ["none", "embedding"])
def test_tensor_group_without_importance_falls_back_as_llmcompressor(name, module):
    # item 2: without attach (or on a module without in_features) get_qparams crashed
    w = torch.randn(8, 64, generator=_gen(2))
    qps = []
    for impl in (TheirObserver, lc.Observer):
        obs = _observer(impl, name, NVFP4)
        if module == "embedding":
            obs.attach(torch.nn.Embedding(10, 64))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obs(w)
        qps.append(obs.get_qparams())
    for key in ("scale", "zero_point", "global_scale"):
        assert torch.equal(qps[0][key], qps[1][key]), key


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("fields", [NVFP4, INT4_ASYM], ids=["nvfp4", "int4-asym"])
@pytest.mark.parametrize("importance", [True, False], ids=["weighted", "fallback"])
def test_plugin_imatrix_refuses_non_finite_weights(bad, fields, importance):
    # item 3: NaN / inf weights gave NaN / zero qparams silently
    lin = _linear(3)
    with torch.no_grad():
        lin.weight[1, 3] = bad
    obs = _observer(TheirObserver, "quantscope_imatrix_mse", fields)
    with pytest.raises(ValueError, match="Quantscope_imatrix_mse_Observer.*observed NaN or inf"):
        _observe(obs, lin, torch.randn(4, 64, generator=_gen(4)) if importance else None)


@pytest.mark.parametrize("kwargs", [{"maxshrink": 0.0}, {"expand": 0.5}, {"grid": 0.5},
                                    {"grid": 1.5, "maxshrink": 0.5}])
@pytest.mark.parametrize("fields", [INT4_SYM, INT4_ASYM, NVFP4], ids=["sym", "asym", "nvfp4"])
def test_plugin_fallback_takes_llmcompressor_options(kwargs, fields):
    # item 4: memoryless_mse refuses these grids; the fallback searches them as llm-compressor
    lin = _linear(5)
    theirs = _observe(_observer(TheirObserver, "imatrix_mse", fields, **kwargs), lin)
    ours = _observe(_observer(TheirObserver, "quantscope_imatrix_mse", fields, **kwargs), lin)
    assert torch.equal(ours.min_vals, theirs.min_vals)
    assert torch.equal(ours.max_vals, theirs.max_vals)
    mine, their = ours.get_qparams(), theirs.get_qparams()
    assert torch.equal(mine["scale"], their["scale"])


@pytest.mark.parametrize("impl,name", [(lc.Observer, "imatrix_mse"),
                                       (TheirObserver, "quantscope_imatrix_mse")])
@pytest.mark.parametrize("patience", [5.0, 4.5, 0.0])
@pytest.mark.parametrize("importance", [True, False], ids=["weighted", "fallback"])
def test_float_patience_as_llmcompressor(impl, name, patience, importance):
    # item 5: a float patience (a YAML recipe's 5.0) was refused at the first weight
    lin = _linear(6)
    x = torch.randn(4, 64, generator=_gen(7)) if importance else None
    theirs_name = name.removeprefix("quantscope_")
    theirs = _observe(_observer(TheirObserver, theirs_name, INT4_SYM, patience=patience), lin, x)
    ours = _observe(_observer(impl, name, INT4_SYM, patience=patience), lin, x)
    if impl is lc.Observer or importance:  # the plugin's fallback is quantscope's own search
        assert torch.equal(ours.min_vals, theirs.min_vals)
        assert torch.equal(ours.max_vals, theirs.max_vals)
    as_int = _observe(_observer(impl, name, INT4_SYM, patience=round(patience + 0.3)), lin, x)
    assert torch.equal(ours.max_vals, as_int.max_vals)


@pytest.mark.parametrize("impl,name", [(lc.Observer, "imatrix_mse"),
                                       (TheirObserver, "quantscope_imatrix_mse")])
@pytest.mark.parametrize("kwargs", [{"expand": 0.0}, {"expand": -1.0}, {"expand": float("inf")},
                                    {"norm": True}])
def test_meaningless_options_refused_when_made(impl, name, kwargs):
    # item 5: expand <= 0 was refused only at the first weight, by an internal function
    key = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"^{key} must be a finite positive number"):
        _observer(impl, name, INT4_SYM, **kwargs)


@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "minmax",
                                  "memoryless_mse", "mse", "nvfp4_expanded_mse",
                                  "imatrix_mse", "nvfp4_expanded_imatrix"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_compat_refuses_non_finite_at_qparams(name, bad):
    # item 7: an inf weight reached qparams_from_range, whose error named no observer; the
    # check runs at get_qparams, so forward reads nothing back
    lin = _linear(8)
    with torch.no_grad():
        lin.weight[2, 5] = bad
    obs = _observer(lc.Observer, name, INT4_SYM)
    cls = type(obs).__name__
    with pytest.raises(ValueError, match=f"{cls} \\('weight'\\): observed NaN or inf values"):
        _observe(obs, lin, torch.randn(2, 64, generator=_gen(9)))
    act_name = "memoryless_mse" if "imatrix" in name else name  # imatrix: weights only
    act = lc.Observer.load_from_registry(act_name, base_name="input",
                                         args=QuantizationArgs(num_bits=8, strategy="tensor"))
    x = torch.randn(2, 3, 64, generator=_gen(10))
    x[0, 1, 2] = bad
    act(x)
    if not act_name.startswith(("memoryless", "nvfp4")):  # a later batch does not hide it
        act(torch.randn(2, 3, 64, generator=_gen(11)))  # (memoryless: it replaces the batch)
    with pytest.raises(ValueError, match="\\('input'\\): observed NaN or inf values"):
        act.get_qparams()
