"""Weights quantscope cannot see whole are refused up front, naming the parameter: accelerate's
offload (the meta device between forwards), a meta skeleton outside a sequential calibration,
and DTensors (FSDP2 / tensor parallelism). Before, each crashed after the whole calibration
pass, or, worse, ``apply`` quantized nothing without a word (it wrote into the meta
placeholder) and a tensor-parallel model got one rank's activation ranges."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantscope
from quantscope.calibration import Sequential

accelerate = pytest.importorskip("accelerate")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)).eval()


BATCHES = [torch.randn(4, 128) for _ in range(2)]  # int4 groups of 128


def _offloaded(model: nn.Module) -> nn.Module:
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    assert model[0].weight.device.type == "meta"  # what the refusal is about
    return model


@pytest.mark.parametrize("preset", ["w8a8", "w4a16", "nvfp4"])
def test_calibrate_refuses_offloaded_weights(preset):
    with pytest.raises(ValueError, match=r"calibrate: '0\.weight' is offloaded by accelerate.*"
                                         r"sequential=Sequential\(checkpoint=folder\)"):
        quantscope.calibrate(_offloaded(_mlp()), BATCHES, preset, progress=False)


def test_apply_sensitivity_refuse_offloaded_weights():
    calibration = quantscope.calibrate(_mlp(), BATCHES, "w4a16", progress=False)
    model = _offloaded(_mlp())
    # before: apply wrote the QDQ weight into the meta placeholder and the model ran in float
    with pytest.raises(ValueError, match=r"apply: '0\.weight' is offloaded by accelerate"):
        calibration.apply(model)
    with pytest.raises(ValueError, match=r"sensitivity: '0\.weight' is offloaded"):
        quantscope.sensitivity(model, BATCHES, calibration=calibration)
    assert not model._forward_pre_hooks and not model[0]._forward_pre_hooks


def test_sequential_refuses_offload_hooks_but_takes_a_skeleton():
    with torch.device("meta"):
        skeleton = _mlp()
    with pytest.raises(ValueError, match=r"'0\.weight' is on the meta device \(no data\)"):
        quantscope.calibrate(skeleton, BATCHES, "w8a8", progress=False)
    # offload hooks would put each block's loaded weights back on the meta device
    with pytest.raises(ValueError, match="offloaded by accelerate"):
        quantscope.calibrate(_offloaded(_mlp()), BATCHES, "w8a8", progress=False,
                             sequential=Sequential(checkpoint="unused"))


def test_dispatched_without_offload_calibrates_as_the_plain_model():
    """accelerate's hooks without offload keep real weights: the same qparams, bit for bit."""
    plain = quantscope.calibrate(_mlp(), BATCHES, "w8a8", progress=False)
    dispatched = accelerate.dispatch_model(_mlp(), device_map={"": "cpu"})
    got = quantscope.calibrate(dispatched, BATCHES, "w8a8", progress=False)
    for layer, roles in plain.states.items():
        for role, state in roles.items():
            assert torch.equal(got.states[layer][role].qparams.scale, state.qparams.scale)


def test_export_refuses_offloaded_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=50)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    calibration = quantscope.calibrate(model, [torch.randint(0, 50, (1, 6))], "w4a16",
                                       progress=False)
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"export compressed-tensors: 'model\.embed_tokens"
                                         r"\.weight' is offloaded by accelerate"):
        quantscope.export(calibration, model, out)
    assert not out.exists()


def _refused(model, layer: str, said: str) -> None:
    """calibrate, and apply of the plain model's calibration, refuse ``model`` naming
    ``layer``'s weight as ``said``."""
    with pytest.raises(ValueError, match=rf"calibrate: '{layer}\.weight' {said}"):
        quantscope.calibrate(model, BATCHES, "w8a8", progress=False)
    calibration = quantscope.calibrate(_mlp(), BATCHES, "w8a8", progress=False)
    with pytest.raises(ValueError, match=rf"apply: '{layer}\.weight' {said}"):
        calibration.apply(model)


def test_torchao_quantized_weights_refused():
    """A torchao-quantized weight (a tensor subclass of codes and scales) failed inside
    torchao, naming nothing."""
    torchao = pytest.importorskip("torchao.quantization")
    model = _mlp()
    torchao.quantize_(model, torchao.Int8WeightOnlyConfig())
    _refused(model, "0", r"is a tensor of type \w+ .*not a dense one \(a torchao-quantized")


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dtensor_weights_refused(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = _mlp()
    mesh = init_device_mesh("cpu", (1,))
    model[2].weight = nn.Parameter(distribute_tensor(model[2].weight.detach(), mesh, [Shard(0)]))
    _refused(model, "2", r"is a DTensor sharded across ranks \(\(Shard\(dim=0\),\)")


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=50,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_export_of_a_dispatched_model_without_offload_is_the_plain_models(tmp_path):
    """accelerate's hooks (a device_map over devices, force_hooks) wrap each forward in a
    partial: compressed-tensors failed on it ('functools.partial' object has no attribute
    '__func__') deep in the export, naming nothing."""
    from safetensors.torch import load_file

    model = _tiny_llama()
    calibration = quantscope.calibrate(model, [torch.randint(0, 50, (1, 6))], "fp8",
                                       progress=False)
    quantscope.export(calibration, model, tmp_path / "plain")
    accelerate.dispatch_model(model, device_map={"model": "cpu", "lm_head": "cpu"},
                              force_hooks=True)
    quantscope.export(calibration, model, tmp_path / "hooked")
    want, got = (load_file(tmp_path / d / "model.safetensors") for d in ("plain", "hooked"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert hasattr(model.model.layers[0].mlp.up_proj, "_hf_hook")  # the model keeps its hooks


def test_a_skeleton_with_meta_buffers_is_refused_naming_the_buffer(tmp_path):
    """Its blocks load parameters, not buffers: the rotary table stayed on the meta device
    and transformers' forward failed ('Cannot copy out of meta tensor')."""
    _tiny_llama().save_pretrained(tmp_path)
    with torch.device("meta"):
        skeleton = _tiny_llama()
    with pytest.raises(ValueError, match=r"calibrate: the buffer 'model\.rotary_emb\.inv_freq' "
                                         r"is on the meta device.*empty_model\(folder\)"):
        quantscope.calibrate(skeleton, [torch.randint(0, 50, (1, 6))], "w8a8", progress=False,
                             sequential=Sequential(checkpoint=tmp_path))
