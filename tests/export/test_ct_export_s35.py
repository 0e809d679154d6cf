"""compressed-tensors export, probe s35: block fp8 MoE experts split by tile rows, a quantized
embedding told as vLLM serves it, and the int-weight servability message."""

import warnings

import pytest
import torch

from quantscope import QuantSpec
from quantscope.calibration import Calibration, Recipe, Role, Rule, calibrate
from quantscope.calibration.recipe import scheme
from quantscope.calibration.results.apply import qdq_tensor
from quantscope.calibration.structure import fusion
from quantscope.exporters import check, serving
from quantscope.exporters.serving import vllm_refusal
from quantscope.layout import Block, Channel, Group, Tile
from quantscope.observers import get_observer

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from test_export_experts import _decompress, _tensors

FP8 = "fp8_e4m3"


def _mixtral(hidden, inter):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=hidden, intermediate_size=inter,
                                     num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=100,
                                     num_local_experts=4, num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(cfg).eval()
    return model, [torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(i))
                   for i in range(2)]


def _fp8_block(*ignore):
    return scheme("FP8_BLOCK", ignore=("lm_head", "re:.*gate$", *ignore))


def test_fp8_block_experts_export_split_by_tile_rows(tmp_path):
    """compressed-tensors' FP8_BLOCK on MoE experts whose intermediate size (256) is whole
    tiles: gate and up are written apart, weight_scale [rows / 128, cols / 128] each, their
    block rows concatenated are the fused state's (vLLM's w13 scale, [2 I / 128, H / 128]),
    and compressed-tensors decompresses them bit for bit to the calibrated QDQ."""
    model, batches = _mixtral(256, 256)
    calib = calibrate(model, batches, _fp8_block(), progress=False)
    out = tmp_path / "ct"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calib.export(model, out)
    assert not [w for w in caught if "vLLM" in str(w.message)]  # served: dynamic input
    assert check(out) == []
    tensors = _tensors(out)
    ex = model.model.layers[0].mlp.experts
    for e in range(4):
        disk = f"model.layers.0.block_sparse_moe.experts.{e}"
        fused = calib.states[f"model.layers.0.mlp.experts.{e}.gate_up_proj"]["weight"]
        assert tuple(fused.qparams.scale.shape) == (4, 2)
        for shard in ("w1", "w3", "w2"):
            assert tuple(tensors[f"{disk}.{shard}.weight"].shape) == (256, 256)
            assert tuple(tensors[f"{disk}.{shard}.weight_scale"].shape) == (2, 2)
        w13 = torch.cat([tensors[f"{disk}.w1.weight_scale"],
                         tensors[f"{disk}.w3.weight_scale"]], 0)
        assert torch.equal(w13, fused.qparams.scale.to(w13.dtype))
        ref = qdq_tensor(ex.gate_up_proj.detach()[e], fused)
        down = calib.states[f"model.layers.0.mlp.experts.{e}.down_proj"]["weight"]
        want = {"w1": ref[:256], "w3": ref[256:],
                "w2": qdq_tensor(ex.down_proj.detach()[e], down)}
        for shard, w in want.items():
            assert torch.equal(_decompress(out, tensors, f"{disk}.{shard}."), w), (e, shard)
    back = Calibration.from_compressed_tensors(out)  # w1 / w3 tile rows joined back
    for layer, roles in calib.states.items():
        for role, state in roles.items():
            assert back.states[layer][role].quantizes_like(state), (layer, role)


