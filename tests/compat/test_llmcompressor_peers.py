"""compat.llmcompressor (0.14's API) and the registry classes quantscope_<name> against the
installed llm-compressor 0.14: the same calls on the same tensors give the same statistics,
qparams, attributes and errors. Runs in the peers' venv."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.peers

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from llmcompressor.observers import Observer as TheirObserver

import quantscope.integrations.llmcompressor  # noqa: F401  (registers quantscope_<name>)
from quantscope.compat import llmcompressor as lc


def _fields(**fields) -> dict:
    return fields


WEIGHT_ARGS = [
    _fields(num_bits=8, type="int", symmetric=True, strategy="tensor"),
    _fields(num_bits=8, type="int", symmetric=False, strategy="channel"),
    _fields(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16),
    _fields(num_bits=8, type="int", symmetric=True, strategy="tensor_group", group_size=16),
    _fields(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16),
    _fields(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[16, 16]),
]
INPUT_ARGS = [
    _fields(num_bits=8, type="int", symmetric=True, strategy="tensor"),
    _fields(num_bits=8, type="int", symmetric=False, strategy="tensor"),
    _fields(num_bits=8, type="float", symmetric=True, strategy="tensor"),
]
NAMES = ["memoryless_minmax", "static_minmax", "minmax", "memoryless_mse", "mse"]


def _pair(name, base, fields, ours=lc.Observer):
    theirs = TheirObserver.load_from_registry(name, base_name=base,
                                              args=QuantizationArgs(**fields))
    mine = ours.load_from_registry(name, base_name=base, args=QuantizationArgs(**fields))
    return mine, theirs


def _same_qparams(a, b, exact=True):
    for key in ("scale", "zero_point", "global_scale"):
        if b[key] is None:
            assert a[key] is None, key
            continue
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
        if exact:
            assert torch.equal(a[key].float(), b[key].float()), (key, a[key], b[key])
        else:
            assert torch.allclose(a[key].float(), b[key].float(), rtol=1e-5), key


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("fields", WEIGHT_ARGS, ids=lambda f: f"{f['strategy']}-{f['type']}")
def test_weights_as_llmcompressor(name, fields):
    torch.manual_seed(0)
    w = torch.randn(32, 48)
    mine, theirs = _pair(name, "weight", fields)
    assert mine(w) is mine and theirs(w) is theirs
    assert torch.equal(mine.min_vals, theirs.min_vals)
    assert torch.equal(mine.max_vals, theirs.max_vals)
    _same_qparams(mine.get_qparams(), theirs.get_qparams())
    assert mine.has_statistics == theirs.has_statistics is False


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("fields", INPUT_ARGS, ids=lambda f: f"{f['type']}-{f['symmetric']}")
def test_input_sequences_as_llmcompressor(name, fields):
    torch.manual_seed(1)
    mine, theirs = _pair(name, "input", fields)
    for i in range(3):
        x = torch.randn(2, 5, 32) * (i + 1)
        mine(x), theirs(x)
        assert torch.allclose(mine.min_vals, theirs.min_vals, rtol=1e-6)
        assert torch.allclose(mine.max_vals, theirs.max_vals, rtol=1e-6)
    _same_qparams(mine.get_qparams(), theirs.get_qparams(), exact=False)


@pytest.mark.parametrize("ours", [lc.Observer, TheirObserver], ids=["compat", "registry"])
@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "minmax"])
def test_integer_tensors(ours, name):
    prefix = "quantscope_" if ours is TheirObserver else ""
    fields = _fields(num_bits=8, type="int", symmetric=True, strategy="tensor")
    theirs = TheirObserver.load_from_registry(name, base_name="input",
                                              args=QuantizationArgs(**fields))
    mine = ours.load_from_registry(prefix + name, base_name="input",
                                   args=QuantizationArgs(**fields))
    for x in (torch.tensor([[[3, -7, 2]]]), torch.tensor([[[10, 1, -1]]])):
        mine(x), theirs(x)
    # the registry's EMA is quantscope's kernel (one rounding apart from llm-compressor's lerp)
    assert torch.allclose(mine.min_vals.float(), theirs.min_vals.float(), rtol=1e-6)
    assert torch.allclose(mine.max_vals.float(), theirs.max_vals.float(), rtol=1e-6)
    _same_qparams(mine.get_qparams(), theirs.get_qparams(), exact=prefix == "")


@pytest.mark.parametrize("prefix", ["", "quantscope_"])
def test_assigned_statistics(prefix):
    fields = _fields(num_bits=8, type="int", symmetric=True, strategy="tensor_group", group_size=4)
    ours = lc.Observer if not prefix else TheirObserver
    mine = ours.load_from_registry(prefix + "static_minmax", base_name="weight",
                                   args=QuantizationArgs(**fields))
    theirs = TheirObserver.load_from_registry("static_minmax", base_name="weight",
                                              args=QuantizationArgs(**fields))
    for obs in (mine, theirs):
        obs.min_vals = torch.tensor([[-5.0, -1.0]])
        obs.max_vals = torch.tensor([[5.0, 0.5]])
    _same_qparams(mine.get_qparams(), theirs.get_qparams())


@pytest.mark.parametrize("name", ["static_minmax", "minmax", "mse", "histogram"])
def test_registry_statistics_never_written_in_place(name):
    obs = TheirObserver.load_from_registry(
        "quantscope_" + name, base_name="input",
        args=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor"))
    obs(torch.tensor([[[0.0, 1.0]]]))
    lo, hi = obs.min_vals, obs.max_vals
    kept = lo.clone(), hi.clone()
    obs(torch.tensor([[[-30.0, 50.0]]]))
    assert torch.equal(lo, kept[0]) and torch.equal(hi, kept[1])
    assert obs.max_vals.item() > kept[1].item() or name == "histogram"


@pytest.mark.parametrize("name,expected", [("static_minmax", ["MIN", "MAX"]),
                                           ("minmax", ["AVG", "AVG"])])
def test_registry_assigned_statistics_sync_as_llmcompressor(monkeypatch, name, expected):
    calls = []
    monkeypatch.setattr("llmcompressor.observers.base.dist.all_reduce",
                        lambda t, op, async_op: calls.append(op) or "handle")
    obs = TheirObserver.load_from_registry(
        "quantscope_" + name, base_name="input",
        args=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor"))
    obs.min_vals, obs.max_vals = torch.tensor([-1.0]), torch.tensor([1.0])
    assert obs.sync_activation_stats() == ["handle", "handle"]
    assert [op.name if hasattr(op, "name") else str(op).split(".")[-1] for op in calls] == \
        expected


#: compressed-tensors' presets with a static scheme (MXFP8's E8M0 scales round the amax with
#: fp4's one mantissa bit in compressed-tensors, with e4m3's three in quantscope: see
#: quantscope.scales)
PRESETS = sorted(set(PRESET_SCHEMES) - {"UNQUANTIZED", "MXFP8", "MXFP8A16"})


@pytest.mark.parametrize("name", NAMES + ["nvfp4_expanded_mse"])
@pytest.mark.parametrize("preset", PRESETS)
def test_presets_on_float32_weights_as_llmcompressor(preset, name):
    """Every preset's weight args, every observer: the same qparams bit for bit (MX
    searches price E8M0 scales as encoded, as llm-compressor does)."""
    args = preset_name_to_scheme(preset, ["Linear"]).weights
    torch.manual_seed(0)
    w = torch.randn(128, 256) * 0.05
    mine, theirs = _pair(name, "weight", args.model_dump())
    mine(w), theirs(w)
    _same_qparams(mine.get_qparams(), theirs.get_qparams())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("preset", PRESETS)
def test_presets_on_low_precision_weights_within_one_rounding(preset, dtype):
    """bfloat16 / float16 min-max: the same dtypes (NVFP4's scales float32, as
    compressed-tensors' product with its float32 global scale); values within what
    computing in float32 and rounding once (quantscope) instead of rounding after each
    operation in the weight's dtype (compressed-tensors) can move: one unit in the last
    place of the dtype, one fp8 step of an NVFP4 block scale, one zero-point code."""
    args = preset_name_to_scheme(preset, ["Linear"]).weights
    torch.manual_seed(0)
    w = (torch.randn(128, 256) * 0.05).to(dtype)
    mine, theirs = _pair("memoryless_minmax", "weight", args.model_dump())
    mine(w), theirs(w)
    assert mine.min_vals.dtype == theirs.min_vals.dtype == dtype  # their statistics' dtype
    assert torch.equal(mine.min_vals, theirs.min_vals)
    a, b = mine.get_qparams(), theirs.get_qparams()
    for key in ("scale", "zero_point", "global_scale"):
        assert (a[key] is None) == (b[key] is None), key
        if a[key] is not None:
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
    eps = torch.finfo(dtype).eps
    fp8_block = args.strategy == "tensor_group"
    rel = ((a["scale"].double() - b["scale"].double()).abs() / b["scale"].double()).max()
    assert rel <= (2 ** -3 if fp8_block else eps)
    assert (a["zero_point"].float() - b["zero_point"].float()).abs().max() <= 1
    if fp8_block:
        assert abs(a["global_scale"].item() / b["global_scale"].item() - 1) <= eps
    if args.symmetric and args.type == "int":  # one division: the same rounding
        _same_qparams(a, b)


@pytest.mark.parametrize("prefix", ["", "quantscope_"])
def test_mse_attributes_and_errors(prefix):
    ours = lc.Observer if not prefix else TheirObserver
    for fields in WEIGHT_ARGS:
        args = QuantizationArgs(**fields)
        mine = ours.load_from_registry(prefix + "memoryless_mse", base_name="weight", args=args)
        theirs = TheirObserver.load_from_registry("memoryless_mse", base_name="weight",
                                                  args=QuantizationArgs(**fields))
        assert mine.triton_error_buffer == theirs.triton_error_buffer
    for impl in (ours, TheirObserver):
        name = prefix + "mse" if impl is ours else "mse"
        with pytest.raises(ValueError, match=r"expand value must be at least 1.0, got 0.9"):
            impl.load_from_registry(name, base_name="weight", args=QuantizationArgs(
                num_bits=8, observer_kwargs={"expand": 0.9}))


# --------------------------------------------------------------------------- imatrix
def _imatrix_pair(prefix, module, **kwargs):
    ours = lc.Observer if not prefix else TheirObserver
    made = []
    for impl, name in ((ours, prefix + "imatrix_mse"), (TheirObserver, "imatrix_mse")):
        obs = impl.load_from_registry(name, base_name="weight", args=QuantizationArgs(
            num_bits=4, symmetric=True, strategy="group", group_size=8,
            observer_kwargs=dict(kwargs)))
        obs.attach(module)
        made.append(obs)
    return made


@pytest.mark.parametrize("prefix", ["", "quantscope_"])
def test_imatrix_collects_and_searches_as_llmcompressor(prefix):
    torch.manual_seed(2)
    lin = torch.nn.Linear(32, 16)
    mine, theirs = _imatrix_pair(prefix, lin)
    lin(torch.randn(4, 6, 32) * torch.linspace(0.1, 5, 32))
    assert torch.equal(mine._imatrix_sum, theirs._imatrix_sum)
    assert torch.equal(mine._imatrix_count, theirs._imatrix_count)
    mine(lin.weight), theirs(lin.weight)
    assert torch.allclose(mine.min_vals.float(), theirs.min_vals.float(), rtol=1e-6)
    assert torch.allclose(mine.max_vals.float(), theirs.max_vals.float(), rtol=1e-6)
    _same_qparams(mine.get_qparams(), theirs.get_qparams(), exact=False)
    assert not hasattr(mine, "_imatrix_sum") and not hasattr(theirs, "_imatrix_sum")


@pytest.mark.parametrize("prefix", ["", "quantscope_"])
@pytest.mark.parametrize("kwargs", [{"norm": float("inf")}, {"norm": 0}, {"grid": 0},
                                    {"patience": -1}, {"maxshrink": 1.5}])
def test_imatrix_options_refused_as_llmcompressor(prefix, kwargs):
    with pytest.raises(ValueError) as theirs:
        TheirObserver.load_from_registry(
            "imatrix_mse", base_name="weight",
            args=QuantizationArgs(num_bits=4, strategy="channel", observer_kwargs=kwargs))
    ours = lc.Observer if not prefix else TheirObserver
    with pytest.raises(ValueError) as mine:
        ours.load_from_registry(prefix + "imatrix_mse", base_name="weight",
                                args=QuantizationArgs(num_bits=4, strategy="channel",
                                                      observer_kwargs=kwargs))
    assert str(mine.value) == str(theirs.value)


@pytest.mark.parametrize("prefix", ["", "quantscope_"])
def test_imatrix_strict_errors_as_llmcompressor(prefix):
    lin = torch.nn.Linear(16, 4)
    for obs in _imatrix_pair(prefix, lin, strict=True):
        with pytest.raises(ValueError, match="imatrix_mse: no importance data available"):
            obs(lin.weight)
    ours = lc.Observer if not prefix else TheirObserver
    for impl, name in ((ours, prefix + "imatrix_mse"), (TheirObserver, "imatrix_mse")):
        obs = impl.load_from_registry(name, base_name="input", args=QuantizationArgs(
            num_bits=8, strategy="tensor", observer_kwargs={"strict": True}))
        with pytest.raises(NotImplementedError, match="only supported for weight observers"):
            obs(torch.randn(2, 1, 8))


@pytest.mark.parametrize("fields", [WEIGHT_ARGS[1], WEIGHT_ARGS[2], WEIGHT_ARGS[4]],
                         ids=["int8-channel", "int4-group", "nvfp4"])
@pytest.mark.parametrize("importance", [None, torch.tensor([1.0, -1.0] * 16), torch.zeros(32)],
                         ids=["none", "negative", "zeros"])
def test_registry_imatrix_falls_back_to_quantscope_memoryless_mse(fields, importance):
    # "falls back to uniform MSE": the registry's own MSE search over the imatrix's grid
    torch.manual_seed(5)
    lin = torch.nn.Linear(32, 16)
    grid = {"maxshrink": 0.95, "grid": 20, "patience": 5, "expand": 1.0}  # imatrix defaults
    imatrix = TheirObserver.load_from_registry(
        "quantscope_imatrix_mse", base_name="weight", args=QuantizationArgs(**fields))
    imatrix.attach(lin)
    if importance is not None:
        imatrix._imatrix_sum, imatrix._imatrix_count = importance.clone(), torch.tensor(1)
    uniform = TheirObserver.load_from_registry(
        "quantscope_memoryless_mse", base_name="weight",
        args=QuantizationArgs(**fields, observer_kwargs=grid))
    with pytest.warns(UserWarning, match="Falling back to uniform MSE"):
        imatrix(lin.weight)
    uniform(lin.weight)
    assert torch.equal(imatrix.min_vals, uniform.min_vals)
    assert torch.equal(imatrix.max_vals, uniform.max_vals)
    uniform_max = uniform.max_vals
    _same_qparams(imatrix.get_qparams(), uniform.get_qparams())
    imatrix.detach(lin)
    weighted = TheirObserver.load_from_registry(  # valid importance: the weighted search
        "quantscope_imatrix_mse", base_name="weight", args=QuantizationArgs(**fields))
    weighted.attach(lin)
    lin(torch.randn(64, 32) * torch.linspace(0.01, 10, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        weighted(lin.weight)
    assert weighted._global_amax is None and weighted.max_vals.shape == uniform_max.shape


@pytest.mark.parametrize("name,kwargs", [
    ("imatrix_mse", {}), ("imatrix_mse", {"patience": 1, "norm": 2.0}),
    ("imatrix_mse", {"maxshrink": 1.0, "patience": 0}), ("imatrix_mse", {"expand": 1.3}),
    ("nvfp4_expanded_imatrix", {}), ("nvfp4_expanded_imatrix", {"patience": 3})])
@pytest.mark.parametrize("fields", [WEIGHT_ARGS[1], WEIGHT_ARGS[2], WEIGHT_ARGS[4]],
                         ids=["int8-channel", "int4-group", "nvfp4"])
@pytest.mark.parametrize("weighted", [True, False], ids=["importance", "uniform"])
def test_compat_imatrix_bitwise_as_llmcompressor(name, kwargs, fields, weighted):
    torch.manual_seed(7)
    lin = torch.nn.Linear(64, 24)
    made = []
    for impl in (lc.Observer, TheirObserver):
        obs = impl.load_from_registry(name, base_name="weight", args=QuantizationArgs(
            **fields, observer_kwargs=dict(kwargs)))
        obs.attach(lin)
        made.append(obs)
    if weighted:
        lin(torch.randn(8, 64) * torch.linspace(0.01, 8, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the uniform case warns (ours) / logs (theirs)
        mine, theirs = (obs(lin.weight) for obs in made)
    assert torch.equal(mine.min_vals, theirs.min_vals)
    assert torch.equal(mine.max_vals, theirs.max_vals)
    _same_qparams(mine.get_qparams(), theirs.get_qparams())


# ----------------------------------------------------------- eps, zero units, shapes, names
EDGE_ARGS = [
    _fields(num_bits=8, type="int", symmetric=True, strategy="tensor"),
    _fields(num_bits=8, type="int", symmetric=False, strategy="channel"),
    _fields(num_bits=16, type="int", symmetric=False, strategy="channel"),
    _fields(num_bits=8, type="int", symmetric=True, strategy="channel", scale_dtype=torch.float16),
    _fields(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16),
    _fields(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
            scale_dtype=torch.float8_e4m3fn),
]


@pytest.mark.parametrize("name", ["memoryless_minmax", "memoryless_mse"])
@pytest.mark.parametrize("fields", EDGE_ARGS, ids=lambda f: "-".join(
    str(f.get(k)) for k in ("num_bits", "strategy", "symmetric", "scale_dtype")))
def test_tiny_and_all_zero_units_as_llmcompressor(name, fields):
    """Tiny scales are kept, only 0 ones become compressed-tensors' eps (of scale_dtype or the
    scale's dtype); an all-zero asymmetric unit's zero point is their NaN cast (0)."""
    w = torch.randn(4, 48, generator=torch.Generator().manual_seed(0))
    w[1] = 0
    w[2] *= 1e-6
    w[3] = w[3].abs() * 1e-30  # positive only: an fp16 scale_dtype rounds its scale to 0
    mine, theirs = _pair(name, "weight", fields)
    mine(w), theirs(w)
    _same_qparams(mine.get_qparams(), theirs.get_qparams())


@pytest.mark.parametrize("fields", [EDGE_ARGS[0], EDGE_ARGS[1], EDGE_ARGS[4]],
                         ids=["int8-tensor", "int8-asym-channel", "nvfp4"])
def test_float64_scale_dtype_and_zero_units_as_llmcompressor(fields):
    # float64 statistics: their dtype (tensor_group's too) and eps; values within float32's
    # rounding (quantscope computes in float32)
    w = torch.randn(4, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w[1] = 0
    mine, theirs = _pair("memoryless_minmax", "weight", fields)
    mine(w), theirs(w)
    a, b = mine.get_qparams(), theirs.get_qparams()
    assert a["scale"].dtype == b["scale"].dtype == torch.float64
    assert torch.allclose(a["scale"], b["scale"], rtol=2 ** -22, atol=0)
    assert torch.equal(a["zero_point"], b["zero_point"])


@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "minmax", "mse"])
def test_nvfp4_input_qparam_shapes_as_llmcompressor(name):
    mine, theirs = _pair(name, "input", EDGE_ARGS[4])
    for x in (torch.randn(4, 48, generator=torch.Generator().manual_seed(2)),) * 2:
        mine(x), theirs(x)
    _same_qparams(mine.get_qparams(), theirs.get_qparams(), exact=False)


def test_registered_names_as_llmcompressor():
    theirs = [n for n in TheirObserver.registered_names() if not n.startswith("quantscope")]
    assert sorted(lc.Observer.registered_names()) == sorted(theirs)
    for spelling in ("imatrix_mse", "imatrix-mse", "IMatrix MSE"):
        mine = lc.Observer.load_from_registry(spelling, base_name="weight",
                                              args=QuantizationArgs(num_bits=8))
        assert type(mine).__name__ == type(TheirObserver.load_from_registry(
            spelling, base_name="weight", args=QuantizationArgs(num_bits=8))).__name__


# ------------------------------------------------------------------ registry (RegistryMixin)
class _Probe:
    pass


class _Other:
    pass


def _outcome(base, step):
    """A step's value, or its exception as (type, message) with the registering class's and
    the method owner's names taken out (theirs is RegistryMixin, ours Observer)."""
    try:
        return step(base)
    except Exception as exc:  # noqa: BLE001  every outcome is compared
        message = str(exc).replace(str(base), "<base>")
        message = message.replace("RegistryMixin.", "").replace("Observer.", "")
        # their "already registered as" prints an empty dict (an indexing slip); ours the name
        return type(exc).__name__, message.split(" has already been registered as")[0]


def _same_outcomes(steps):
    """The steps on a fresh subclass of each Observer (its own registry, as theirs keys it)."""
    mine = type("Base", (lc.Observer,), {})
    theirs = type("Base", (TheirObserver,), {})
    got = [[_outcome(base, step) for step in steps] for base in (mine, theirs)]
    assert got[0] == got[1]
    return got[1]


def _name(value):
    return value.__name__


def test_registry_default_name_as_compressed_tensors():
    got = _same_outcomes([
        lambda b: _name(b.register()(_Probe)),
        lambda b: b.registered_names(),
        lambda b: _name(b.get_value_from_registry("_PROBE")),
        lambda b: _name(b.get_value_from_registry("-probe")),
        lambda b: b.get_value_from_registry("probe"),
    ])
    assert got[1] == ["-probe"] and got[4][0] == "KeyError"


def test_registry_names_and_aliases_as_compressed_tensors():
    got = _same_outcomes([
        lambda b: _name(b.register("Probe Obs_A", alias=["alias_one", "Alias Two"])(_Probe)),
        lambda b: b.registered_names(),
        lambda b: sorted(b.registered_aliases()),
        lambda b: [_name(b.get_value_from_registry(n))
                   for n in ("ALIAS_ONE", "alias two", "probe_obs_a")],
        lambda b: b.register("other", alias="alias-one")(_Other),   # alias taken
        lambda b: b.register("Probe-Obs-A")(_Other),                # name taken
        lambda b: b.register("probe_obs_a")(_Probe),                # even by the same value
        lambda b: b.register("dup", alias="DUP")(_Other),           # alias is the name
        lambda b: b.register("alias two")(_Other),                  # name taken as an alias
        lambda b: _name(b.register(alias=("o1", "O 2"))(_Other)),   # default name, tuple
        lambda b: (b.registered_names(), sorted(b.registered_aliases())),
        lambda b: type(b.load_from_registry("o-2", base_name="input",
                                            args=QuantizationArgs(num_bits=8))).__name__,
    ])
    assert got[2] == ["alias-one", "alias-two"]
    assert [g[0] for g in got[4:9]] == ["KeyError"] * 5
    assert got[10] == (["probe-obs-a", "-other"], ["alias-one", "alias-two", "o-2", "o1"])


def test_registry_register_value_as_compressed_tensors():
    got = _same_outcomes([
        lambda b: b.register_value(_Probe, None),
        lambda b: b.register_value(_Other),                         # name is required
        lambda b: b.register_value(_Other, "o", alias="p"),
        lambda b: (b.registered_names(), b.registered_aliases()),
        lambda b: _name(b.get_value_from_registry("P")),
    ])
    assert got[1][0] == "TypeError" and got[3] == (["-probe", "o"], ["p"])


def test_registry_requires_subclass_as_compressed_tensors():
    def strict(base, flag=True):
        base.registry_requires_subclass = flag
        return base

    got = _same_outcomes([
        lambda b: strict(b).register("n")(_Probe),
        lambda b: _name(strict(b).register("sub")(type("Sub", (b,), {}))),
        lambda b: _name(b.get_value_from_registry("sub")),
        lambda b: _name(strict(b, False).register("plain")(_Other)),
        lambda b: strict(b).get_value_from_registry("plain"),
    ])
    assert got[0][0] == "ValueError" and got[4][0] == "ValueError"


def test_registry_is_per_registering_class_as_compressed_tensors():
    got = _same_outcomes([
        lambda b: _name(b.register("only-base")(_Probe)),
        lambda b: type("Sub", (b,), {}).registered_names(),
        lambda b: type("Sub", (b,), {}).get_value_from_registry("only-base"),
        lambda b: "only-base" in b.__mro__[1].registered_names(),
    ])
    assert got[1] == [] and got[2][0] == "KeyError" and got[3] is False


def test_registry_runs_no_file_where_compressed_tensors_does(tmp_path, monkeypatch):
    """A deliberate difference: theirs executes a "file.py:value" name, ours refuses it (a
    name read from a config would run code)."""
    monkeypatch.chdir(tmp_path)
    mark = tmp_path / "ran"
    (tmp_path / "plug.py").write_text(f"open({str(mark)!r}, 'w').close()\nmyobs = 1\n")
    with pytest.raises(ValueError, match="runs no file"):
        lc.Observer.get_value_from_registry("plug.py:myobs")
    assert not mark.exists()
    assert TheirObserver.get_value_from_registry("plug.py:myobs") == 1 and mark.exists()


def test_builtin_names_cannot_be_taken_as_in_llmcompressor():
    for base in (lc.Observer, TheirObserver):
        with pytest.raises(KeyError, match="Attempting to register alias minmax as minmax "
                                           "however minmax has already been registered as"):
            base.register("MinMax")(_Other)
        assert base.get_value_from_registry("minmax").__name__ == "MinMaxObserver"
        with pytest.warns(UserWarning, match="'fouroversix' observer is an alias"):
            obs = base.load_from_registry("FourOverSix", base_name="weight",
                                          args=QuantizationArgs(num_bits=4, type="float"))
        assert type(obs).__name__ == "NVFP4ExpandedMSEObserver"
    assert lc.Observer.registered_aliases() == TheirObserver.registered_aliases() == []


def test_refused_registration_keeps_no_alias_unlike_compressed_tensors():
    # chosen difference: theirs registers the aliases before it checks the name
    mine = type("Base", (lc.Observer,), {})
    theirs = type("Base", (TheirObserver,), {})
    for base in (mine, theirs):
        base.register("taken")(_Probe)
        with pytest.raises(KeyError, match="taken has already been registered"):
            base.register("taken", alias="fresh")(_Other)
    assert mine.registered_aliases() == [] and theirs.registered_aliases() == ["fresh"]
