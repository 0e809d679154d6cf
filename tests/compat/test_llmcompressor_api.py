"""compat.llmcompressor follows llm-compressor 0.14's observer API; compat.llmcompressor_legacy
keeps the seed's. Reference values come from the formulas (symmetric int8: amax / 127.5; NVFP4
global scale 448 * 6 / amax); the differential tests against the installed llm-compressor are
in test_llmcompressor_peers.py."""

from __future__ import annotations

import re
import warnings
from unittest import mock

import pytest
import torch
from op_names import OpNames

from quantscope.compat import llmcompressor as lc
from quantscope.compat import llmcompressor_legacy as legacy
from quantscope.compat.llmcompressor_base import qparams_of_statistics
from quantscope.compat.llmcompressor_parts import flatten_for_calibration

INT8 = {"num_bits": 8, "type": "int", "symmetric": True}


def _obs(name, base="input", **fields):
    return lc.Observer.load_from_registry(name, base_name=base, args={**INT8, **fields})


@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "minmax",
                                  "memoryless_mse", "mse", "nvfp4_expanded_mse", "imatrix_mse"])
def test_forward_returns_self_and_get_qparams_needs_data(name):
    obs = _obs(name, "weight", strategy="channel")
    with pytest.raises(AssertionError, match="No statistics available"):
        obs.get_qparams()
    assert obs(torch.randn(4, 16)) is obs
    qp = obs.get_qparams()
    assert set(qp) == {"scale", "zero_point", "global_scale"} and qp["global_scale"] is None
    assert qp["scale"].shape == (4, 1) and qp["zero_point"].dtype == torch.int8
    assert not obs.has_statistics  # get_qparams deletes them
    assert not hasattr(obs, "min_vals")


def test_weight_is_observed_once_until_qparams():
    obs = _obs("memoryless_minmax", "weight")
    obs(torch.tensor([[1.0, -2.0]]))
    obs(torch.tensor([[10.0, -20.0]]))  # ignored: the weight has statistics
    assert obs.max_vals.item() == 1.0
    obs.get_qparams()
    obs(torch.tensor([[10.0, -20.0]]))
    assert obs.max_vals.item() == 10.0


@pytest.mark.parametrize("name", ["static_minmax", "minmax", "mse"])
def test_statistics_are_replaced_not_written(name):
    obs = _obs(name)
    obs(torch.tensor([[[0.0, 1.0]]]))
    first_lo, first_hi = obs.min_vals, obs.max_vals
    kept = first_lo.clone(), first_hi.clone()
    obs(torch.tensor([[[-3.0, 5.0]]]))
    assert torch.equal(first_lo, kept[0]) and torch.equal(first_hi, kept[1])
    assert obs.min_vals is not first_lo


def test_static_and_ema_sequences():
    # llm-compressor's documented sequence: [0, 0], [-3, 1], [-1, 3] per tensor
    batches = [torch.tensor([[[0.0, 0.0]]]), torch.tensor([[[-3.0, 1.0]]]),
               torch.tensor([[[-1.0, 3.0]]])]
    static, ema = _obs("static_minmax"), _obs("minmax", observer_kwargs={
        "averaging_constant": 0.1})
    seen = []
    for b in batches:
        static(b), ema(b)
        seen.append((static.min_vals.item(), static.max_vals.item(),
                     ema.min_vals.item(), ema.max_vals.item()))
    assert [s[:2] for s in seen] == [(0, 0), (-3, 1), (-3, 3)]
    ema_seen = [v for s in seen for v in s[2:]]
    assert ema_seen == pytest.approx([0, 0, -0.3, 0.1, -0.37, 0.39])


def test_assigned_statistics_give_their_qparams():
    obs = _obs("static_minmax")
    obs.min_vals, obs.max_vals = torch.tensor([-5.0]), torch.tensor([2.0])
    qp = obs.get_qparams()
    assert torch.equal(qp["scale"], torch.tensor([5.0 / 127.5]))
    assert torch.equal(qp["zero_point"], torch.zeros(1, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8])
