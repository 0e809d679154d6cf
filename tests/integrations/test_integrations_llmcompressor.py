"""quantscope's observers inside llm-compressor's own pipelines (``observer: quantscope_<name>``).

Runs in the peers' venv (``make test`` runs it there): llm-compressor's ``oneshot`` on tiny
random models saved to ``tmp_path``. The min-max names must give llm-compressor's own scales
bitwise; the others must give, for every module, what quantscope's observer of that name
computes from the inputs that module's observer saw during ``oneshot`` (captured in
llm-compressor's own calibration hook, so the comparison does not depend on which outputs
each layer was fed). llm-compressor 0.14 keeps a ``QuantizationModifier``'s quantization
disabled until ``end_calibration``, after the last layer: its sequential pipeline feeds
each layer the float outputs of the layers before it (``quantization_aware_calibration`` is
deprecated and has no effect), so its input scales equal its basic pipeline's and
quantscope's ``sequential="float"``, not ``sequential="quantized"``
(test_sequential_pipeline_calibrates_on_float_outputs).
"""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
from ports import free_port

pytestmark = pytest.mark.peers

llmc = pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationScheme,
    QuantizationStrategy,
)
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.quantization.quantization import mixin
from llmcompressor.observers import Observer

import quantscope
import quantscope.integrations.llmcompressor as qsl
from quantscope.compat.llmcompressor import llmcompressor_spec

torch.set_num_threads(1)


# ------------------------------------------------------------------ models and data
def _bert(path):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, vocab_size=100)
    BertModel(cfg).save_pretrained(path)
    return BertModel


def _llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return LlamaForCausalLM


MODELS = {"bert": _bert, "llama": _llama}