def test_fp8_block_experts_whose_halves_split_a_tile_refused(tmp_path):
    """An intermediate size (192) that 128-row tiles do not divide: a tile holds gate and up
    rows, which no per-expert w1 / w3 can carry: refused, naming the layer and the rows."""
    model, batches = _mixtral(128, 192)  # (down_proj in float: its input's 128-groups)
    calib = calibrate(model, batches, _fp8_block("re:.*down_proj$"), progress=False)
    with pytest.raises(ValueError, match=r"experts\.0\.gate_up_proj.*tile:128x128.*"
                                         r"spanning rows of both gate and up \(192 rows"):
        calib.export(model, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()


@pytest.mark.parametrize("layout, rows, ok", [
    (Tile(128, 128), [256, 256], True), (Tile(128, 128), [256, 100], True),
    (Tile(128, 128), [192, 192], False), (Tile(128, 128), [100, 256], False),
    (Tile(64, 128), [128, 128], True), (Group(16, axis=0), [32, 48], True),
    (Group(16, axis=0), [24, 24], False), (Block(16, axis=0), [32, 40], True),
    (Block(16, axis=0), [40, 32], False), (Channel(1), [32, 32], False),
    (Group(16), [3, 5], True)], ids=str)
def test_split_state_cuts_the_grid_by_the_layouts_rows(layout, rows, ok):
    """The joined weights' state split back per member is each member's own state where the
    member's rows are whole units (tiles, row-runs; the last member's padding is its own),
    and is refused where a unit holds rows of two members."""
    spec = QuantSpec(FP8, layout)
    shapes = [(r, 256) for r in rows]
    assert fusion.splittable(spec, shapes) is ok
    ws = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in
          enumerate(shapes)]
    joined = torch.cat(ws, 0)

    def state(w):
        from quantscope.calibration.results.role_state import RoleState

        obs = get_observer("memoryless_minmax", spec)
        obs(w)
        lo, hi, qp = obs.range_and_qparams()
        return RoleState(spec, "memoryless_minmax", "memoryless_minmax", qparams=qp, lo=lo,
                         hi=hi, shape=tuple(w.shape))

    if not ok:
        with pytest.raises(ValueError, match="split_state: .* span rows of two members"):
            fusion.split_state(state(joined), shapes)
        return
    for part, w in zip(fusion.split_state(state(joined), shapes), ws):
        own = state(w)
        assert part.shape == own.shape
        for a, b in ((part.qparams.scale, own.qparams.scale), (part.lo, own.lo),
                     (part.hi, own.hi), (part.qparams.zero_point, own.qparams.zero_point)):
            assert a.shape == b.shape and torch.equal(a, b)
        assert torch.equal(qdq_tensor(w, part), qdq_tensor(w, own))


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=64, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("spec, served", [(QuantSpec("int8", Channel(0)), True),
                                          (QuantSpec("int8", Channel(0), symmetric=False),
                                           False)], ids=["int8-sym", "int8-asym"])
def test_quantized_embedding_export_warns(spec, served, tmp_path):
    """A quantized nn.Embedding (judged by class, whatever its name): older vLLM builds every
    embedding unquantized and cannot load its packed weight, recent vLLM only weight-only
    symmetric int per channel / group in models that pass quant_config to it: the export says
    so, naming the layer; the Linears' groups are not named."""
    model = _llama()
    rec = Recipe((Rule(("Embedding",), weight=Role(spec, "memoryless_minmax")),),
                 ("lm_head",), "emb")
    calib = calibrate(model, [torch.randint(0, 64, (2, 8))], rec, progress=False)
    with pytest.warns(UserWarning, match=r"quantizes the embeddings 'model\.embed_tokens'") as w:
        calib.export(model, tmp_path / "ct")
    (msg,) = [str(x.message) for x in w if "embeddings" in str(x.message)]
    assert "older vLLM builds every embedding unquantized" in msg
    assert ("passes quant_config" in msg) is served
    assert ("weight-only symmetric int" in msg) is not served


def test_linear_only_export_names_no_embedding(tmp_path):
    model = _llama()
    rec = Recipe((Rule(("Linear",), weight=Role(QuantSpec("int8", Channel(0)),
                                                "memoryless_minmax")),), ("lm_head",), "w8")
    calib = calibrate(model, [torch.randint(0, 64, (2, 8))], rec, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calib.export(model, tmp_path / "ct")
    assert not [x for x in caught if "embedding" in str(x.message)]


def test_embedding_rule_reads_the_scheme():
    w8 = {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True,
          "dynamic": False}
    assert "passes quant_config" in serving.vllm_embedding_refusal(w8, None, "pack-quantized")
    fp8 = dict(w8, type="float")
    assert "got float8 channel, float-quantized" in serving.vllm_embedding_refusal(
        fp8, None, "float-quantized")
    assert serving.vllm_embedding_refusal(None) is None


W5 = {"type": "int", "num_bits": 5, "strategy": "group", "group_size": 128, "symmetric": True,
      "dynamic": False}
A8 = {"type": "int", "num_bits": 8, "strategy": "token", "symmetric": True, "dynamic": True}


def test_int_weight_message_names_the_weight_bits():
    """W5A8 with the dynamic per-token input vLLM's W4A8 takes: the problem is the weight
    bits (and the format WNA8 needs), not the input."""
    why = vllm_refusal(W5, A8, "int-quantized")
    assert "use a dynamic input" not in why
    assert "int5 weights" in why and "int4 or int8 weights" in why
    assert "format int-quantized" in why and "dynamic symmetric per-token int8 input" in why


def test_int4_input_message_names_the_input_bits():
    w4, a4 = dict(W5, num_bits=4), dict(A8, num_bits=4)
    why = vllm_refusal(w4, a4, "int-quantized")
    assert "an int8 input only when" not in why
    assert "int4 input only" in why and "pack-quantized" in why and "WNA4" in why
    # packed, it is vLLM's WNA4 scheme; an input of other bits no scheme takes
    assert vllm_refusal(w4, a4, "pack-quantized") is None
    why = vllm_refusal(w4, dict(A8, num_bits=6), "pack-quantized")
    assert why is not None and "int6 input" in why
