"""``Recipe.with_observer("auto", **options)`` and ``preset(..., "auto", kv_cache="fp8",
**options)`` treat the KV cache by one rule: auto chooses no KV scales, so the KV role keeps
its observer (min-max for ``kv_cache="fp8"``) and takes those of the options that observer
takes, as a run-time role does. ``with_observer`` left the KV role as it was, so
``preset("fp8-kv").with_observer("auto", averaging_constant=0.5)`` calibrated the KV cache
with min-max's default 0.01, and a KV-cache-only recipe dropped an option silently."""

from __future__ import annotations

import pytest
import torch
from tiny_models import llama

from quantscope.calibration import calibrate, preset
from quantscope.calibration.recipe import KV_CACHE, Recipe, Role

pytest.importorskip("transformers")


@pytest.mark.parametrize("options", [{"averaging_constant": 0.5},
                                     {"averaging_constant": 0.5, "percentile": 99.0}])
def test_with_observer_gives_the_kv_cache_what_preset_gives_it(options):
    got = preset("fp8-kv").with_observer("auto", **options)
    want = preset("fp8-kv", "auto", **options)
    assert got.kv_cache == want.kv_cache
    assert got.kv_cache.observer == "minmax"
    assert dict(got.kv_cache.options) == {"averaging_constant": 0.5}  # min-max's alone
    assert got.rules == want.rules


def test_a_kv_role_naming_its_observer_keeps_it_under_auto():
    kv = Role(KV_CACHE["fp8"], "mse", options={"maxshrink": 0.5})
    got = Recipe((), kv_cache=kv).with_observer("auto", grid=50, non_finite="ignore").kv_cache
    assert got.observer == "mse"
    assert dict(got.options) == {"maxshrink": 0.5, "grid": 50, "non_finite": "ignore"}
    assert Recipe((), kv_cache=kv).with_observer("auto").kv_cache == kv  # nothing given


def test_a_kv_roles_own_option_is_kept_whole_under_auto():
    """The KV role keeps its observer under auto, and so its own options as written (as a
    run-time role keeps its own): one its observer does not take is not dropped in silence,
    the calibration refuses it naming it."""
    kv = Role(KV_CACHE["fp8"], "minmax", options={"percentile": 99.0})
    got = Recipe((), kv_cache=kv).with_observer("auto", non_finite="ignore").kv_cache
    assert got.observer == "minmax"
    assert dict(got.options) == {"percentile": 99.0, "non_finite": "ignore"}
    model, batches = llama()
    with pytest.raises(ValueError, match=r"self_attn' key: observer 'minmax'.*'percentile'"):
        calibrate(model, batches, Recipe((), kv_cache=kv).with_observer("auto"), progress=False)


def test_an_option_the_kv_cache_alone_does_not_take_is_refused():
    # no rule: the KV cache's min-max is the only observer, and it takes no percentile
    with pytest.raises(ValueError, match=r"option 'percentile' .*key observer 'minmax'.*"
                                         r"it would be dropped"):
        Recipe((), kv_cache="fp8").with_observer("auto", percentile=99.0)


def test_the_kv_cache_calibrates_with_the_option():
    model, batches = llama()
    auto = Recipe((), kv_cache="fp8").with_observer("auto", averaging_constant=0.5)
    hand = Recipe((), kv_cache=Role(KV_CACHE["fp8"], "minmax",
                                    options={"averaging_constant": 0.5}))
    default = Recipe((), kv_cache="fp8")
    got, want, old = (calibrate(model, batches, r, progress=False).states[
        "model.layers.0.self_attn"]["value"] for r in (auto, hand, default))
    assert dict(got.options) == {"averaging_constant": 0.5}
    assert torch.equal(got.qparams.scale, want.qparams.scale)
    assert not torch.equal(got.qparams.scale, old.qparams.scale)  # it tells them apart
