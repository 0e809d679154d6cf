"""Less common modules (probe s34): a matched layer whose output (or input) is no floating-point
tensor was counted as never called; a keyword-only input (``forward(self, *, x)``) was never
observed nor quantized; an LSTM's refused weight role blamed "the layers in it", which an
LSTM has none of."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Recipe, Role, Rule, Runtime, preset
from quantscope.calibration.run.batches import input_name

W8 = Role(QuantSpec("int8", "channel"), "memoryless_minmax")
A8 = Role(QuantSpec("int8"), "minmax")


class _TupleOut(nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        return y, 2 * y


class _IdsIn(nn.Module):
    """A layer with a 2-D weight fed integer ids (it casts them itself)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, ids):
        return F.linear(ids.float(), self.weight)


class _Wrap(nn.Module):
    def __init__(self, layer, pick=lambda y: y):
        super().__init__()
        self.t, self.pick = layer, pick

    def forward(self, x):
        return self.pick(self.t(x))


def _calls(module, batches, model):
    """How many times the model's forward calls ``module`` over ``batches`` (a hook of ours)."""
    seen = []
    h = module.register_forward_hook(lambda *a: seen.append(1))
    with torch.no_grad():
        for b in batches:
            model(b)
    h.remove()
    return len(seen)


def _tuple_model():
    torch.manual_seed(0)
    return _Wrap(_TupleOut(8, 8), lambda y: y[0]).eval(), [torch.randn(4, 8) for _ in range(3)]


@pytest.mark.parametrize("dynamic", [False, True])
def test_an_output_role_on_a_tuple_is_an_error_naming_the_type_not_never_called(dynamic):
    model, batches = _tuple_model()
    calls = _calls(model.t, batches, model)
    assert calls == len(batches)  # one call per batch
    role = Role(QuantSpec("int8", "token"), "memoryless_minmax", True) if dynamic else A8
    recipe = Recipe((Rule(("Linear",), weight=W8, output=role),))
    with pytest.raises(ValueError) as e:
        quantscope.calibrate(model, batches, recipe, runtime=Runtime(missing="error"),
                             progress=False)
    msg = str(e.value)
    assert f"layer 't' output was called {calls} times but returned a tuple" in msg
    assert "the output role needs a floating-point tensor" in msg
    assert "never called" not in msg


@pytest.mark.parametrize("missing, fallback, layers", [
    ("skip", "output not quantized", ["t"]), ("float", "float layer", [])])
def test_a_tuple_output_falls_back_with_its_calls_and_type_recorded(tmp_path, missing,
                                                                    fallback, layers):
    model, batches = _tuple_model()
    calls = _calls(model.t, batches, model)
    recipe = Recipe((Rule(("Linear",), weight=W8, output=A8),))
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        cal = quantscope.calibrate(model, batches, recipe, runtime=Runtime(missing=missing),
                                   progress=False)
    want = [{"layer": "t", "role": "output", "calls": calls, "fallback": fallback,
             "got": "a tuple"}]
    assert cal.info["missing"] == want
    said = [str(w.message) for w in ws if "returned a tuple" in str(w.message)]
    assert len(said) == 1 and "layer 't' output" in said[0] and fallback in said[0]
    assert sorted(cal.states) == layers
    assert all(set(cal.states[n]) == {"weight"} for n in layers)  # the weight kept on skip
    cal.save(tmp_path / "c")
    assert quantscope.calibrate.load(tmp_path / "c").info["missing"] == want


def test_an_input_role_fed_integer_ids_names_their_dtype():
    torch.manual_seed(0)
    model = _Wrap(_IdsIn()).eval()
    batches = [torch.randint(0, 5, (4, 8)) for _ in range(2)]
    calls = _calls(model.t, batches, model)
    recipe = Recipe((Rule(("_IdsIn",), weight=W8, input=A8),))
    with pytest.raises(ValueError, match=rf"layer 't' input was called {calls} times but was "
                                         rf"given a tensor of int64 as its input; the input "
                                         rf"role needs a floating-point tensor"):
        quantscope.calibrate(model, batches, recipe, runtime=Runtime(missing="error"),
                             progress=False)


