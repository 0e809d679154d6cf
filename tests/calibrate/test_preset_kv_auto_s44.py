"""``preset(..., "auto", kv_cache="fp8", **options)``: under auto the KV cache runs min-max,
so it takes only the options min-max takes (as every candidate does: docs/guide/calibrating.md);
it took them all, and calibrate failed on ``percentile`` (min-max takes none)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import llama

from quantscope.calibration import calibrate, preset
from quantscope.calibration.recipe import KV_CACHE
from quantscope.qparams import qparams_from_range

pytest.importorskip("transformers")


def _ema_value_scale(model, batches, c: float):
    """The value cache's fp8 scale under min-max with ``averaging_constant=c``, by hand: each
    batch's min and max of ``v_proj``'s output, ``state += c * (batch - state)`` in float32
    from the first batch's."""
    seen = []
    h = model.model.layers[0].self_attn.v_proj.register_forward_hook(
        lambda m, a, out: seen.append(torch.stack([out.min(), out.max()])))
    with torch.no_grad():
        for b in batches:
            model(b)
    h.remove()
    state = seen[0].clone()
    for s in seen[1:]:
        state += c * (s - state)
    return qparams_from_range(state[:1], state[1:], KV_CACHE["fp8"]).scale


def test_auto_kv_cache_keeps_only_the_options_min_max_takes():
    r = preset("w8a8", "auto", kv_cache="fp8", percentile=99.0, averaging_constant=0.5)
    assert r.kv_cache.observer == "minmax"
    assert dict(r.kv_cache.options) == {"averaging_constant": 0.5}
    assert dict(r.rules[0].input.options) == {"percentile": 99.0, "averaging_constant": 0.5}
    assert dict(preset("fp8-kv", "auto", percentile=99.0).kv_cache.options) == {}


def test_auto_with_an_option_the_kv_cache_does_not_take_calibrates():
    model, batches = llama()
    auto = calibrate(model, batches, preset("w8a8", "auto", kv_cache="fp8", percentile=99.0),
                     progress=False)
    plain = calibrate(model, batches, preset("w8a8", "minmax", kv_cache="fp8"), progress=False)
    attn = "model.layers.0.self_attn"
    for role in ("key", "value"):
        got, want = auto.states[attn][role], plain.states[attn][role]
        assert got.observer == "minmax" and dict(got.options) == {}
        assert torch.equal(got.qparams.scale, want.qparams.scale)
    assert torch.equal(auto.states[attn]["value"].qparams.scale,
                       _ema_value_scale(model, batches, 0.01))  # min-max's default


def test_auto_kv_cache_still_gets_an_option_min_max_takes():
    model, batches = llama()
    auto = calibrate(model, batches, preset("w8a8", "auto", kv_cache="fp8",
                                            averaging_constant=0.5), progress=False)
    got = auto.states["model.layers.0.self_attn"]["value"]
    assert dict(got.options) == {"averaging_constant": 0.5}
    want = _ema_value_scale(model, batches, 0.5)
    assert torch.equal(got.qparams.scale, want)
    assert not torch.equal(want, _ema_value_scale(model, batches, 0.01))  # it tells them apart
