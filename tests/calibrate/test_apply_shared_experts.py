"""A 3-D experts Parameter another active apply() fake-quantized is refused as a dense weight
is (probe s44: a second model holding the applied model's experts, through
``load_state_dict(..., assign=True)``, was applied; its handle saved the fake-quantized expert
slices as their float values, so removing the handles in the order they were made left the
model's experts fake-quantized). apply() compared the experts' slices with the weights the
other handles hold without their slices."""

import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import qwen3_moe

from quantscope.calibration import calibrate, preset

torch.set_num_threads(1)

EXPERTS = r"re:.*experts\.\d+\.(gate_up|down)_proj$"


def test_a_model_holding_applied_experts_is_refused_and_the_float_weights_come_back():
    model, batches = qwen3_moe(layers=1)
    cal = calibrate(model, batches, preset("w8a8", targets=[EXPERTS]), progress=False)
    experts = model.model.layers[0].mlp.experts
    float_w = {n: p.detach().clone() for n, p in experts.named_parameters()}
    with cal.apply(model):
        assert not torch.equal(experts.gate_up_proj, float_w["gate_up_proj"])  # QDQ'd
        twin, _ = qwen3_moe(layers=1)
        twin.load_state_dict(model.state_dict(), assign=True)  # other Parameters, its memory
        held = twin.model.layers[0].mlp.experts.gate_up_proj
        assert held is not experts.gate_up_proj
        assert held.data_ptr() == experts.gate_up_proj.data_ptr()
        with pytest.raises(ValueError, match=r"^apply: model\.layers\.0\.mlp\.experts\.0\."
                                             r"gate_up_proj\.weight is already fake-quantized "
                                             r"by another apply\(\) .* remove\(\) that one "
                                             r"first$"):
            cal.apply(twin)
        assert getattr(twin, "_quantscope_qdq", None) is None  # nothing left applied
    for n, p in experts.named_parameters():
        assert torch.equal(p, float_w[n]), n