def test_integer_tensors_are_observed(dtype):
    obs = _obs("memoryless_minmax")
    obs(torch.tensor([[[-4, 7, 2]]], dtype=dtype))
    assert obs.min_vals.item() == -4 and obs.max_vals.item() == 7
    scale = obs.get_qparams()["scale"]
    assert scale.dtype == torch.float32 and torch.equal(scale, torch.tensor([7 / 127.5]))
    ema = _obs("minmax")
    ema(torch.tensor([[[-4, 7]]], dtype=dtype))
    ema(torch.tensor([[[0, 0]]], dtype=dtype))
    assert ema.max_vals.item() == pytest.approx(7 * 0.99)


def test_int_tensor_group_scales_times_global_scale():
    w = torch.tensor([[1.0, -2.0, 0.5, 0.25], [4.0, 1.0, -1.0, 3.0]])
    obs = lc.MemorylessMinMaxObserver("weight", {**INT8, "strategy": "tensor_group",
                                                 "group_size": 2})
    qp = obs(w).get_qparams()
    gs = torch.tensor([448 * 6 / 4.0])
    assert torch.equal(qp["global_scale"], gs)
    amax = torch.tensor([[2.0, 0.5], [4.0, 3.0]])
    assert torch.allclose(qp["scale"], amax / 127.5 * gs, rtol=1e-6)


def test_nvfp4_global_scale_from_the_fusion_group():
    args = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
            "group_size": 16}
    mods = [torch.nn.Linear(32, 8, bias=False) for _ in range(3)]
    with torch.no_grad():
        mods[2].weight[0, 0] = 50.0  # the group's largest amax is in the third layer
    observers = [lc.MemorylessMinMaxObserver("weight", dict(args)) for _ in mods]
    lc.FusionHandler.fuse(zip(observers, mods))
    qp = observers[0](mods[0].weight).get_qparams()  # observes the others' weights too
    assert torch.equal(qp["global_scale"], 448.0 * 6 / torch.tensor([50.0]))
    assert observers[1].has_statistics  # kept until every member is done
    for obs in observers[1:]:
        assert torch.equal(obs.get_qparams()["global_scale"], qp["global_scale"])
    assert not any(obs.has_statistics for obs in observers)


def test_mse_options_as_llmcompressor():
    fp4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
           "group_size": 16}
    assert _obs("memoryless_mse", "weight").triton_error_buffer == 0.30
    assert lc.MemorylessMSEObserver("weight", dict(fp4)).triton_error_buffer == 1.00
    with pytest.raises(ValueError, match="expand value must be at least 1.0, got 0.5"):
        _obs("mse", observer_kwargs={"expand": 0.5})
    with pytest.warns(UserWarning, match="alias"):
        assert isinstance(lc.Observer.load_from_registry("fouroversix", base_name="weight",
                                                         args=dict(fp4)),
                          lc.NVFP4ExpandedMSEObserver)


def test_sync_issues_one_async_reduce_per_statistic(monkeypatch):
    calls = []
    fake = type("Dist", (), {"ReduceOp": torch.distributed.ReduceOp,
                             "all_reduce": staticmethod(lambda t, op, async_op: calls.append(
                                 (t, op, async_op)) or "handle")})
    monkeypatch.setattr("quantscope.compat.llmcompressor_base.dist", fake)
    assert _obs("memoryless_minmax").sync_activation_stats() == []
    static = _obs("static_minmax")
    assert static.sync_activation_stats() == []  # nothing observed
    static.min_vals, static.max_vals = torch.tensor([-1.0]), torch.tensor([1.0])
    assert static.sync_activation_stats() == ["handle", "handle"]
    ops = [op for _, op, _ in calls]
    assert ops == [torch.distributed.ReduceOp.MIN, torch.distributed.ReduceOp.MAX]
    assert all(a for _, _, a in calls)


@pytest.mark.parametrize("name,stats,op", [
    ("static_minmax", ("min_vals", "max_vals"), ("MIN", "MAX")),
    ("minmax", ("min_vals", "max_vals"), ("AVG", "AVG")),
    ("mse", ("min_vals", "max_vals"), ("AVG", "AVG")),
    ("imatrix_mse", ("_imatrix_sum", "_imatrix_count"), ("SUM", "SUM"))])
