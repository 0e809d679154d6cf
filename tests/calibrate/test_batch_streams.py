"""Entry points that read the batches more than once take a generator as a list."""

import pytest
import torch

from quantscope.calibration import sensitivity

transformers = pytest.importorskip("transformers")


def test_sensitivity_of_a_generator_is_that_of_its_list():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 8), generator=g) for _ in range(3)]
    listed = sensitivity(model, batches, "w8a8")
    # calibrated, then measured, on the same generator (it said "batches is empty")
    streamed = sensitivity(model, (b for b in batches), "w8a8")
    assert streamed.rows == listed.rows and listed.rows


def test_fisher_loss_gets_the_users_batch_type_under_inference_mode_too():
    # found by probing: making the batches saveable for autograd turned a BatchEncoding into
    # a dict (a loss reading b.x failed) and a namedtuple into one holding a generator
    import collections

    from quantscope.calibration.choice.layer_choice import fisher_weights

    class Mlp(torch.nn.Sequential):  # takes its input by name too (a mapping batch's way)
        def forward(self, x):
            return super().forward(x)

    torch.manual_seed(0)
    model = Mlp(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 16, generator=g) for _ in range(2)]
    Pair = collections.namedtuple("Pair", "x")
    seen = []

    def loss(out, batch):
        seen.append(type(batch))
        return (out - batch.x).square().mean()

    layers = ["0", "2"]
    want = fisher_weights(model, [Pair(x) for x in xs], layers, loss)
    with torch.inference_mode():
        made_here = [x.clone() for x in xs]  # inference tensors: the batches are copied
        for wrap in (Pair, lambda x: transformers.BatchEncoding({"x": x})):
            got = fisher_weights(model, [wrap(x) for x in made_here], layers, loss)
            assert all(torch.equal(got[k], want[k]) for k in layers)
    assert seen == [Pair] * 4 + [transformers.BatchEncoding] * 2
