"""Sequential (block by block) calibration: same qparams as the whole-model pass, weights
loaded one block at a time from safetensors, activations spilled to disk, the quantized
mode against a whole-model pass with the earlier blocks fake-quantized."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quantscope.calibration import calibrate
from quantscope.calibration.run.checkpoint import empty_model
from quantscope.calibration.run.sequential import find_blocks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _model(tied=True, layers=3):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                      tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).eval()


def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(n):
        ids = torch.randint(0, 100, (2, 7 + k), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :2] = 0  # left padding: the attention mask must reach every block
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _qparams(cal):
    return {(layer, role): st.qparams for layer, roles in cal.states.items()
            for role, st in roles.items()}


def _assert_same(a, b, layers=None):
    qa, qb = _qparams(a), _qparams(b)
    if layers is not None:
        qa = {k: v for k, v in qa.items() if k[0] in layers}
        qb = {k: v for k, v in qb.items() if k[0] in layers}
    assert qa.keys() == qb.keys() and qa
    for k in qa:
        assert torch.equal(qa[k].scale, qb[k].scale), k
        assert torch.equal(qa[k].zero_point, qb[k].zero_point), k


# untied embeddings in the extended tier: the other sequential tests' models are untied
@pytest.fixture(scope="module", ids=["tied", "untied"],
                params=[True, pytest.param(False, marks=pytest.mark.extended)])
def saved(request, tmp_path_factory):
    model = _model(tied=request.param)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return model, path


# batches kept in memory (a 64 MB cache) in the extended tier; make test spills every one
@pytest.mark.parametrize("budget", [0, pytest.param(64, marks=pytest.mark.extended)])
def test_equals_whole_model_pass_from_checkpoint(saved, budget, tmp_path):
    model, path = saved
    whole = calibrate(model, _batches(), "w8a8", progress=False)
    skeleton = empty_model(path)
    seq = calibrate(skeleton, iter(_batches()), "w8a8", progress=False, sequential=True,
                    checkpoint=path, cache_budget_mb=budget, cache_dir=tmp_path)
    _assert_same(whole, seq)
    assert "lm_head" in seq.states  # the part outside the blocks is calibrated too
    info = seq.info["sequential"]
    assert info["blocks"] == "model.layers" and info["count"] == 3
    assert (info["spilled_batches"] > 0) == (budget == 0)
    assert list(tmp_path.iterdir()) == []  # the spill folder is gone
    # nothing stays loaded: the skeleton is empty again
    assert all(p.device.type == "meta" for p in skeleton.parameters())
    # and the result applies to the real model
    handle = seq.apply(model)
    handle.remove()


def test_in_memory_model_and_observers(saved):
    model, _ = saved
    before = {n: p.clone() for n, p in model.named_parameters()}
    for obs in ("minmax", "mse"):
        whole = calibrate(model, _batches(), "w8a8", observer=obs, progress=False)
        seq = calibrate(model, _batches(), "w8a8", observer=obs, progress=False,
                        sequential=True)
        _assert_same(whole, seq)
    for n, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p, before[n])


def test_quantized_mode_sees_earlier_blocks_quantized(saved, monkeypatch):
    """Block j's qparams equal a whole-model pass with blocks < j fake-quantized by the
    sequential result; block 0 equals the float pass; later blocks differ from it."""
    model, _ = saved
    # the reference calibrates a partly applied model, which calibrate refuses to users
    monkeypatch.setattr("quantscope.calibration.run.session.refuse_applied",
                        lambda model, who: None)
    seq = calibrate(model, _batches(), "w8a8", progress=False, sequential="quantized")
    flt = calibrate(model, _batches(), "w8a8", progress=False)
    in_block = lambda j: {k for k in seq.states if k.startswith(f"model.layers.{j}.")}
    _assert_same(flt, seq, in_block(0))
    for j in (1, 2):
        earlier = {k: v for k, v in seq.states.items()
                   if any(k.startswith(f"model.layers.{i}.") for i in range(j))}
        from quantscope.calibration.results.apply import apply

        handle = apply(model, earlier)
        try:
            ref = calibrate(model, _batches(), "w8a8", progress=False)
        finally:
            handle.remove()
        _assert_same(ref, seq, in_block(j))
    qf, qs = _qparams(flt), _qparams(seq)
    key = ("model.layers.2.mlp.down_proj", "input")
    assert not torch.equal(qf[key].scale, qs[key].scale)


def test_find_blocks():
    model = _model()
    assert find_blocks(model)[0] == "model.layers"
    assert find_blocks(model, "model.layers")[1] is model.model.layers
    with pytest.raises(ValueError, match="blocks='model.norm'"):
        find_blocks(model, "model.norm")
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_find_blocks_skips_lists_inside_blocks():
    # found by probing: transformers 4.x's MoE experts (a ModuleList of 4 in each of 2
    # layers) were taken as the blocks, and sequential calibration refused the model
    from torch import nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    model = nn.Module()
    model.layers = nn.ModuleList(Layer() for _ in range(2))
    assert find_blocks(model)[0] == "layers"


def test_find_blocks_takes_the_first_of_two_equal_lists():
    """Two outer lists of as many blocks and parameters (twin towers, an encoder and a decoder
    of one layer class): the most children, then the most parameters, leave a tie, which
    goes to the list registered first (named_modules' order, as ``max`` keeps the first of
    equal keys), whichever order the two lists' names sort in."""
    from torch import nn

    for first, second in (("encoder", "decoder"), ("decoder", "encoder")):
        model = nn.Module()
        setattr(model, first, nn.ModuleList(nn.Linear(8, 8) for _ in range(2)))
        setattr(model, second, nn.ModuleList(nn.Linear(8, 8) for _ in range(2)))
        name, blocks = find_blocks(model)
        assert name == first and blocks is getattr(model, first)


