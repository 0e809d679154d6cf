"""Sequential calibration of MoE checkpoints as transformers writes them (issue 37 row 9):
``save_pretrained`` stores each expert apart (``experts.<e>.w1`` / ``w3`` / ``w2`` for
Mixtral, under ``block_sparse_moe``; ``gate_proj`` / ``up_proj`` / ``down_proj`` for
Qwen2-MoE) while the model runs 3-D ``gate_up_proj`` / ``down_proj``. The skeleton loads
them under those names, block by block, and gives the whole-model pass bit for bit."""

import pytest
import torch

from quantscope.calibration import calibrate
from quantscope.calibration.run.checkpoint import Checkpoint, empty_model, load_params

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _assert_same(a, b):
    assert a.states.keys() == b.states.keys() and a.states
    for layer, roles in a.states.items():
        assert roles.keys() == b.states[layer].keys(), layer
        for role, st in roles.items():
            qa, qb = st.qparams, b.states[layer][role].qparams
            assert (qa is None) == (qb is None), (layer, role)
            if qa is not None:
                for f in ("scale", "zero_point", "global_scale"):
                    x, y = getattr(qa, f), getattr(qb, f)
                    assert (x is None and y is None) or torch.equal(x, y), (layer, role, f)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def saved(request, tmp_path_factory):
    import tiny_models

    model, batches = getattr(tiny_models, request.param)()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, batches, path


def _skeleton(kind, path):
    from tiny_models import starve

    skeleton = empty_model(path)
    if kind == "mixtral":  # the same router as the model's (one expert starved)
        for layer in skeleton.model.layers:
            starve(layer.mlp.gate)
    return skeleton


def test_checkpoint_uses_per_expert_names(saved):
    kind, _, _, path = saved
    keys = set(Checkpoint(path).where)
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in keys)
    first = "model.layers.0.block_sparse_moe.experts.0.w1.weight" if kind == "mixtral" \
        else "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert first in keys


@pytest.mark.parametrize("preset", ["w8a8", "nvfp4"])
def test_sequential_moe_checkpoint_equals_whole_model_pass(saved, preset, tmp_path):
    kind, model, batches, path = saved
    whole = calibrate(model, batches, preset, progress=False)
    skeleton = _skeleton(kind, path)
    seq = calibrate(skeleton, batches, preset, progress=False, sequential=True,
                    checkpoint=path, cache_dir=tmp_path)
    _assert_same(whole, seq)
    assert any(".experts." in k for k in seq.states)
    assert all(p.device.type == "meta" for p in skeleton.parameters())


def test_loaded_experts_equal_the_models(saved):
    """The 3-D parameters read from the per-expert tensors are the model's, bitwise."""
    _, model, _, path = saved
    skeleton = empty_model(path)
    names = {n for n, _ in skeleton.named_parameters()}
    load_params(skeleton, names, Checkpoint(path), "cpu")
    ours = dict(skeleton.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(ours[n], p), n


def test_a_missing_expert_tensor_is_named(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    *_, path = saved
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    drop = next(k for k in tensors if ".experts.2." in k)
    del tensors[drop]
    save_file(tensors, tmp_path / "model.safetensors")
    skeleton = empty_model(path)
    with pytest.raises(ValueError, match=r"checkpoint has no tensor 'model\.layers\.0\.mlp"
                                         r"\.experts\.(gate_up|down)_proj'"):
        load_params(skeleton, {n for n, _ in skeleton.named_parameters()},
                    Checkpoint(tmp_path), "cpu")


def test_a_damaged_expert_count_is_named_not_listed(saved, tmp_path):
    # a 3-D experts parameter of 10**11 experts builds on the meta device at no cost: its
    # 10**11 per-expert checkpoint keys must not be listed before the checkpoint is found
    # too small for them
    import json
    import shutil

    kind, _, _, path = saved
    folder = shutil.copytree(path, tmp_path / "damaged")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_local_experts" if kind == "mixtral" else "num_experts"] = 226_112_355_091
    (folder / "config.json").write_text(json.dumps(cfg))
    skeleton = empty_model(folder)
    with pytest.raises(ValueError, match=r"checkpoint has no tensor 'model\.layers\.0\.mlp"
                                         r"\.experts\.(gate_up|down)_proj'"):
        load_params(skeleton, {n for n, _ in skeleton.named_parameters()},
                    Checkpoint(folder), "cpu")
