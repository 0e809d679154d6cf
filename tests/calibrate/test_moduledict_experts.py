"""transformers' ModuleDict experts (SwitchTransformers, NLLB-MoE: ``experts.expert_<e>.wi``)
are MoE experts as a ModuleList's are: token counts, the pooled range for an expert without
tokens, one static input scale per experts module and slot, the fusion detection's siblings,
keep_float and check grouping them by slot (found by probing: only a ModuleList was
recognised, so such experts kept different scales and a no-token expert's input stayed float)."""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import quantscope
from quantscope.calibration.choice.sensitivity import Sensitivity, keep_float
from quantscope.calibration.structure import moe
from quantscope.exporters import check
from quantscope.exporters.moe_slots import expert_index, expert_slot

transformers = pytest.importorskip("transformers")


def _switch():
    torch.manual_seed(0)
    cfg = transformers.SwitchTransformersConfig(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, num_experts=8, expert_capacity=64, num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1)
    return transformers.SwitchTransformersForConditionalGeneration(cfg).eval(), 8


def _nllb():
    torch.manual_seed(0)
    cfg = transformers.NllbMoeConfig(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, num_experts=4, expert_capacity=64, encoder_sparse_step=2,
        decoder_sparse_step=2, max_position_embeddings=64)
    # its experts ModuleDict also holds ``token_dropout``: no expert
    return transformers.NllbMoeForConditionalGeneration(cfg).eval(), 4


def _batches():
    return [{"input_ids": torch.randint(3, 100, (1, 4), generator=torch.Generator().manual_seed(i)),
             "decoder_input_ids": torch.randint(3, 100, (1, 3),
                                                generator=torch.Generator().manual_seed(9 + i))}
            for i in range(2)]


@pytest.fixture(scope="module", params=[_switch, _nllb], ids=["switch", "nllb_moe"])
def calibrated(request):
    model, n = request.param()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calib = quantscope.calibrate(model, _batches(), "w8a8", progress=False)
    mods = [name for name, m in model.named_modules() if name.endswith(".experts")]
    return calib, mods, n, [str(w.message) for w in caught]


def test_moduledict_experts_pooled_and_one_input_scale_per_slot(calibrated):
    calib, mods, n, caught = calibrated
    assert len(mods) == 2  # one sparse encoder and one sparse decoder block
    assert not [w for w in caught if "saw no tokens" in w]
    for mod in mods:
        slots: dict = {}
        for layer, roles in calib.states.items():
            if layer.startswith(f"{mod}.expert_"):
                st = roles.get("input")
                assert st is not None and st.qparams is not None, layer  # no float input
                slots.setdefault(layer.rpartition(".")[2], {})[layer] = float(st.qparams.scale)
        assert len(slots) == 2 and all(len(v) == n for v in slots.values())
        for proj, scales in slots.items():
            assert len(set(scales.values())) == 1, (mod, proj, scales)


def test_moduledict_experts_token_report(calibrated):
    calib, mods, n, _ = calibrated
    rows = calib.info["experts"]
    assert sorted({r["module"] for r in rows}) == sorted(mods)
    assert all(sorted(r["expert"] for r in rows if r["module"] == m) == list(range(n))
               for m in mods)
    none = [r for r in rows if r["tokens"] == 0]
    assert none and all(r["rule"] == "pooled (no tokens)" for r in none)
    assert sum(r["tokens"] for r in rows) > 0


def test_expert_item_name_rule():
    assert [expert_index(k) for k in ("3", "expert_3", "token_dropout", "expert_", "x3")] == [
        3, 3, None, None, None]
    assert expert_slot("m.experts.expert_2.wi") == ("m.experts", "wi")
    assert expert_slot("m.experts.expert_2.wo") == ("m.experts", "wo")
    assert expert_slot("m.experts.expert_2.w1") == ("m.experts", "w13")
    assert expert_slot("m.experts.2.gate_proj") == ("m.experts", "w13")
    d = nn.ModuleDict({"expert_0": nn.Linear(2, 2), "expert_1": nn.Linear(2, 2),
                       "token_dropout": nn.Dropout()})
    assert moe.is_expert_list("a.experts", d)
    assert not moe.is_expert_list("a.heads", d)
    assert not moe.is_expert_list("a.experts", nn.ModuleDict({"expert_1": nn.Linear(2, 2)}))
    assert not moe.is_expert_list("a.experts", nn.ModuleDict({"a": nn.Linear(2, 2)}))
    assert moe.is_expert_list("a.experts", nn.ModuleList())  # as before


class _Expert(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w1, self.w3, self.w2 = (nn.Linear(d, d, bias=False) for _ in range(3))

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _DictMoe(nn.Module):
    """transformers' ModuleDict experts loop: an expert given no token is not called; a batch
    whose first value is over 100 routes every token to expert 0."""

    def __init__(self, d=16, n=4):
        super().__init__()
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleDict({f"expert_{e}": _Expert(d) for e in range(n)})
        self.experts["token_dropout"] = nn.Dropout(0.0)

    def forward(self, x):
        idx = self.gate(x).argmax(-1)
        if x[0, 0] > 100:
            idx = torch.zeros_like(idx)
        out = torch.zeros_like(x)
        for e in range(4):
            tok = torch.where(idx == e)[0]
            if tok.numel():
                out.index_add_(0, tok, self.experts[f"expert_{e}"](x[tok]))
        return out


def test_moduledict_expert_skipped_by_detection_still_fused():
    torch.manual_seed(0)
    model = nn.Sequential(_DictMoe()).eval()
    first = torch.randn(16, 16)
    first[0, 0] = 1000.0
    calib = quantscope.calibrate(model, [first] + [torch.randn(64, 16) for _ in range(2)],
                                 "nvfp4", progress=False)
    groups = [tuple(g["layers"]) for g in calib.info["fusion_groups"]]
    assert groups == [(f"0.experts.expert_{e}.w1", f"0.experts.expert_{e}.w3")
                      for e in range(4)]
    for e in range(4):
        g1, g3 = (calib.states[f"0.experts.expert_{e}.{k}"]["weight"].qparams.global_scale
                  for k in ("w1", "w3"))
        assert torch.equal(g1, g3), e


def test_keep_float_takes_a_moduledict_slot_whole(calibrated):
    calib, mods, n, _ = calibrated
    layer = next(k for k in calib.states if k.startswith(f"{mods[0]}.expert_1."))
    sens = Sensitivity([{"layer": layer, "role": "input", "observer": "minmax",
                         "divergence": 1.0}])
    kept = keep_float(calib, sens, 1)
    proj = layer.rpartition(".")[2]
    assert sorted(kept.info["keep_float"]["tensors"]) == sorted(
        f"{mods[0]}.expert_{e}.{proj} input" for e in range(n))


def test_check_groups_moduledict_experts_by_slot(tmp_path):
    mod = "encoder.block.1.layer.1.mlp.experts"
    t = {}
    for e in range(3):
        for p, scale in (("wi", 0.125 * (e + 1)), ("wo", 0.25)):
            t[f"{mod}.expert_{e}.{p}.weight"] = torch.zeros(4, 4).to(torch.float8_e4m3fn)
            t[f"{mod}.expert_{e}.{p}.weight_scale"] = torch.tensor([0.5])
            t[f"{mod}.expert_{e}.{p}.input_scale"] = torch.tensor([scale])
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "switch_transformers", "quantization_config": {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {}}}))
    save_file(t, str(tmp_path / "model.safetensors"))
    problems = check(tmp_path)
    assert [(p["group"], p["experts"], p["tensor"]) for p in problems] == [
        (mod, "wi", "input_scale")]
