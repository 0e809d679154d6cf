"""compat.llmcompressor: forward's qparams are reused by get_qparams only while the state and
the tensors handed out are unchanged (a write into them is never seen by the next call)."""

import pickle

import torch

import quantscope as qs

ARGS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
        "scale_dtype": torch.float8_e4m3fn}


def _obs(name="memoryless_minmax", args=ARGS):
    return qs.get_observer(f"llmcompressor:{name}", base_name="weight", args=dict(args))


def test_get_qparams_after_forward_equals_a_fresh_computation():
    w = torch.randn(64, 128)
    o = _obs()
    scale, _zp = o(w)
    again = o.get_qparams()
    fresh = o.qparams()
    assert torch.equal(again["scale"], scale) and torch.equal(again["scale"], fresh.scale)
    assert torch.equal(again["global_scale"], fresh.global_scale)
    assert again["zero_point"].dtype == torch.float8_e4m3fn
    assert not again["zero_point"].float().any()


def test_a_new_batch_or_a_reset_is_seen():
    for name in ("memoryless_minmax", "static_minmax", "minmax"):
        o = _obs(name, {"num_bits": 4, "strategy": "group", "group_size": 32})
        o(torch.randn(8, 64))
        first = o.get_qparams()["scale"]
        o(torch.randn(8, 64) * 10)
        assert torch.equal(o.get_qparams()["scale"], o.qparams().scale)
        assert not torch.equal(o.get_qparams()["scale"], first)


def test_writing_into_returned_scales_does_not_change_the_next_answer():
    o = _obs()
    scale, _ = o(torch.randn(32, 64))
    want = scale.clone()
    scale.fill_(0)
    got = o.get_qparams()["scale"]
    assert torch.equal(got, want)
    got.fill_(0)
    assert torch.equal(o.get_qparams()["scale"], want)


def test_a_loaded_state_is_seen():
    a, b = _obs("static_minmax"), _obs("static_minmax")
    a(torch.randn(16, 64))
    b(torch.randn(16, 64) * 3)
    b.get_qparams()
    b.load_state_dict(a.state_dict())
    assert torch.equal(b.get_qparams()["scale"], a.get_qparams()["scale"])


def test_get_qparams_after_forward_hands_out_forward_s_tensors():
    """No copy of a million NVFP4 block scales per weight: one computation, one set of tensors
    (llm-compressor's flow calls forward, then get_qparams)."""
    o = _obs()
    scale, zp = o(torch.randn(64, 128))
    qp = o.get_qparams()
    assert qp["scale"] is scale and qp["zero_point"] is zp
    again = o.get_qparams()
    assert all(again[k] is qp[k] for k in qp)
    o.args["zp_dtype"] = torch.float16  # another zero-point dtype: computed again
    assert o.get_qparams()["zero_point"].dtype == torch.float16


def test_an_observed_observer_pickles_without_its_cache():
    """The cache held float8 zero points, which torch's pickle writes but cannot read back."""
    for name in ("memoryless_minmax", "static_minmax"):
        o = _obs(name)
        w = torch.randn(16, 64)
        o(w)
        back = pickle.loads(pickle.dumps(o))
        assert back._qp_cache == [None] and o._qp_cache[0] is not None
        assert torch.equal(back.get_qparams()["scale"], o.get_qparams()["scale"])