def _tokenizer():
    """A 100-word tokenizer: oneshot wants a processor whenever a dataset is given."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")


def _loader(n=4, seq=12):
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, 100, (1, seq), generator=g),
             "attention_mask": torch.ones(1, seq, dtype=torch.long)} for _ in range(n)]
    return torch.utils.data.DataLoader(data, batch_size=None)


def _args(**kw):
    return QuantizationArgs(**{"num_bits": 8, "type": "int", "symmetric": True, **kw})


def _oneshot(cls, path, weights, inputs=None, pipeline="sequential", save=None, **modifier):
    """Run oneshot with one config group on every Linear but lm_head (the modifier's other
    fields from ``modifier``); return the model."""
    model = cls.from_pretrained(path)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    mod = QuantizationModifier(config_groups={"g": scheme}, ignore=["lm_head"], **modifier)
    oneshot(model=model, recipe=mod, dataset=_loader(), pipeline=pipeline, output_dir=save,
            processor=_tokenizer())
    return model


def _qparams(model):
    out = {}
    for name, m in model.named_modules():
        for p in ("input_scale", "input_zero_point", "input_global_scale", "weight_scale",
                  "weight_zero_point", "weight_global_scale"):
            if hasattr(m, p):
                out[f"{name}.{p}"] = getattr(m, p).detach().clone()
    return out


def _assert_bitwise(a, b):
    assert a.keys() == b.keys() and a
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------ registry
def test_every_native_observer_is_registered():
    names = set(Observer.registered_names())
    expected = [n for n in quantscope.list_observers() if ":" not in n and n != "placeholder"]
    assert len(expected) >= 15
    for n in expected:
        assert f"quantscope-{n.replace('_', '-')}" in names
    # compressed-tensors' lookup: case-insensitive, "_" and "-" the same
    obs = Observer.load_from_registry("QuantScope-Histogram", base_name="input",
                                      args=_args(strategy="tensor"))
    assert isinstance(obs, qsl.QuantscopeObserver) and obs.quantscope_name == "histogram"
    qsl.register_all()  # idempotent


def test_observer_kwargs_reach_quantscope_and_bad_ones_are_named():
    obs = Observer.load_from_registry("quantscope_percentile", base_name="input",
                                      args=_args(observer_kwargs={"percentile": 99.0}))
    assert obs.quantscope.percentile == 99.0
    with pytest.raises(TypeError, match="observer_kwargs .*nonsense"):
        Observer.load_from_registry("quantscope_histogram", base_name="input",
                                    args=_args(observer_kwargs={"nonsense": 1}))


# ----------------------------------------------------- every strategy, observer level
def _strategy_cases():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g) * torch.rand(48, 1, generator=g) * 3
    acts = [torch.randn(2, 5, 64, generator=g) * (i + 1) for i in range(3)]
    heads = [torch.randn(2, 4, 5, 16, generator=g) * (i + 1) for i in range(3)]
    f8 = {"num_bits": 8, "type": "float"}
    f4 = {"num_bits": 4, "type": "float"}
    return [
        ("weight", _args(strategy="tensor"), [w]),
        ("weight", _args(strategy="channel"), [w]),
        ("weight", _args(strategy="channel", symmetric=False), [w]),
        ("weight", _args(num_bits=4, strategy="group", group_size=16), [w]),
        ("weight", _args(num_bits=4, strategy="group", group_size=16, symmetric=False), [w]),
        ("weight", _args(**f8, strategy="block", block_structure=[32, 32]), [w]),
        ("weight", _args(**f4, strategy="tensor_group", group_size=16,
                         scale_dtype=torch.float8_e4m3fn, zp_dtype=torch.float8_e4m3fn), [w]),
        ("input", _args(strategy="tensor"), acts),
        ("input", _args(strategy="tensor", symmetric=False), acts),
        ("input", _args(**f8, strategy="tensor"), acts),
        ("input", _args(**f4, strategy="tensor_group", group_size=16, dynamic="local",
                        scale_dtype=torch.float8_e4m3fn, zp_dtype=torch.float8_e4m3fn), acts),
        ("k", _args(strategy="attn_head"), heads),
        ("k", _args(strategy="tensor"), heads),
    ]


CASES = _strategy_cases()


@pytest.mark.parametrize("kind", ["static_minmax", "memoryless_minmax"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_min_max_names_equal_llmcompressor_in_every_strategy(kind, case):
    base, args, tensors = CASES[case]
    theirs = Observer.load_from_registry(kind, base_name=base, args=args.model_copy())
    ours = Observer.load_from_registry(f"quantscope_{kind}", base_name=base,
                                       args=args.model_copy())
    for t in tensors:
        theirs(t)
        ours(t)
    assert ours.has_statistics
    a, b = theirs.get_qparams(), ours.get_qparams()
    for key in ("scale", "zero_point", "global_scale"):
        if a[key] is None:
            assert b[key] is None
            continue
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key
    assert not ours.has_statistics  # get_qparams deletes them, as llm-compressor's do


@pytest.mark.parametrize("name", ["histogram", "percentile", "entropy", "mix", "mse"])
@pytest.mark.parametrize("case", [0, 1, 3, 5, 6, 7, 11])
def test_other_names_give_quantscope_qparams(name, case):
    base, args, tensors = CASES[case]
    if name in ("percentile", "entropy", "mix") and base == "weight" and case != 0:
        pytest.skip("one weight case is enough for the histogram family")
    if case == 6 and name != "mse":
        pytest.skip("NVFP4 weights: the MSE search is the one that chooses its global amax")
    ours = Observer.load_from_registry(f"quantscope_{name}", base_name=base,
                                       args=args.model_copy())
    # the same observer on the tensors in quantscope's own layout for the spec
    spec = llmcompressor_spec(args, "weight" if base == "weight" else "input")
    if base == "k" and args.strategy == QuantizationStrategy.ATTN_HEAD:
        spec = spec.replace(layout=quantscope.Channel(1))
    native = quantscope.get_observer(name, spec)
    for t in tensors:
        ours(t)
        native(t if base != "k" or args.strategy == QuantizationStrategy.ATTN_HEAD
               else t.transpose(1, 2).flatten(-2))
    got = ours.get_qparams()
    want = native.qparams()
    if want.global_scale is not None:
        assert torch.equal(got["global_scale"], want.global_scale)
        got["scale"] = got["scale"].float()
    assert torch.equal(got["scale"].reshape(-1), want.scale.reshape(-1))
    assert torch.equal(got["zero_point"].reshape(-1).float(), want.zero_point.reshape(-1).float())


@pytest.mark.parametrize("name", ["mse", "memoryless_mse"])
def test_nvfp4_searched_amax_past_the_float16_range_keeps_its_global_scale(name):
    """An fp16 weight near the top of fp16's range: the MSE search's global amax (up to about
    1.4x the absmax) has no fp16 value; it read inf, so the global scale was 0 and the
    checkpoint dequantized to NaN. It is the native observer's global scale."""
    args = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group",
                            group_size=16, scale_dtype=torch.float8_e4m3fn,
                            zp_dtype=torch.float8_e4m3fn)
    t = torch.randn(48, 64, generator=torch.Generator().manual_seed(3))
    w = (t / t.abs().max() * 60000.0).half()
    ours = Observer.load_from_registry(f"quantscope_{name}", base_name="weight",
                                       args=args.model_copy())
    ours(w)
    native = quantscope.get_observer(name, llmcompressor_spec(args, "weight"))
    native(w)
    assert native.global_amax() > torch.finfo(torch.float16).max  # the case: past fp16
    got = ours.get_qparams()["global_scale"]
    assert torch.isfinite(got).all() and (got > 0).all()
    assert torch.equal(got, native.qparams().global_scale)