class _KwOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, *, x, scale=1.0):
        return F.linear(x, self.weight) * scale


class _CallsKw(nn.Module):
    def __init__(self):
        super().__init__()
        self.k = _KwOnly()

    def forward(self, x):
        return self.k(x=x, scale=2.0)


def test_input_name_falls_back_to_the_first_keyword_only_parameter():
    class Mixed(nn.Module):
        def forward(self, a, *, x):
            return a

    class Star(nn.Module):
        def forward(self, *args, x, y=None):
            return x

    assert input_name(_KwOnly()) == "x"
    assert input_name(Mixed()) == "a"  # a positional one first
    assert input_name(Star()) == "x"
    assert input_name(nn.Linear(2, 2)) == "input"


def _int8(x, amax):
    """Symmetric int8 fake-quant by its formula (qparams.py): scale amax / ((127 + 128) / 2),
    codes in [-128, 127]."""
    scale = amax / 127.5
    return torch.clamp(torch.round(x / scale), -128, 127) * scale


def test_a_keyword_only_input_is_observed_and_quantized_like_a_positional_one():
    torch.manual_seed(0)
    model = _CallsKw().eval()
    batches = [torch.randn(4, 8) for _ in range(2)]
    seen = []
    h = model.k.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["x"]),
                                          with_kwargs=True)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        static = Role(QuantSpec("int8"), "static_minmax")  # the range of every call
        cal = quantscope.calibrate(model, batches, Recipe((Rule(("_KwOnly",), weight=W8,
                                                                input=static),)), progress=False)
    h.remove()
    assert not [w for w in ws if "saw no tokens" in str(w.message)]
    assert "missing" not in cal.info
    assert set(cal.states["k"]) == {"input", "weight"}
    xs = torch.cat(seen)
    state = cal.states["k"]["input"]
    assert float(state.lo.min()) == float(xs.min()) and float(state.hi.max()) == float(xs.max())
    x = torch.randn(5, 8)
    amax = torch.maximum(xs.min().abs(), xs.max().abs())
    w = model.k.weight.detach()
    w_q = _int8(w, w.abs().amax(dim=1, keepdim=True))  # per output channel
    want = F.linear(_int8(x, amax), w_q) * 2.0
    with torch.no_grad(), cal.apply(model):
        got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, model(x))  # the float model differs: the input was quantized


@pytest.mark.parametrize("cls, kw", [(nn.LSTM, {}), (nn.GRU, {"num_layers": 2}), (nn.RNN, {})])
def test_a_weight_role_on_an_rnn_names_its_weights_not_layers_in_it(cls, kw):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = cls(16, 32, batch_first=True, **kw)

        def forward(self, x):
            return self.rnn(x)[0]

    model = M().eval()
    own = [n for n, p in model.rnn.named_parameters(recurse=False) if p.dim() == 2]
    assert own and not list(model.rnn.children())  # weights of its own, no layers in it
    with pytest.raises(ValueError) as e:
        quantscope.calibrate(model, [torch.randn(2, 5, 16)],
                             preset("w8a8", targets=[cls.__name__]), progress=False)
    msg = str(e.value)
    assert f"'rnn' ({cls.__name__})" in msg and ", ".join(own[:4]) in msg
    assert "quantscope does not quantize" in msg and "input role alone" in msg
    assert "the layers in it do" not in msg


def test_the_layers_in_it_only_for_a_module_whose_layers_hold_weights():
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8)), nn.ReLU()).eval()
    with pytest.raises(ValueError, match=r"'0' \(Sequential\) holds no weight for the weight "
                                         r"role \(the layers in it do\)"):
        Recipe((Rule(("Sequential",), weight=W8),)).match(model)
    with pytest.raises(ValueError) as e:  # no weight anywhere: nothing to point at
        Recipe((Rule(("ReLU",), weight=W8),)).match(model)
    assert "'1' (ReLU) holds no weight for the weight role" in str(e.value)
    assert "layers in it" not in str(e.value)