def test_patching_the_base_modules_dist_sees_every_reduce(name, stats, op):
    # llm-compressor's tests patch "llmcompressor.observers.base.dist"; ours is the one name
    obs = _obs(name, "weight" if name == "imatrix_mse" else "input")
    values = [torch.tensor([-1.0]), torch.tensor([1.0])]
    for stat, value in zip(stats, values):
        setattr(obs, stat, value)
    with mock.patch("quantscope.compat.llmcompressor_base.dist") as fake:
        fake.all_reduce.side_effect = ["h0", "h1"]
        assert obs.sync_activation_stats() == ["h0", "h1"]
    calls = fake.all_reduce.call_args_list
    assert [c.kwargs["op"] for c in calls] == [getattr(torch.distributed.ReduceOp, o) for o in op]
    assert all(c.args[0] is v and c.kwargs["async_op"] is True for c, v in zip(calls, values))
    assert not hasattr(lc, "dist")  # no second name whose patch would miss the calls


@pytest.mark.parametrize("strategy,shape,base,out", [
    ("tensor", (4, 8), "weight", (1, 1, 32)),
    ("channel", (4, 8), "weight", (1, 4, 1, 8)),
    ("group", (4, 8), "weight", (1, 4, 2, 4)),
    ("block", (5, 6), "weight", (1, 3, 2, 8)),
    ("tensor", (2, 3, 8), "input", (6, 1, 8)),
    ("group", (2, 3, 8), "input", (6, 2, 4)),
    ("token", (2, 3, 8), "input", (2, 3, 8)),
    ("attn_head", (2, 4, 3, 8), "k", (6, 4, 1, 1, 8)),
])
def test_flatten_shapes(strategy, shape, base, out):
    args = {"strategy": strategy, "group_size": 4, "block_structure": [2, 4]}
    assert tuple(flatten_for_calibration(torch.randn(shape), base, args).shape) == out