def test_fused_nvfp4_weights_share_the_global_scale():
    from llmcompressor.observers.fusion import FusionHandler

    g = torch.Generator().manual_seed(5)
    args = _args(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                 scale_dtype=torch.float8_e4m3fn, zp_dtype=torch.float8_e4m3fn)
    mods = [torch.nn.Linear(32, 16, bias=False) for _ in range(3)]
    for i, m in enumerate(mods):
        m.weight.data = torch.randn(16, 32, generator=g) * (i + 1)
    out = {}
    for kind in ("memoryless_minmax", "quantscope_memoryless_minmax"):
        obs = [Observer.load_from_registry(kind, base_name="weight", args=args.model_copy())
               for _ in mods]
        FusionHandler.fuse(zip(obs, mods))
        obs[0](mods[0].weight)  # observes the siblings' weights too
        out[kind] = [o.get_qparams() for o in obs]
    for a, b in zip(out["memoryless_minmax"], out["quantscope_memoryless_minmax"]):
        assert torch.equal(a["global_scale"], b["global_scale"])
        assert torch.equal(a["scale"], b["scale"])
    gs = out["quantscope_memoryless_minmax"][0]["global_scale"]
    assert torch.equal(gs, torch.tensor([448.0 * 6]) / (mods[2].weight.abs().max()))


# ------------------------------------------------------------------------- oneshot
@pytest.mark.parametrize("pipeline", ["sequential", "basic"])
def test_oneshot_min_max_names_bitwise_equal_llmcompressor(tmp_path, pipeline):
    cls = _bert(tmp_path / "bert")
    runs = {}
    for prefix in ("", "quantscope_"):
        runs[prefix] = _qparams(_oneshot(
            cls, tmp_path / "bert",
            weights=_args(strategy="channel", observer=f"{prefix}memoryless_minmax"),
            inputs=_args(strategy="tensor", dynamic=False, observer=f"{prefix}static_minmax"),
            pipeline=pipeline))
    assert sum(k.endswith("input_scale") for k in runs[""]) == 36 // 6 * 2 + 1
    _assert_bitwise(runs[""], runs["quantscope_"])



def test_sequential_pipeline_calibrates_on_float_outputs(tmp_path):
    """llm-compressor's sequential pipeline (propagate_error at its default, True) gives a
    QuantizationModifier's input scales of its basic pipeline bit for bit: quantization stays
    off until end_calibration, so the layers after the first see float outputs. quantscope's
    sequential="float" matches them to float32 rounding; sequential="quantized" does not."""
    from quantscope import QuantSpec, presets
    from quantscope.calibration import Recipe, Role, Rule, Sequential

    cls = _llama(tmp_path / "llama")
    kw = {"weights": _args(strategy="channel", observer="memoryless_minmax"),
          "inputs": _args(strategy="tensor", dynamic=False, observer="static_minmax")}
    runs = {p: {k: v for k, v in _qparams(_oneshot(cls, tmp_path / "llama", pipeline=p, **kw))
                .items() if k.endswith(".input_scale")} for p in ("sequential", "basic")}
    assert len(runs["basic"]) == 14
    _assert_bitwise(runs["sequential"], runs["basic"])
    recipe = Recipe((Rule(("Linear",), weight=Role(presets.INT8_PER_CHANNEL, "minmax"),
                          input=Role(QuantSpec("int8"), "static_minmax")),), ignore=("lm_head",))
    model, batches = cls.from_pretrained(tmp_path / "llama").eval(), list(_loader())
    ours = {mode: quantscope.calibrate(model, batches, recipe, progress=False,
                                       sequential=Sequential(mode=mode))
            for mode in ("float", "quantized")}
    worst = {mode: 0.0 for mode in ours}
    for key, theirs in runs["sequential"].items():
        layer = key[:-len(".input_scale")]
        for mode, cal in ours.items():
            scale = cal.states[layer]["input"].qparams.scale.float().reshape(theirs.shape)
            worst[mode] = max(worst[mode], ((scale - theirs).abs() / theirs).max().item())
    assert worst["float"] <= 1e-6  # float32 rounding (2.2e-7 here: a few ulps)
    assert worst["quantized"] > 1e-4  # layer 1 sees the quantized layer 0's outputs

