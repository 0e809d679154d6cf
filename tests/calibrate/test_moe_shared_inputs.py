"""One input scale per MoE layer: vLLM's fused MoE quantizes every expert's gate_up input with
one static scale and every down input with another (compressed_tensors_moe_w8a8_fp8:
``w13_input_scale.max()``, ``w2_input_scale.max()``; its FlashInfer NVFP4 MoE: the max of
``1 / input_global_scale``), so every expert of a module gets the module's widest range."""

import pytest
import torch

from quantscope import fake_quantize, qparams_from_range
from quantscope.calibration import calibrate
from quantscope.calibration.recipe import scheme
from quantscope.exporters import check

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from tiny_models import mixtral

NAME = "model.layers.{}.mlp.experts"
#: compressed-tensors' schemes as llm-compressor runs them: inputs observed by the running
#: min / max over all batches (static_minmax), weights per tensor (FP8) by min-max
IGNORE = ["lm_head", r"re:.*mlp\.gate$"]


@pytest.fixture(scope="module")
def uneven():
    """tiny_models' Mixtral with experts of different magnitude (as in real MoEs), so their
    own input ranges differ."""
    model, batches = mixtral()
    with torch.no_grad():
        for layer in model.model.layers:
            for e in range(layer.mlp.experts.gate_up_proj.shape[0]):
                layer.mlp.experts.gate_up_proj[e] *= 1 + e
    return model, batches


def float_inputs(model, batches):
    """``{(layer, proj): (lo, hi)}``: the range of every expert's float input over the routed
    tokens, merged over the experts of each layer, from the experts module's own arguments
    (hidden states, routing) and weights: no quantscope code."""
    seen = {}

    def pre(i, ex):
        def hook(mod, args, kwargs):
            x, idx = args[0], args[1]
            for e in range(ex.gate_up_proj.shape[0]):
                tok = torch.where((idx == e).any(-1))[0]
                if not tok.numel():
                    continue
                xe = x[tok]
                gate, up = (xe @ ex.gate_up_proj[e].T).chunk(2, dim=-1)
                for proj, t in (("gate_up_proj", xe), ("down_proj", ex.act_fn(gate) * up)):
                    lo, hi = seen.get((i, proj), (float("inf"), float("-inf")))
                    seen[(i, proj)] = (min(lo, float(t.min())), max(hi, float(t.max())))
        return hook

    handles = [layer.mlp.experts.register_forward_pre_hook(pre(i, layer.mlp.experts),
                                                          with_kwargs=True)
               for i, layer in enumerate(model.model.layers)]
    try:
        with torch.inference_mode():
            for b in batches:
                model(b)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_fp8_static_inputs_share_the_widest_range_per_module(uneven, tmp_path):
    model, batches = uneven
    calib = calibrate(model, batches, scheme("FP8", ignore=IGNORE), progress=False)
    ranges = float_inputs(model, batches)
    for (i, proj), (lo, hi) in ranges.items():
        scales = set()
        for e in range(4):
            st = calib.states[f"{NAME.format(i)}.{e}.{proj}"]["input"]
            want = qparams_from_range(torch.tensor([lo]), torch.tensor([hi]), st.spec)
            torch.testing.assert_close(st.qparams.scale.reshape(-1), want.scale.reshape(-1))
            scales.add(float(st.qparams.scale))
        assert len(scales) == 1, (i, proj, scales)
        # the report describes the served range, not each expert's own
        rows = [r for r in calib.stats if r["role"] == "input"
                and r["layer"].startswith(f"{NAME.format(i)}.") and r["layer"].endswith(proj)]
        (served,) = {(r["lo"], r["hi"]) for r in rows}
        assert served == pytest.approx((lo, hi), rel=1e-6)
    # the export holds the one scale per module and input, which `check` accepts
    calib.export(model, tmp_path / "ct")
    assert check(tmp_path / "ct") == []
    # apply() quantizes expert 0's down input on that scale (what vLLM serves)
    seen = {}
    with calib.apply(model):
        child = model.model.layers[0].mlp.experts._modules["0"].down_proj
        h = child.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0].clone()))
        with torch.inference_mode():
            model(batches[0])
        h.remove()
    st = calib.states[f"{NAME.format(0)}.0.down_proj"]["input"]
    assert torch.equal(fake_quantize(seen["x"], st.qparams, st.spec), seen["x"])


def test_nvfp4_input_global_amax_is_the_modules_largest(uneven):
    model, batches = uneven
    calib = calibrate(model, batches, scheme("NVFP4", ignore=IGNORE), progress=False)
    for (i, proj), (lo, hi) in float_inputs(model, batches).items():
        for e in range(4):
            st = calib.states[f"{NAME.format(i)}.{e}.{proj}"]["input"]
            torch.testing.assert_close(st.global_amax.reshape(()).float(),
                                       torch.tensor(max(-lo, hi)))


def test_weights_keep_per_expert_scales(uneven):
    model, batches = uneven
    calib = calibrate(model, batches, scheme("FP8", ignore=IGNORE), progress=False)
    for i, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts
        for e in range(4):
            for proj in ("gate_up_proj", "down_proj"):
                st = calib.states[f"{NAME.format(i)}.{e}.{proj}"]["weight"]
                amax = getattr(ex, proj)[e].detach().abs().amax()  # fp8 per tensor: amax / 448
                torch.testing.assert_close(st.qparams.scale.reshape(()), amax / 448)
