"""observe_many (quantscope.observers.grouped): many observers' tensors in one grouped launch
per (device, dtype), each observer's state what ``observer(x)`` leaves, bit for bit.

The ``meta`` device stands in for a GPU where the test counts the ops a call dispatches; the
values come from the Triton launcher itself, interpreted on CPU tensors (the grouped path
opened to the CPU for the test), against forward on the CPU.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from op_names import OpNames
from triton_interpreter import fresh_interpreter_test

import quantscope as qs
from quantscope import QuantSpec, presets
from quantscope.kernels import triton as qs_triton
from quantscope.layout import Block, Channel, Group, Tensor, Tile
from quantscope.observers import grouped, observe_many

#: (observer, options, spec, shape, grouped?): the pairs' observers and tensors
CASES = [
    ("memoryless_minmax", {}, QuantSpec("int8", Channel(0)), (48, 40), True),
    ("memoryless_minmax", {}, QuantSpec("int4", Group(16)), (24, 64), True),
    ("memoryless_minmax", {}, QuantSpec("int8", Tensor()), (3, 16, 8), True),
    ("memoryless_minmax", {}, presets.NVFP4, (8, 64), True),
    ("static_minmax", {}, QuantSpec("int8", Channel(0)), (4, 2, 8), True),
    ("minmax", {"averaging_constant": 0.25}, QuantSpec("int8", Group(8)), (6, 16), True),
    # forward reads these in place through another view, or copies them: no grouped launch
    ("memoryless_minmax", {}, QuantSpec("int8", Tile(8, 16)), (16, 32), False),
    ("memoryless_minmax", {}, QuantSpec("int8", Channel(-1)), (12, 20), False),
    ("memoryless_minmax", {}, QuantSpec("fp4_e2m1", Block(7), scale="fp8_e4m3"), (4, 20), False),
    ("memoryless_minmax", {"non_finite": "ignore"}, QuantSpec("int8", Channel(0)), (5, 9), False),
    ("memoryless_mse", {}, QuantSpec("int4", Channel(0)), (6, 16), False),
]


def _observers(cases=CASES, device="cpu"):
    return [qs.get_observer(n, spec, **opts).to(device) for n, opts, spec, _, _ in cases]


def _tensors(dtype, device="cpu", seed=0, cases=CASES):
    g = torch.Generator().manual_seed(seed)
    out = []
    for *_, shape, _ in cases:
        x = torch.randn(shape, generator=g) * torch.rand(shape[-1], generator=g).add(0.1)
        out.append(x.to(dtype).to(device))
    return out


def _grouped_count(cases=CASES) -> int:
    return sum(c[-1] for c in cases)


# ---- the meta device: which ops run ------------------------------------------------------

@pytest.mark.parametrize("inference", [False, True])
def test_one_grouped_launch_per_dtype_and_none_per_tensor(inference):
    """Two dtypes on the meta device: two grouped launches, and ``unit_minmax`` only for the
    pairs forward reads another way (tiles, a channel axis past the first, padded blocks,
    non-finite values ignored, another family); every state of forward's shape; in inference
    mode too (calibrate's, where views record no base)."""
    xs = _tensors(torch.float32, "meta") + _tensors(torch.bfloat16, "meta", seed=1)
    obs = _observers(device="meta") + _observers(device="meta")
    rec = OpNames()
    with rec, torch.inference_mode(inference):
        observe_many(list(zip(obs, xs)))
    assert rec.calls["quantscope.grouped_unit_minmax"] == 2
    # (a pair with zero-padded units takes one more: its padded units' real min / max)
    padded = sum(c[2].layout.pads_at(c[3]) for c in CASES)
    assert rec.calls["quantscope.unit_minmax"] == 2 * (sum(not c[-1] for c in CASES) + padded)
    ref = _observers(device="meta") + _observers(device="meta")
    for o, x in zip(ref, xs):
        o(x)
    for got, want in zip(obs, ref, strict=True):
        assert got.shape == want.shape
        assert _shapes(got.state_dict()) == _shapes(want.state_dict())


def _shapes(state: dict) -> dict:
    return {k: (tuple(v.shape), v.dtype) for k, v in state.items()}


def test_cpu_pairs_call_forward_only():
    """On the CPU nothing changes: no grouped op, each observer's forward (its C kernels)."""
    rec = OpNames()
    with rec:
        observe_many(list(zip(_observers(), _tensors(torch.float32))))
    assert "quantscope.grouped_unit_minmax" not in rec.names


# ---- the values: the Triton launcher, interpreted on CPU tensors --------------------------

@pytest.fixture
def grouped_on_cpu(monkeypatch):
    """The grouped path opened to CPU tensors, through the interpreted Triton launcher;
    yields the list of its launches' tensor counts."""
    if not qs_triton.runs_on("cpu"):
        pytest.skip("the Triton launchers do not run on CPU tensors in this process")
    from quantscope.kernels.triton import minmax

    launches = []

    def launch(units):
        launches.append(len(units))
        return minmax.grouped_unit_minmax(units, block_u=4, block_e=16)

    monkeypatch.setattr(grouped, "_launches", lambda x: x.dtype in grouped._DTYPES)
    monkeypatch.setattr(grouped, "ops", SimpleNamespace(grouped_unit_minmax=launch))
    return launches


def _assert_same_state(got, want):
    g, w = got.state_dict(), want.state_dict()
    assert list(g) == list(w)
    for k in w:
        assert g[k].shape == w[k].shape and g[k].dtype == w[k].dtype, k
        torch.testing.assert_close(g[k], w[k], rtol=0, atol=0, equal_nan=True, msg=k)
    assert got.shape == want.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_states_are_forwards_bit_for_bit(grouped_on_cpu, dtype):
    """Two rounds (the running and moving-average states update), a NaN in one weight: the
    same state dicts and qparams as forward's, one launch per round over the grouped pairs;
    the pairs' order changes nothing."""
    obs, ref = _observers(), _observers()
    for round_ in range(2):
        xs = _tensors(dtype, seed=round_)
        xs[1][3, 5] = float("nan") if round_ else xs[1][3, 5]
        order = list(range(len(xs)))
        random.Random(round_).shuffle(order)
        seconds = observe_many([(obs[i], xs[i]) for i in order])
        assert len(seconds) == len(xs) and all(s >= 0 for s in seconds)
        for o, x in zip(ref, xs):
            o(x)
    assert grouped_on_cpu == [_grouped_count()] * 2
    for got, want in zip(obs, ref, strict=True):
        _assert_same_state(got, want)
        if not bool(want.seen_non_finite):
            g, w = got.calculate_qparams(), want.calculate_qparams()
            assert torch.equal(g.scale, w.scale) and torch.equal(g.zero_point, w.zero_point)
    assert bool(obs[1].seen_non_finite)


QUARK_CHANNEL = {"dtype": "fp8_e4m3", "qscheme": "per_channel", "ch_axis": 0,
                 "is_dynamic": False, "symmetric": True}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_observer_whose_forward_adds_steps_is_not_grouped(grouped_on_cpu, dtype):
    """Quark's forward keeps the input dtype (its scales' dtype) and starts a static
    per-channel state over on a new channel count: observe_minmax would skip both (bf16
    scales came back float32; the second shape raised), so such a class goes through its
    forward."""
    got = qs.get_observer("quark:PerChannelMinMaxObserver", qspec=QUARK_CHANNEL)
    want = qs.get_observer("quark:PerChannelMinMaxObserver", qspec=QUARK_CHANNEL)
    assert not got.takes_minmax and qs.get_observer("static_minmax").takes_minmax
    g = torch.Generator().manual_seed(3)
    for shape in ((8, 16), (4, 16)):
        x = torch.randn(*shape, generator=g).to(dtype)
        observe_many([(got, x)])
        want(x)
        _assert_same_state(got, want)
        (gs, gz), (ws, wz) = got.calculate_qparams(), want.calculate_qparams()
        assert gs.dtype == ws.dtype == dtype and torch.equal(gs, ws) and torch.equal(gz, wz)
    assert grouped_on_cpu == []  # no launch: forward's path


def test_each_state_its_own_memory(grouped_on_cpu):
    """A memoryless observer keeps the launch's lo / hi as its state: each its own storage
    of its own size, so all the observers' states save together (safetensors refuses shared
    memory; torch.save would write a shared buffer whole)."""
    from safetensors.torch import load, save

    obs = _observers()
    observe_many(list(zip(obs, _tensors(torch.float32))))
    states = {f"{i}.{k}": v for i, o in enumerate(obs) for k, v in o.state_dict().items()}
    memoryless = [obs[i] for i, c in enumerate(CASES) if c[0] == "memoryless_minmax" and c[-1]]
    for o in memoryless:
        for t in (o.min_vals, o.max_vals):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    loaded = load(save(states))
    assert all(torch.equal(loaded[k], v) for k, v in states.items())


def test_a_launchs_time_is_shared_by_elements(monkeypatch):
    """Each pair is charged its share of a grouped launch by its elements (a clock that moves
    only while the launch runs: 70 ticks over 10 + 20 + 40 elements)."""
    clock = SimpleNamespace(now=0.0)

    def launch(units):
        clock.now += 70.0
        los = [torch.empty(u.shape[0], device=u.device) for u in units]
        return los, [torch.empty_like(t) for t in los]

    monkeypatch.setattr(grouped, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(grouped, "ops", SimpleNamespace(grouped_unit_minmax=launch))
    obs = [qs.get_observer("memoryless_minmax").to("meta") for _ in range(3)]
    xs = [torch.empty(s, device="meta") for s in ((2, 5), (4, 5), (8, 5))]
    assert observe_many(list(zip(obs, xs))) == [10.0, 20.0, 40.0]

# ---- errors -------------------------------------------------------------------------------


def test_bad_input_raises_as_forward_before_anything_is_observed():
    obs = _observers(device="meta")
    xs = _tensors(torch.float32, "meta")
    bad = torch.zeros(24, 60, device="meta")  # group size 16 does not divide 60
    with pytest.raises(ValueError) as want:
        _observers(device="meta")[1](bad)
    with pytest.raises(ValueError) as got:
        observe_many([(o, bad if i == 1 else x) for i, (o, x) in enumerate(zip(obs, xs))])
    assert str(got.value) == str(want.value)
    assert not any(o.has_observed for o in obs)
    ints = torch.zeros(3, 4, dtype=torch.int32)
    with pytest.raises(TypeError, match="expected a floating-point tensor"):
        observe_many([(obs[0], ints)])


def test_on_error_takes_each_failure_and_the_rest_are_observed():
    obs = _observers(device="meta")
    xs = _tensors(torch.float32, "meta")
    xs[1] = torch.zeros(24, 60, device="meta")
    xs[6] = torch.zeros(3, device="meta")  # a tile layout needs 2 dims
    errors = []
    observe_many(list(zip(obs, xs)), on_error=lambda i, e: errors.append((i, type(e))))
    assert errors == [(1, ValueError), (6, ValueError)]
    assert [o.has_observed for o in obs] == [i not in (1, 6) for i in range(len(obs))]


def test_pairs_are_checked():
    o = qs.get_observer("memoryless_minmax")
    with pytest.raises(ValueError, match=r"pairs\[1\] has the observer of pairs\[0\]"):
        observe_many([(o, torch.zeros(2, 3)), (o, torch.ones(2, 3))])
    with pytest.raises(TypeError, match=r"pairs\[0\] must be an \(Observer, tensor\) pair"):
        observe_many([torch.zeros(2, 3)])


def test_empty_tensors_are_not_observed():
    obs = _observers(CASES[:2], device="meta")
    observe_many([(obs[0], torch.zeros(0, 40, device="meta")),
                  (obs[1], torch.zeros(24, 64, device="meta"))])
    assert [o.has_observed for o in obs] == [False, True]


test_in_a_fresh_interpreter = fresh_interpreter_test(__file__)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_states_are_forwards(dtype):
    """On CUDA (the compiled grouped launch through the op): every observer's state is what
    its forward leaves, and its qparams."""
    grouped_obs, ref = _observers(device="cuda"), _observers(device="cuda")
    xs = _tensors(dtype, "cuda")
    observe_many(list(zip(grouped_obs, xs)))
    for o, x in zip(ref, xs):
        o(x)
    for got, want in zip(grouped_obs, ref):
        _assert_same_state(got, want)
        a, b = got.calculate_qparams(), want.calculate_qparams()
        assert torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replays_grouped_minmax_on_new_values():
    """Found by a review: the grouped launch reads a descriptor table copied from host memory,
    which a CUDA graph would replay from a buffer reused since; under capture the op launches
    per tensor, so a replay reads the inputs' new values."""
    from quantscope.kernels import ops

    xs = [torch.randn(64, 96, device="cuda"), torch.randn(8, 32, device="cuda")]
    ops.grouped_unit_minmax(xs)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        los, his = ops.grouped_unit_minmax(xs)
    for x in xs:
        x.copy_(torch.randn_like(x) * 3)
    graph.replay()
    torch.cuda.synchronize()
    for x, lo, hi in zip(xs, los, his):
        assert torch.equal(lo, x.amin(1)) and torch.equal(hi, x.amax(1))


@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax"])
def test_observe_minmax_takes_float32_ends_and_keeps_no_graph(name):
    # int32 or float64 ends made an int32 / float64 state, and ends tracking gradients left
    # an autograd graph in it (forward detaches; this did not)
    x = torch.randn(4, 8)
    obs = qs.get_observer(name, QuantSpec("int8", qs.Channel(0)))
    lo, hi = x.aminmax(dim=1)
    for bad in (lo.int(), lo.double()):
        with pytest.raises(ValueError, match=f"lo and hi must be float32 of the 4 units of "
                                             f"shape \\(4, 8\\) under Channel\\(axis=0\\), "
                                             f"got {bad.dtype}"):
            obs.observe_minmax(x, bad, hi)
    obs.observe_minmax(x, lo.clone().requires_grad_(), hi.clone().requires_grad_())
    assert obs.min_vals.grad_fn is None and not obs.min_vals.requires_grad
    assert not obs.calculate_qparams().scale.requires_grad
    assert torch.equal(obs.min_vals, lo) and obs.min_vals.dtype == torch.float32