def test_oneshot_nvfp4_min_max_names_bitwise_equal_llmcompressor(tmp_path):
    cls = _llama(tmp_path / "llama")
    f4 = {"num_bits": 4, "type": "float", "group_size": 16, "scale_dtype": torch.float8_e4m3fn,
          "zp_dtype": torch.float8_e4m3fn, "strategy": "tensor_group"}
    runs = {}
    for prefix in ("", "quantscope_"):
        runs[prefix] = _qparams(_oneshot(
            cls, tmp_path / "llama", weights=_args(**f4, observer=f"{prefix}memoryless_minmax"),
            inputs=_args(**f4, dynamic="local", observer=f"{prefix}static_minmax")))
    assert any(k.endswith("input_global_scale") for k in runs[""])
    _assert_bitwise(runs[""], runs["quantscope_"])


class _Capture:
    """Record what llm-compressor's input calibration hook hands each input observer."""

    def __init__(self, monkeypatch):
        self.seen: dict[int, list[torch.Tensor]] = {}
        original = mixin.calibrate_input_hook

        def hook(module, args):
            x = args[0] if isinstance(args, tuple) else args
            self.seen.setdefault(id(module), []).append(x.detach().clone())
            return original(module, args)

        monkeypatch.setattr(mixin, "calibrate_input_hook", hook)


@pytest.mark.parametrize("model", ["bert", "llama"])
def test_oneshot_histogram_and_mse_are_quantscope_on_what_each_module_saw(
        tmp_path, monkeypatch, model):
    from transformers import AutoModel

    cls = MODELS[model](tmp_path / model)
    cap = _Capture(monkeypatch)
    w_args = _args(strategy="channel", observer="quantscope_mse")
    a_args = _args(strategy="tensor", dynamic=False, observer="quantscope_histogram")
    save = tmp_path / "out"
    qmodel = _oneshot(cls, tmp_path / model, weights=w_args, inputs=a_args, save=save)
    float_model = cls.from_pretrained(tmp_path / model)
    checked = 0
    for name, m in qmodel.named_modules():
        if not hasattr(m, "input_scale"):
            continue
        obs = quantscope.get_observer("histogram", llmcompressor_spec(a_args, "input"))
        assert len(cap.seen[id(m)]) == 4  # every calibration batch, once
        for x in cap.seen[id(m)]:
            obs(x)
        qp = obs.qparams()
        assert torch.equal(m.input_scale.reshape(-1), qp.scale.reshape(-1)), name
        w = float_model.get_submodule(name).weight.detach()
        wq = quantscope.get_observer("mse", llmcompressor_spec(w_args, "weight"))
        wq(w)
        assert torch.equal(m.weight_scale, wq.qparams().scale), name
        checked += 1
    assert checked == (13 if model == "bert" else 14)
    # the checkpoint reloads with transformers and holds those qparams
    loaded = AutoModel.from_pretrained(save)
    sd = {k.removeprefix("model."): v for k, v in loaded.state_dict().items()}
    scales = {k.removeprefix("model."): v for k, v in _qparams(qmodel).items()}
    for k, v in scales.items():
        assert torch.equal(sd[k.removeprefix("bert.")].to(v.dtype), v), k


def test_oneshot_w4a16_checkpoint_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    cls = _llama(tmp_path / "llama")
    w4 = {"num_bits": 4, "strategy": "group", "group_size": 32}
    runs = {}
    for obs in ("memoryless_minmax", "quantscope_memoryless_minmax", "quantscope_mse"):
        save = tmp_path / obs
        model = _oneshot(cls, tmp_path / "llama", weights=_args(**w4, observer=obs), save=save)
        runs[obs] = _qparams(model)
        loaded = AutoModelForCausalLM.from_pretrained(save)
        ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            got, want = loaded(ids).logits, model(ids).logits
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), obs
    _assert_bitwise(runs["memoryless_minmax"], runs["quantscope_memoryless_minmax"])
    w4_args = _args(**w4)
    float_model = cls.from_pretrained(tmp_path / "llama")
    for key, scale in runs["quantscope_mse"].items():
        if key.endswith("weight_scale"):
            w = float_model.get_submodule(key.removesuffix(".weight_scale")).weight.detach()
            want = quantscope.get_observer("mse", llmcompressor_spec(w4_args, "weight"))
            want(w)
            assert torch.equal(scale, want.qparams().scale), key