@pytest.mark.parametrize("strategy,base,shape,message", [
    ("token", "weight", (2, 2), "Token quantization cannot be applied to weights"),
    ("attn_head", "weight", (4, 8), "Attention head quantization cannot be applied to weights"),
    ("attn_head", "input", (2, 3, 8),
     "Attention head quantization cannot be applied to activations"),
    ("tensor_group", "q", (2, 3, 4, 8), "Group quantization cannot be applied to attention"),
    ("channel", "q", (2, 3, 4, 8), "Channel quantization cannot be applied to attention"),
    ("block", "v", (2, 3, 4, 8), "Block quantization cannot be applied to attention"),
])
def test_flatten_refuses_what_llmcompressor_refuses_in_its_words(strategy, base, shape, message):
    """llm-compressor 0.14's messages (``observers/helpers.py``), whole: its words for the
    strategy ("Attention head"; a tensor group is "Group" there), not the enum's."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        flatten_for_calibration(torch.randn(shape), base, {"strategy": strategy, "group_size": 4})


def test_flatten_refuses_an_unknown_base_name():
    with pytest.raises(ValueError, match="Unknown quantization base name"):
        flatten_for_calibration(torch.randn(2, 2), "bias", {"strategy": "tensor"})


def test_seed_generation_returns_the_same_qparams():
    x = torch.randn(8, 32)
    args = {"num_bits": 4, "strategy": "group", "group_size": 16}
    scale, zp = legacy.Observer.load_from_registry("memoryless_minmax", base_name="weight",
                                                   args=dict(args))(x)
    qp = lc.Observer.load_from_registry("memoryless_minmax", base_name="weight",
                                        args=dict(args))(x).get_qparams()
    assert torch.equal(scale, qp["scale"]) and torch.equal(zp, qp["zero_point"])


def _legacy(name="memoryless_minmax", **fields):
    return legacy.Observer.load_from_registry(name, base_name="weight", args=fields)


@pytest.mark.parametrize("fields", [{**INT8, "strategy": "channel"},
                                    {**INT8, "symmetric": False, "strategy": "tensor"}])
def test_seed_get_qparams_of_observed_is_forwards_tuple(fields):
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
    scale, zp = _legacy(**fields)(x)
    for call in (lambda o: o.get_qparams(observed=x), lambda o: o.get_qparams(x, None, None)):
        got = call(_legacy(**fields))
        assert isinstance(got, tuple)
        assert torch.equal(got[0], scale) and torch.equal(got[1], zp)
    if fields["symmetric"]:  # compressed-tensors: 2 * amax / (qmax - qmin), zero point 0
        expected = x.abs().amax(1, keepdim=True) / 127.5
        expected_zp = torch.zeros_like(zp)
    else:  # (max - min) / 255 over a range holding 0, zero point qmin - round(min / scale)
        lo, hi = x.min().clamp(max=0), x.max().clamp(min=0)
        expected = ((hi - lo) / 255).reshape(1)
        expected_zp = torch.round(-128 - lo / expected).to(torch.int8)
    torch.testing.assert_close(got[0], expected)
    assert torch.equal(got[1], expected_zp)


def test_seed_get_qparams_takes_g_idx_and_keeps_the_dict_without_arguments():
    fields = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
              "group_size": 16}
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(4))
    g_idx = torch.arange(32) % 2  # columns interleaved between the two groups
    obs = _legacy(**fields)
    scale, zp = obs.get_qparams(observed=w, g_idx=g_idx)
    expected = torch.stack([w[:, g_idx == g].abs().amax(1) for g in (0, 1)], 1) / 7.5
    torch.testing.assert_close(scale, expected)
    assert torch.equal(zp, torch.zeros_like(zp))
    assert torch.equal(scale, _legacy(**fields)(w, g_idx=g_idx)[0])
    qp = obs.get_qparams()  # no argument: the documented dict of the stored qparams
    assert set(qp) == {"scale", "zero_point", "global_scale"} and torch.equal(qp["scale"], scale)
    with pytest.raises(ValueError, match="g_idx and global_scale need observed"):
        obs.get_qparams(g_idx=g_idx)
    with pytest.raises(NotImplementedError, match="pass NVFP4 tensors whole"):
        obs.get_qparams(observed=w, global_scale=torch.ones(1))


def test_qparams_keep_the_statistics_float_dtype():
    lo, hi = torch.tensor([-1.0], dtype=torch.bfloat16), torch.tensor([3.0], dtype=torch.bfloat16)
    scale, zp = qparams_of_statistics(lo, hi, dict(INT8), "input", None)
    assert scale.dtype == torch.bfloat16 and zp.dtype == torch.int8


def test_tiny_scales_are_kept_and_zero_scales_become_eps():
    # compressed-tensors replaces only a scale that is 0 by eps: a tiny range keeps
    # amax / 127.5; an all-zero unit gets float32's eps (float64's for float64 statistics)
    lo = torch.tensor([-2.0e-6, 0.0])
    hi = torch.tensor([2.5e-6, 0.0])
    scale, _ = qparams_of_statistics(lo, hi, dict(INT8), "input", None)
    assert scale.tolist() == [torch.tensor(2.5e-6) / 127.5, torch.finfo(torch.float32).eps]
    scale, _ = qparams_of_statistics(lo.double(), hi.double(), dict(INT8), "input", None)
    assert scale[1].item() == torch.finfo(torch.float64).eps


def test_all_zero_asymmetric_unit_gets_zero_point_0():
    # their zero point qmin - 0 / 0 is NaN, which the cast to int8 makes 0
    lo, hi = torch.tensor([0.0, -1.0]), torch.tensor([0.0, 3.0])
    scale, zp = qparams_of_statistics(lo, hi, {**INT8, "symmetric": False}, "input", None)
    assert zp.tolist() == [0, round(-128 + 1.0 / (4.0 / 255))]
    assert scale[0].item() == torch.finfo(torch.float32).eps


def test_nvfp4_all_zero_block_without_scale_dtype_gets_float32_eps():
    # scale_dtype None: float32 block scales times the global scale; a 0 one becomes eps
    fields = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
              "group_size": 16}
    w = torch.cat([torch.full((1, 16), 3.0), torch.zeros(1, 16)])
    qp = _obs("memoryless_minmax", "weight", **fields)(w).get_qparams()
    gs = 448 * 6 / 3.0
    assert qp["scale"].reshape(-1).tolist() == [
        (torch.tensor(3.0) / 6 * torch.tensor(gs)).item(), torch.finfo(torch.float32).eps]


def test_nvfp4_input_zero_point_keeps_the_statistics_shape():
    # compressed-tensors broadcasts the scale with the [1] global scale, not the zero point
    fields = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
              "group_size": 16, "dynamic": "local"}
    obs = _obs("static_minmax", "input", **fields)
    obs.min_vals, obs.max_vals = torch.tensor(-2.0), torch.tensor(3.0)
    qp = obs.get_qparams()
    assert qp["scale"].shape == (1,) and qp["zero_point"].shape == ()


@pytest.mark.parametrize("name", ["memoryless_minmax", "minmax", "memoryless_mse", "mse"])
def test_float64_beyond_float32_range_is_refused_by_name(name):
    obs = _obs(name, "weight", strategy="tensor")
    with pytest.raises(ValueError, match=r"\('weight'\): float64 values beyond float32's "
                                         r"range"):
        obs(torch.randn(4, 8, dtype=torch.float64) * 1e300)
    obs = _obs(name, "input", strategy="tensor")
    obs.min_vals = torch.tensor([-1e300], dtype=torch.float64)
    obs.max_vals = torch.tensor([1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=type(obs).__name__ + r" \('input'\): float64"):
        obs.get_qparams()


def test_registered_names_are_compressed_tensors_standardized():
    # compressed-tensors' standardize_lookup_name: "_" and " " as "-", lower case
    names = lc.Observer.registered_names()
    assert "memoryless-minmax" in names and "nvfp4-expanded-mse" in names
    assert not any("_" in n for n in names)
    for spelling in ("memoryless_minmax", "memoryless-minmax", "Memoryless MinMax"):
        obs = lc.Observer.load_from_registry(spelling, base_name="input", args=dict(INT8))
        assert type(obs) is lc.MemorylessMinMaxObserver


def _fresh_registry():
    """A subclass: its own registry (compressed-tensors keys registries by class)."""
    return type("Base", (lc.Observer,), {})


def test_register_defaults_to_the_standardized_class_name_and_takes_aliases():
    base = _fresh_registry()

    @base.register()
    class Probe_One(lc.MemorylessMinMaxObserver):
        pass

    @base.register("Probe Two", alias=["two_b", "Two C"])
    class ProbeTwo(lc.MemorylessMinMaxObserver):
        pass

    assert base.registered_names() == ["probe-one", "probe-two"]
    assert sorted(base.registered_aliases()) == ["two-b", "two-c"]
    assert base.get_value_from_registry("PROBE_ONE") is Probe_One
    obs = base.load_from_registry("two c", base_name="input", args=dict(INT8))
    assert type(obs) is ProbeTwo
    assert base.registered_names() != lc.Observer.registered_names()  # kept apart
    assert type(base)("Sub", (base,), {}).registered_names() == []


def test_taken_names_and_aliases_are_refused_and_change_nothing():
    with pytest.raises(KeyError, match="Attempting to register alias minmax as minmax however "
                                       "minmax has already been registered as minmax"):
        lc.Observer.register("MinMax")(lc.MemorylessMinMaxObserver)
    assert lc.Observer.get_value_from_registry("minmax") is lc.MinMaxObserver
    base = _fresh_registry()
    base.register("a", alias="b")(lc.MinMaxObserver)
    for name, alias, taken in (("c", ["d", "B"], "b"), ("b", None, "b"), ("a", None, "a")):
        with pytest.raises(KeyError, match=f"alias {taken} as {name.lower()} however {taken} "
                                           "has already been registered as a"):
            base.register(name, alias=alias)(lc.StaticMinMaxObserver)
    with pytest.raises(KeyError, match="register alias e, that is identical to the "
                                       "standardized name: e"):
        base.register("e", alias="E")(lc.StaticMinMaxObserver)
    assert base.registered_names() == ["a"] and base.registered_aliases() == ["b"]
    with pytest.raises(KeyError, match="Unable to find d registered under type"):
        base.get_value_from_registry("d")


def test_registry_requires_subclass_checks_registering_and_loading():
    base = _fresh_registry()
    base.register("outside")(lc.MinMaxObserver)
    base.registry_requires_subclass = True
    with pytest.raises(ValueError, match="is not a subclass of the class it is registered"):
        base.get_value_from_registry("outside")
    with pytest.raises(ValueError, match="is not a subclass"):
        base.register("other")(lc.StaticMinMaxObserver)
    sub = base.register("inside")(type("Inside", (base,), {}))
    assert base.get_value_from_registry("inside") is sub
    assert base.registered_names() == ["outside", "inside"]


def test_registry_runs_no_file_named_in_a_registry_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # compressed-tensors would execute plug.py here
    mark = tmp_path / "ran"
    (tmp_path / "plug.py").write_text(f"open({str(mark)!r}, 'w').close()\nprobe = 1\n")
    for name in ("plug.py:probe", "Plug.py:PROBE", "a:b:c"):
        with pytest.raises(ValueError, match="runs no file a registry name points to"):
            lc.Observer.get_value_from_registry(name)
        with pytest.raises(ValueError, match="runs no file"):
            lc.Observer.load_from_registry(name, base_name="weight", args={"num_bits": 8})
    assert not mark.exists()


# --------------------------------------------------------------------------- imatrix
def _imatrix(module, **kwargs):
    obs = lc.IMatrixMSEObserver("weight", {"num_bits": 4, "symmetric": True,
                                           "strategy": "channel", "observer_kwargs": kwargs})
    obs.attach(module)
    return obs


def test_imatrix_attach_collects_and_detach_stops():
    lin = torch.nn.Linear(3, 2)
    obs = _imatrix(lin)
    x = torch.tensor([[[1.0, 2.0, 0.0]], [[3.0, 0.0, 1.0]]])
    lin(x)
    assert torch.equal(obs._imatrix_sum, torch.tensor([10.0, 4.0, 1.0]))
    assert obs._imatrix_count.item() == 2
    obs.detach(lin)
    lin(x)
    assert obs._imatrix_count.item() == 2
    obs.attach(torch.nn.ReLU())  # no in_features: nothing collected, the old hook removed
    assert obs._imatrix_hook is None and not lin._forward_pre_hooks


@pytest.mark.parametrize("norm", [0, -1, float("inf"), float("nan")])
def test_imatrix_norm_checked(norm):
    with pytest.raises(ValueError, match="norm must be a finite positive number"):
        _imatrix(torch.nn.Linear(4, 2), norm=norm)


@pytest.mark.parametrize("importance,match", [
    (None, "no importance data"), (torch.ones(3), "size mismatch"),
    (torch.tensor([1.0, -1.0, 1.0, 1.0]), "negative"), (torch.zeros(4), "all zeros"),
    (torch.tensor([1.0, float("nan"), 1.0, 1.0]), "non-finite")])
def test_imatrix_strict_refuses_and_lenient_falls_back(importance, match):
    lin = torch.nn.Linear(4, 2)
    for strict in (True, False):
        obs = _imatrix(lin, strict=strict)
        if importance is not None:
            obs._imatrix_sum, obs._imatrix_count = importance.clone(), torch.tensor(1)
        if strict:
            with pytest.raises(ValueError, match=match):
                obs(lin.weight)
        else:
            with pytest.warns(UserWarning, match=match):
                obs(lin.weight)
            assert obs.has_statistics


def test_imatrix_uniform_importance_is_the_unweighted_search_and_weights_move_it():
    torch.manual_seed(3)
    lin = torch.nn.Linear(8, 16)
    plain, weighted = _imatrix(lin), _imatrix(lin)
    plain._imatrix_sum, plain._imatrix_count = torch.ones(8), torch.tensor(1)
    skew = torch.tensor([1e3] * 4 + [1e-2] * 4)
    weighted._imatrix_sum, weighted._imatrix_count = skew, torch.tensor(1)
    lenient = _imatrix(lin)  # no data: the unweighted search
    with pytest.warns(UserWarning):
        lenient(lin.weight)
    plain(lin.weight), weighted(lin.weight)
    assert torch.equal(plain.max_vals, lenient.max_vals)
    assert not torch.equal(plain.max_vals, weighted.max_vals)
    plain.get_qparams()
    assert not hasattr(plain, "_imatrix_sum") and not plain.has_statistics


def _attention(strategies):
    attn = torch.nn.Module()
    for name, strategy in zip(("q_proj", "k_proj", "v_proj"), strategies):
        if strategy is None:
            setattr(attn, name, None)
            continue
        layer = torch.nn.Linear(32, 8, bias=False)
        layer.weight_observer = lc.MemorylessMinMaxObserver(
            "weight", {"num_bits": 4, "type": "float", "strategy": strategy, "group_size": 16})
        setattr(attn, name, layer)
    model = torch.nn.Module()
    model.attn = attn
    return model


def test_fuse_weight_observers_links_present_tensor_group_layers():
    model = _attention(["tensor_group", "tensor_group", None])  # a v_proj that is None
    lc.fuse_weight_observers(model)
    q, k = model.attn.q_proj.weight_observer, model.attn.k_proj.weight_observer
    assert q.fusion_handler.is_fused and k.fusion_handler.is_fused
    assert q.fusion_handler.module is model.attn.q_proj
    with torch.no_grad():
        model.attn.k_proj.weight[0, 0] = 30.0
    gs = q(model.attn.q_proj.weight).get_qparams()["global_scale"]
    assert torch.equal(gs, 448.0 * 6 / torch.tensor([30.0]))  # k's weight, observed by q's call


def test_fuse_weight_observers_refuses_mixed_groups():
    lc.fuse_weight_observers(_attention(["group", "group", "group"]))  # nothing to fuse
    with pytest.raises(AssertionError, match="non-TENSOR_GROUP"):
        lc.fuse_weight_observers(_attention(["tensor_group", "group", "tensor_group"]))


@pytest.mark.parametrize("name, fields", [
    ("memoryless_mse", {"num_bits": 4, "strategy": "channel"}),
    ("nvfp4_expanded_mse", {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                            "group_size": 16})])
def test_the_mse_search_off_the_cpu_runs_on_the_ops(name, fields):
    """Off the CPU (meta here: shapes only, through the ops' fake implementations; Triton on
    CUDA) the MSE classes' search prices every candidate in ``quantscope::`` ops and selects
    under llm-compressor's rules in one op, where the CPU's torch path ran a loop of tiles."""
    obs = lc.Observer.load_from_registry(name, base_name="weight", args={**INT8, **fields})
    with OpNames() as seen:
        obs(torch.randn(24, 64, device="meta"))
    price = "quantscope.mse_price_fp" if fields.get("type") == "float" \
        else "quantscope.mse_price_int"
    assert {price, "quantscope.mse_select"} <= seen.names
    assert obs.min_vals.device.type == "meta"


def test_an_attached_observer_is_no_target_of_compressed_tensors_matching():
    # found by probing: llm-compressor's Observer is a compressed-tensors InternalModule, so a
    # pattern matching every module skips the observer attached to a layer; ours was matched
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.utils.match import match_named_modules

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model[0].register_module("weight_observer", _obs("memoryless_minmax", "weight"))
    assert isinstance(model[0].weight_observer, ct.InternalModule)
    assert [n for n, _ in match_named_modules(model, ["re:.*"])] == ["", "0"]


@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "minmax",
                                  "memoryless_mse", "mse", "nvfp4_expanded_mse", "imatrix_mse"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_refused_weight_leaves_no_statistics(name, bad):
    # forward judges a weight by the statistics it made (NaN / inf reach every class's), not
    # by a read of the whole weight, and forgets them when it refuses: the fixed weight is
    # then observed as by a fresh observer, not skipped as "observed once"
    w = torch.randn(6, 32, generator=torch.Generator().manual_seed(3))
    bad_w = w.clone()
    bad_w[4, 7] = bad
    obs = _obs(name, "weight", strategy="channel")
    with pytest.raises(ValueError, match=r"\('weight'\): observed NaN or inf values"):
        obs(bad_w)
    assert not obs.has_statistics
    got, want = obs(w).get_qparams(), _obs(name, "weight", strategy="channel")(w).get_qparams()
    assert torch.equal(got["scale"], want["scale"])
    assert torch.equal(got["zero_point"], want["zero_point"])


@pytest.mark.parametrize("name", ["imatrix_mse", "nvfp4_expanded_imatrix"])
@pytest.mark.parametrize("strict", [False, True])
def test_imatrix_refuses_a_non_finite_weight_before_judging_its_importance(name, strict):
    # refused after the search, the weight first got the no-importance fallback's warning
    # (strict: its error instead of the NaN one)
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(4))
    w[5, 7] = float("nan")
    fmt = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16} \
        if name.startswith("nvfp4") else {**INT8, "strategy": "channel"}
    obs = lc.Observer.load_from_registry(name, base_name="weight", args={
        **fmt, "observer_kwargs": {"strict": strict}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning on the way
        with pytest.raises(ValueError, match=r"\('weight'\): observed NaN or inf values"):
            obs(w)
    assert not obs.has_statistics
