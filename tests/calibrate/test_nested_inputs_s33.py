"""``nn.TransformerEncoder`` with a padding mask (probe s33): in eval mode it feeds its layers
one nested tensor (each sequence without its padding), and calibrate and apply crashed in
torch ("NestedTensorImpl doesn't support sizes"), naming no layer. Now an activation role
observes a nested input's rows (the real tokens) and QDQ quantizes them and puts them back."""

import torch
from torch import nn

import quantscope
from quantscope.qdq import fake_quantize


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(32, 4)

    def forward(self, x, mask=None):
        return self.head(self.enc(x, src_key_padding_mask=mask))


def _model_and_batch():
    torch.manual_seed(0)
    model = _Encoder().eval()
    x = torch.randn(3, 7, 32)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[1, 4:] = True
    mask[2, 2:] = True
    return model, x, mask


def _nested_inputs(model, x, mask):
    """Each Linear's inputs as plain hooks see them (nested where the encoder nests)."""
    seen, handles = {}, []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and not name.endswith("out_proj"):
            handles.append(m.register_forward_pre_hook(
                lambda mod, args, name=name: seen.setdefault(name, []).append(args[0])))
    with torch.no_grad():
        model(x, mask)
    for h in handles:
        h.remove()
    return seen


def _rows(t):
    if t.is_nested:
        return torch.cat([c.reshape(-1, c.shape[-1]) for c in t.unbind()])
    return t.reshape(-1, t.shape[-1])


def test_calibrate_observes_the_real_tokens_of_a_nested_input():
    model, x, mask = _model_and_batch()
    seen = _nested_inputs(model, x, mask)
    assert seen["enc.layers.0.linear1"][0].is_nested  # the case at hand
    calib = quantscope.calibrate(model, [(x, mask)], "w8a8", observer="static_minmax",
                                 progress=False)
    for name, inputs in seen.items():
        rows = torch.cat([_rows(t) for t in inputs])
        st = calib.states[name]["input"]
        assert torch.equal(st.lo.reshape(()), rows.min().clamp(max=0)), name
        assert torch.equal(st.hi.reshape(()), rows.max().clamp(min=0)), name


def test_apply_quantizes_a_nested_input_element_by_element():
    model, x, mask = _model_and_batch()
    calib = quantscope.calibrate(model, [(x, mask)], "w8a8", observer="static_minmax",
                                 progress=False)
    with torch.no_grad(), calib.apply(model):
        got = model(x, mask)
    # the reference: the same fake-quantized weights, each input QDQ'd component by component
    handles = []
    for name, roles in calib.states.items():
        mod, st = model.get_submodule(name), roles.get("input")
        if st is None:  # out_proj: MultiheadAttention reads its weight, never calls it
            continue

        def qdq(t, st=st):
            return fake_quantize(t, st.qparams, st.spec)

        def hook(m, args, qdq=qdq):
            t = args[0]
            if t.is_nested:
                return (torch.nested.as_nested_tensor([qdq(c) for c in t.unbind()],
                                                      layout=t.layout), *args[1:])
            return (qdq(t), *args[1:])

        handles.append(mod.register_forward_pre_hook(hook))
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, roles in calib.states.items():
            w = model.get_submodule(name).weight
            w.copy_(fake_quantize(w, roles["weight"].qparams, roles["weight"].spec))
        want = model(x, mask)
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    for h in handles:
        h.remove()
    assert torch.equal(got, want)