def test_oneshot_weight_only_quantscope_imatrix_calibrates_when_asked(tmp_path):
    # with oneshot's default pipeline ("independent": inferred from the modifiers)
    # llm-compressor calibrates a weight-only recipe only for its own imatrix names
    # (QuantizationMixin._set_requires_calibration_data); with requires_calibration_data=True
    # quantscope_imatrix_mse gets the same importance and gives imatrix_mse's weight qparams,
    # without it the refusal says what to pass
    cls = _llama(tmp_path / "llama")

    def run(observer, strict=False, **modifier):
        w = _args(num_bits=4, strategy="group", group_size=16, observer=observer,
                  observer_kwargs={"strict": strict})
        return _qparams(_oneshot(cls, tmp_path / "llama", w, pipeline="independent",
                                 **modifier))

    theirs = run("imatrix_mse", strict=True)
    assert sum(k.endswith("weight_scale") for k in theirs) == 2 * 7
    _assert_bitwise(theirs, run("quantscope_imatrix_mse", strict=True,
                                requires_calibration_data=True))
    hint = r"no importance data available .*requires_calibration_data=True"
    with pytest.raises(ValueError, match=hint):
        run("quantscope_imatrix_mse", strict=True)
    with pytest.warns(UserWarning, match=hint):
        run("quantscope_imatrix_mse")


# ----------------------------------------------------------------------------- DDP
def _ddp_worker(rank, port, out):
    try:
        import torch.distributed as dist

        import quantscope.integrations.llmcompressor  # noqa: F401

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=30))
        g = torch.Generator().manual_seed(7)
        batches = [torch.randn(2, 5, 64, generator=g) * (i + 1) for i in range(4)]
        res = {}
        for name in ("quantscope_histogram", "quantscope_static_minmax", "quantscope_percentile"):
            obs = Observer.load_from_registry(name, base_name="input", args=_args())
            for b in batches[rank::2]:  # each rank sees half the data
                obs(b)
            assert obs.sync_activation_stats() == []
            res[name] = obs.get_qparams()["scale"]
        torch.save(res, os.path.join(out, f"{rank}.pt"))
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(out, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.extended  # spawns its own process group
def test_ddp_statistics_reduce_exactly(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_ddp_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    g = torch.Generator().manual_seed(7)
    batches = [torch.randn(2, 5, 64, generator=g) * (i + 1) for i in range(4)]
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    for name in ranks[0]:
        one = Observer.load_from_registry(name, base_name="input", args=_args())
        for b in batches[0::2] + batches[1::2]:
            one(b)
        want = one.get_qparams()["scale"]
        assert torch.equal(ranks[0][name], want), name
        assert torch.equal(ranks[1][name], want), name


# -------------------------------------------------------------------------- the docs
def test_docs_llmcompressor_examples_run(tmp_path, monkeypatch):
    # the ```python blocks of README.md and docs/ that use llm-compressor (tests/docs/
    # test_examples.py skips them in .venv, which has no llm-compressor)
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    mine = []
    for page in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        for block in re.findall(r"^```python\n(.*?)^```", page.read_text(),
                                flags=re.DOTALL | re.MULTILINE):
            if re.search(r"^from llmcompressor", block, flags=re.MULTILINE):
                mine.append((str(page.relative_to(root)), block))
    assert "docs/guide/pipelines.md" in {where for where, _ in mine}
    monkeypatch.chdir(tmp_path)
    for where, code in mine:
        exec(compile(code, where, "exec"), {"__name__": "__docs_example__"})  # noqa: S102


def test_observer_state_follows_the_data_device():
    """llm-compressor's observers keep no state before data, so theirs run wherever the data
    is (a module placed after its observer was made; model_free_ptq's pass on the meta
    device). Ours moves its state to the data's device (it raised a device mismatch)."""
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    theirs = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    ours = Observer.load_from_registry("quantscope_memoryless_minmax", base_name="weight",
                                       args=args.model_copy())
    w = torch.empty(16, 64, device="meta")
    theirs(w)
    ours(w)
    assert theirs.min_vals.device.type == "meta"
    assert {b.device.type for b in ours.quantscope.buffers()} == {"meta"}
    assert ours.quantscope.has_observed