def test_errors(saved):
    model, path = saved
    with pytest.raises(ValueError, match=r"pass sequential=Sequential\(checkpoint="):
        calibrate(empty_model(path), _batches(), "w8a8", progress=False, sequential=True)
    with pytest.raises(ValueError, match="batches is empty"):
        calibrate(model, [], "w8a8", progress=False, sequential=True)
    with pytest.raises(ValueError, match="sequential must be"):
        calibrate(model, _batches(), "w8a8", progress=False, sequential="fast")
    with pytest.raises(TypeError, match="pass sequential=True"):
        calibrate(model, _batches(), "w8a8", progress=False, blocks="model.layers")
    with pytest.raises(ValueError, match="no .safetensors"):
        calibrate(model, _batches(), "w8a8", progress=False, sequential=True,
                  checkpoint=path / "nothing")
    with pytest.raises(ValueError, match="cache_budget_mb"):
        calibrate(model, _batches(), "w8a8", progress=False, sequential=True,
                  cache_budget_mb=-1)


@pytest.mark.parametrize("budget", [float("inf"), float("nan"), True, False, "512"])
def test_cache_budget_is_a_finite_number_of_mb(saved, budget):
    # issue 37 row 16: inf raised a raw OverflowError, True was taken as 1 MB
    model, _ = saved
    with pytest.raises(ValueError, match="cache_budget_mb must be a finite number"):
        calibrate(model, _batches(), "w8a8", progress=False, sequential=True,
                  cache_budget_mb=budget)


def test_heap_opt_out(monkeypatch):
    import platform

    from quantscope.calibration.run import heap

    monkeypatch.setenv("QUANTSCOPE_HEAP", "0")
    assert heap.trim() is False and heap.prepare() is False
    monkeypatch.delenv("QUANTSCOPE_HEAP")
    glibc = platform.libc_ver()[0] == "glibc"
    assert heap.trim() is glibc and heap.prepare() is glibc


class _Payload:
    """An object whose unpickling would run code (writes a marker file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_spill_files_are_read_without_unpickling_code(tmp_path):
    """Row 17 of issue 37: a spill file is read with ``weights_only=True``: the cached values
    come back bitwise, and a file swapped for a pickle of an arbitrary object is refused
    without running it."""
    import pickle

    from quantscope.calibration.run.seq_cache import Cache

    cache = Cache([0], str(tmp_path), "t")  # budget 0: every value goes to a file
    value = (torch.randn(2, 3), {"mask": torch.ones(2, dtype=torch.bool), "n": 3, "x": None})
    cache.put(0, value)
    assert cache.spilled == 1
    back = cache.get(0)
    assert torch.equal(back[0], value[0]) and torch.equal(back[1]["mask"], value[1]["mask"])
    assert back[1]["n"] == 3 and back[1]["x"] is None
    marker = tmp_path / "ran"
    torch.save(_Payload(str(marker)), tmp_path / "t-0.pt")
    with pytest.raises(pickle.UnpicklingError):
        cache.get(0)
    assert not marker.exists()


def test_auto_chooses_the_head_by_its_output_error():
    # probing: the head runs on replayed block outputs fed by batch order; auto's "model"
    # metric forwarded it again and scored one batch's logits against another's (a shape
    # error with batches of different lengths, wrong scores without). There the head
    # chooses as metric "output" does in a whole-model pass.
    model = _model(tied=False, layers=2)
    seq = calibrate(model, _batches(), "w8a8", observer="auto", progress=False,
                    sequential=True)
    whole = calibrate(model, _batches(), "w8a8", observer="auto", auto_metric="output",
                      progress=False)
    _assert_same(whole, seq, layers={"lm_head"})
    assert {st.observer for st in seq.states["lm_head"].values()} == {
        st.observer for st in whole.states["lm_head"].values()}


def test_the_skeleton_gets_its_own_parameters_back(saved):
    """The same meta Parameter objects (their requires_grad, references a caller holds):
    unloading made new ones with requires_grad=False."""
    _, path = saved
    skeleton = empty_model(path)
    before = dict(skeleton.named_parameters(remove_duplicate=False))
    assert all(p.requires_grad for p in before.values())
    calibrate(skeleton, _batches(), "w8a8", progress=False, sequential=True, checkpoint=path)
    after = dict(skeleton.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys()
    assert all(after[n] is p for n, p in before.items())


def test_a_bad_tensor_leaves_nothing_loaded(saved, tmp_path):
    """A block's tensors are all read and checked before any is set: a wrong shape left the
    ones before it loaded, and a later calibration (loading only what is on meta) used them,
    from the bad checkpoint."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, path = saved
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    sd = load_file(bad / "model.safetensors")
    sd["model.layers.1.self_attn.q_proj.weight"] *= 10  # another checkpoint's values
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 7)  # and a damaged tensor
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    skeleton = empty_model(path)
    with pytest.raises(ValueError, match=r"up_proj.weight' gives shape \(7, 7\)"):
        calibrate(skeleton, _batches(), "w8a8", progress=False, sequential=True, checkpoint=bad)
    assert all(p.device.type == "meta" for p in skeleton.parameters())
    again = calibrate(skeleton, _batches(), "w8a8", progress=False, sequential=True,
                      checkpoint=path)
    fresh = calibrate(empty_model(path), _batches(), "w8a8", progress=False, sequential=True,
                      checkpoint=path)
    _assert_same(again, fresh)
