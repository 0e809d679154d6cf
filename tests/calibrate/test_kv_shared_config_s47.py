"""Two models built from ONE config object (``from_config(a.config)``, ``LlamaForCausalLM(cfg)``
twice) calibrate and apply their KV caches independently (s47): the routed attention function
finds each call's callbacks by module, and the config is restored when the last attachment on
it detaches. Each model's results are those of its copy on a config of its own (the KV path
alone: tests/calibrate/test_kv_cache.py). Before, the second model's attach refused the shared
config as "already routed through quantscope (QDQ still applied?)", in one thread too."""

import copy
import threading

import pytest
import torch
from tiny_models import llama

from quantscope.calibration import calibrate, preset
from quantscope.calibration.structure import kv_cache

transformers = pytest.importorskip("transformers")

RECIPE = preset("w8a8", kv_cache="fp8")


def _pair():
    """``(a, b, b_alone, batches)``: b built on a's config object, b_alone b's copy (its own
    config, the same weights)."""
    a, batches = llama()
    torch.manual_seed(1)
    b = transformers.LlamaForCausalLM(a.config).eval()
    assert b.config is a.config
    return a, b, copy.deepcopy(b), batches


def _kv(calib) -> dict:
    return {f"{n}.{r}": st.qparams.scale for n, roles in calib.states.items()
            for r, st in roles.items() if r in kv_cache.ROLES}


def _same(x: dict, y: dict) -> bool:
    return x.keys() == y.keys() and len(x) > 0 and all(torch.equal(x[k], y[k]) for k in x)


def _logits(model, x):
    with torch.inference_mode():
        return model(x).logits


def test_calibrate_and_apply_one_model_while_the_other_is_applied():
    a, b, b_alone, batches = _pair()
    cfg, impl, x = a.config, a.config._attn_implementation, batches[0]
    cal_a, want_b = calibrate(a, batches, RECIPE, progress=False), \
        calibrate(b_alone, batches, RECIPE, progress=False)
    with cal_a.apply(a):
        qa = _logits(a, x)
    with want_b.apply(b_alone):
        qb = _logits(b_alone, x)
    floats = _logits(a, x)
    ha = cal_a.apply(a)
    cal_b = calibrate(b, batches, RECIPE, progress=False)  # inside a's apply: refused before
    assert _same(_kv(cal_b), _kv(want_b))
    hb = cal_b.apply(b)
    assert torch.equal(_logits(a, x), qa) and torch.equal(_logits(b, x), qb)
    ha.remove()  # b still applied: the config stays routed, b's cache still quantized
    assert cfg._attn_implementation != impl
    assert torch.equal(_logits(b, x), qb) and torch.equal(_logits(a, x), floats)
    hb.remove()  # the last attachment: the user's choice back
    assert cfg._attn_implementation == impl and kv_cache._chosen(cfg) is None
    assert not torch.equal(qa, floats)


class _Slow:
    """Batches slow enough that two calibrations overlap."""

    def __init__(self, batches, started: threading.Barrier):
        self.batches, self.started = batches, started

    def __iter__(self):
        self.started.wait(timeout=60)
        for b in self.batches:
            threading.Event().wait(0.02)
            yield b


def test_two_threads_calibrate_models_sharing_a_config():
    a, b, b_alone, batches = _pair()
    impl = a.config._attn_implementation
    want = {"a": _kv(calibrate(copy.deepcopy(a), batches, RECIPE, progress=False)),
            "b": _kv(calibrate(b_alone, batches, RECIPE, progress=False))}
    got, errors, started = {}, {}, threading.Barrier(2)

    def run(name, model):
        try:
            got[name] = _kv(calibrate(model, _Slow(batches, started), RECIPE, progress=False))
        except Exception as e:  # noqa: BLE001 (reported below, by thread)
            errors[name] = repr(e)
    threads = [threading.Thread(target=run, args=(n, m)) for n, m in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert _same(got["a"], want["a"]) and _same(got["b"], want["b"])
    assert a.config._attn_implementation == impl


def test_attach_and_detach_from_two_threads_on_one_config():
    a, b, _, batches = _pair()
    cfg, impl, rounds = a.config, a.config._attn_implementation, 10
    seen = {"a": [], "b": []}
    errors, sync = [], threading.Barrier(2, timeout=60)

    def loop(name, model):
        callbacks = {n: (lambda role, t: seen[name].append(role) or t)
                     for n in kv_cache.attention_modules(model)}
        try:
            for _ in range(rounds):
                undo = kv_cache.attach(model, callbacks)
                sync.wait()  # both attached on the one config
                _logits(model, batches[0])  # its own callbacks only
                undo()
                sync.wait()  # both detached: the last one restored the user's choice
                assert cfg._attn_implementation == impl
                sync.wait()  # (before either attaches again)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))
            sync.abort()
    threads = [threading.Thread(target=loop, args=(n, m)) for n, m in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not [e for e in errors if "BrokenBarrierError" not in e], errors
    assert not errors
    assert seen["a"] == seen["b"] == ["key", "value"] * 2 * rounds  # 2 layers a forward
    assert kv_cache._chosen(cfg) is None


def test_one_attention_attached_twice_is_refused_by_name():
    a, _, _, _ = _pair()
    callbacks = {n: (lambda role, t: t) for n in kv_cache.attention_modules(a)}
    undo = kv_cache.attach(a, callbacks)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn' is already routed"):
        kv_cache.attach(a, callbacks)
    undo()
    assert a.config._attn_implementation == "sdpa"
