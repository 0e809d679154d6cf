"""Weight fingerprints: calibrate records one of each static weight's bits, and apply and every
export refuse a model whose weights differ (probe s42 f1: a run's model folder re-saved with
other weights of the same shapes was exported with the old scales, 35 % of the int8 codes
saturated, without a word: only shapes were compared).

The digest is checked against a pure-Python computation of its definition (two sums mod
2**64 over the bits read as signed 32-bit words in rows of 8192, weighted by fixed
pseudo-random column and row keys: fingerprint.py's module doc), so weights identical bit for
bit agree on any device, layout or thread count; a dtype change is compared in the dtype
calibrated where that cast is exact both ways, and warned about where it is not."""

import copy
import json
import struct
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import llama, qwen3_moe

import quantscope
from quantscope.calibration import Outliers, calibrate, load
from quantscope.calibration.choice.smooth import reapply
from quantscope.calibration.results.apply import apply
from quantscope.calibration.structure.fingerprint import fingerprint

torch.set_num_threads(1)

_COLUMNS = 8192
_MASK = (1 << 64) - 1


def _splitmix64(i: int) -> int:
    """splitmix64's output number ``i + 1`` from the seed 0 (Steele, Lea, Flood 2014)."""
    z = (i + 1) * 0x9E3779B97F4A7C15 & _MASK
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
    return z ^ (z >> 31)


_A = [(_splitmix64(c) >> 32) | 1 for c in range(_COLUMNS)]


def _reference(t: torch.Tensor) -> str:
    """The fingerprint from its definition, in Python integers: the bits as little-endian
    signed 32-bit words (zero bytes padding the last), in rows of 8192; ``h_r`` each row's
    words times the column keys, the two sums ``h_r`` times the row keys."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    raw += bytes(-len(raw) % 4)
    words = struct.unpack(f"<{len(raw) // 4}i", raw)
    rows = -(-len(words) // _COLUMNS)
    h = [0] * rows
    for i, x in enumerate(words):
        h[i // _COLUMNS] += _A[i % _COLUMNS] * x
    sums = [sum(((_splitmix64((1 << 32) + 2 * r + j) | 1) * h[r]) for r in range(rows)) & _MASK
            for j in (0, 1)]
    return f"{str(t.dtype).removeprefix('torch.')}:{sums[0]:016x}{sums[1]:016x}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64,
                                   torch.float8_e4m3fn])
def test_the_fingerprint_is_its_definition_on_every_layout_and_thread_count(dtype):
    # 300 x 1001: several rows of 8192 words (a step of 64 rows past for float64) and a
    # partial one; a float8 / bfloat16 weight of an odd size pads its last word
    w = (torch.randn(300, 1001, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    want = _reference(w)
    assert fingerprint(w) == want
    assert fingerprint(w.t().contiguous().t()) == want  # strided, the same values
    odd = w.view(-1)[1:3004]  # 3003 values from the second: no word boundary, a padded end
    assert fingerprint(odd) == _reference(odd.clone())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert fingerprint(w) == want
    finally:
        torch.set_num_threads(threads)
    assert fingerprint(torch.empty(0, 4, dtype=dtype)) == _reference(torch.empty(0, 4,
                                                                           dtype=dtype))
    assert fingerprint(w.to("meta")) is None


def test_a_view_starting_off_a_word_boundary_is_its_definition():
    """A bfloat16 view 2 bytes into its storage, of an even count (no padding to copy it):
    its bytes cannot be read as 32-bit words in place, yet its fingerprint is its values'."""
    base = torch.randn(64, generator=torch.Generator().manual_seed(0)).bfloat16()
    for view in (base[1:9], base[3:35], base.view(8, 8)[:, 1:5].t()):
        assert fingerprint(view) == _reference(view)


def test_the_gpu_path_hashes_the_rows_as_the_cpu_path():
    """A GPU hashes the rows with torch's int64 (1024 rows at a time), the CPU with numpy's
    uint64: the same integers, wrapping alike; the column keys are odd, distinct, < 2**32."""
    from quantscope.calibration.structure import fingerprint as fp

    words = torch.randint(-2**31, 2**31, (2500 * 8192 + 77,), dtype=torch.int32)
    words[:8] = torch.tensor([-2**31, 2**31 - 1] * 4)  # the widest products
    want = torch.from_numpy(fp._row_hashes(words.numpy()).view("int64"))
    assert torch.equal(fp._torch_row_hashes(words), want)
    assert torch.equal(fp._torch_row_hashes(words, step=7), want)
    assert torch.equal(torch.from_numpy(fp._row_hashes(words.numpy(), step=5).view("int64")),
                       want)
    assert fp._column_keys().tolist() == _A and len(set(_A)) == 8192


def test_the_gpu_path_hashes_whole_rows_into_as_many_hashes():
    """Exactly 3 rows of 8192 words (a [4096, 4096] bfloat16 weight is 1024 of them): 3 row
    hashes, as the CPU path's, and no empty fourth."""
    from quantscope.calibration.structure import fingerprint as fp

    words = torch.randint(-2**31, 2**31, (3 * 8192,), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(1))
    want = torch.from_numpy(fp._row_hashes(words.numpy()).view("int64"))
    got = fp._torch_row_hashes(words)
    assert got.shape == (3,) and torch.equal(got, want)


def test_the_fingerprint_tells_one_bit_swapped_rows_a_transpose_and_a_signed_zero():
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    base = fingerprint(w)
    one_ulp = w.clone()
    one_ulp.view(torch.int32)[37, 5] += 1
    rows = w[[1, 0, *range(2, 64)]]
    zero = torch.zeros(8)
    assert len({base, fingerprint(one_ulp), fingerprint(rows), fingerprint(w.t()),
                fingerprint(w.bfloat16())}) == 5
    assert fingerprint(zero) != fingerprint(-zero)


def _swapped(t: torch.Tensor, i: int, j: int) -> torch.Tensor:
    out = t.clone()
    out[[i, j]] = out[[j, i]]
    return out


def test_the_fingerprint_tells_changes_a_position_period_would_hide():
    """A digest weighting the words by position modulo a period P missed values P words
    apart swapped (rows P apart of a weight of P rows or more: gate_proj of 14336) and any
    change whose word differences sum to 0 with a first moment of 0 (+1, -2, +1 ulp on
    three neighbours); nor may two sign flips cancel (words mod 2**64: 2**63 + 2**63)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(8192, 16, generator=g)
    b = torch.randn(8200, 64, generator=g).bfloat16()
    ulps = b.clone()
    ulps.view(torch.int16).view(-1)[100:103] += torch.tensor([1, -2, 1], dtype=torch.int16)
    signs = w.clone()
    signs.view(-1)[[1, 3]] *= -1  # the top bit of two 64-bit words
    for other in (_swapped(w.view(-1), 0, 8191).view(8192, 16), _swapped(b, 0, 8191), ulps,
                  _swapped(b.view(-1), 5, 5 + 4 * 8191).view(8200, 64), signs):
        assert not torch.equal(other, w if other.dtype == w.dtype else b)
        assert fingerprint(other) != fingerprint(w if other.dtype == w.dtype else b)
    # any two values of a weight swapped, at random (rows and columns of all offsets)
    flat = torch.randn(3000, 70, generator=g).view(-1)
    base = fingerprint(flat)
    pairs = torch.randint(0, flat.numel(), (200, 2), generator=g).tolist()
    assert all(fingerprint(_swapped(flat, i, j)) != base for i, j in pairs if i != j)


@pytest.fixture(scope="module")
def calibrated():
    model, batches = llama()
    return model, batches, calibrate(model, batches, "w8a8", progress=False)


def test_calibrate_records_each_static_weights_fingerprint(calibrated):
    model, _, cal = calibrated
    for layer, roles in cal.states.items():
        assert roles["weight"].fingerprint == _reference(model.get_submodule(layer).weight)
        # the static input scale came through the same weight: its fingerprint (probe s45)
        assert roles["input"].fingerprint == roles["weight"].fingerprint
    dyn = calibrate(model, calibrated[1], "w8a8-dynamic", progress=False)
    assert all(r["input"].fingerprint is None and r["weight"].fingerprint is not None
               for r in dyn.states.values())


def test_other_weights_of_the_same_shapes_are_refused_naming_the_first_that_differs(
        calibrated, tmp_path):
    model, _, cal = calibrated
    cal.check_model(model, "export")  # its own model passes
    other = copy.deepcopy(model)
    other.model.layers[1].mlp.down_proj.weight.data.view(torch.int32)[3, 7] += 1  # one ulp
    with pytest.raises(ValueError, match=r"^export: model\.layers\.1\.mlp\.down_proj\.weight "
                                         r"is not the weight calibrated .* the model was "
                                         r"re-saved, fine-tuned, or smoothed in place"):
        quantscope.export(cal, other, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()
    scaled = llama(seed=1)[0]
    before = scaled.model.layers[0].self_attn.q_proj.weight.clone()
    with pytest.raises(ValueError, match=r"^apply: model\.layers\.0\.self_attn\.q_proj\.weight "
                                         r"is not the weight calibrated"):
        cal.apply(scaled)
    assert torch.equal(scaled.model.layers[0].self_attn.q_proj.weight, before)  # untouched


def test_without_fingerprints_applies_and_exports_to_other_weights_knowingly(calibrated,
                                                                           tmp_path):
    """The override the refusal names: a copy that checks no weight (the original still
    does), which applies the calibrated scales to the other weights as they are."""
    _, batches, cal = calibrated
    other = llama(seed=1)[0]
    with pytest.raises(ValueError, match=r"is not the weight calibrated .* calibrate this one "
                                         r"\(to use these scales all the same, on weights not "
                                         r"smoothed since: calibration\.without_fingerprints"
                                         r"\(\), --allow-other-weights\)$"):
        cal.apply(other)
    loose = cal.without_fingerprints()
    assert cal.states["model.layers.0.self_attn.q_proj"]["weight"].fingerprint is not None
    assert all(r.fingerprint is None for roles in loose.states.values() for r in roles.values())
    assert loose.quantizes_like(cal) and loose.info == cal.info and loose.info is not cal.info
    twin = copy.deepcopy(other)
    with loose.apply(other), torch.no_grad():
        got = other(batches[0]).logits
    with apply(twin, cal.states), torch.no_grad():  # the unchecked function: the same QDQ
        want = twin(batches[0]).logits
    assert torch.equal(got, want)
    assert (quantscope.export(loose, other, tmp_path / "ct") and
            (tmp_path / "ct" / "config.json").is_file())
    loose.save(tmp_path / "cal")
    assert "fingerprint" not in (tmp_path / "cal" / "quantscope.json").read_text()


def test_a_calibration_saved_without_fingerprints_loads_and_exports_unchecked(calibrated,
                                                                              tmp_path):
    model, _, cal = calibrated
    cal.save(tmp_path / "cal")
    meta_path = tmp_path / "cal" / "quantscope.json"
    back = load(tmp_path / "cal")
    assert all(back.states[k]["weight"].fingerprint == cal.states[k]["weight"].fingerprint
               for k in cal.states)
    meta = json.loads(meta_path.read_text())
    for roles in meta["layers"].values():  # the weights' and the static inputs'
        for d in roles.values():
            d.pop("fingerprint")
    meta_path.write_text(json.dumps(meta))
    old = load(tmp_path / "cal")
    other = llama(seed=1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        old.check_model(other, "export")  # cannot be checked: nothing said
    out = quantscope.export(old, model, tmp_path / "ct")
    assert (tmp_path / "ct" / "config.json").is_file() and out


@pytest.mark.parametrize(("field", "value"), [("weight", "float32:1234"),
                                              ("weight", "float99:" + "0" * 32),
                                              ("weight", "float32:" + "0" * 33),
                                              ("weight", "float32:" + "0" * 32 + "\n"),
                                              ("weight", "float32:" + "0" * 32 + " junk"),
                                              ("input", "float32:1234")])
def test_a_damaged_fingerprint_is_refused_on_load(calibrated, tmp_path, field, value):
    _, _, cal = calibrated
    cal.save(tmp_path / "cal")
    meta_path = tmp_path / "cal" / "quantscope.json"
    meta = json.loads(meta_path.read_text())
    meta["layers"]["model.layers.0.self_attn.q_proj"][field]["fingerprint"] = value
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"layers\.model\.layers\.0\.self_attn\.q_proj\."
                                         rf"{field}\.fingerprint"):
        load(tmp_path / "cal")


def test_a_model_lacking_a_calibrated_layer_is_left_to_apply_to_name(calibrated):
    """Another model (other weights) lacking layer 1: no weight's bits are compared, so the
    error apply raises names the missing module, which says more than a fingerprint."""
    _, _, cal = calibrated
    other = llama(seed=1)[0]
    other.model.layers = other.model.layers[:1]
    cal.check_model(other, "export")
    with pytest.raises(ValueError, match=r"apply: the model has no module 'model\.layers\.1\."):
        cal.apply(other)


def test_a_dtype_change_is_compared_where_the_cast_is_exact(calibrated):
    model, batches, cal = calibrated
    other = llama(seed=1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cal.check_model(copy.deepcopy(model).double(), "export")  # float64 holds float32
    with pytest.raises(ValueError, match="is not the weight calibrated"):
        cal.check_model(other.double(), "export")
    # a bfloat16 copy: export takes it (the scales rounded, allow_lossy), but a rounded copy
    # cannot be told from another model's: not checked, and one warning says so
    with pytest.warns(UserWarning, match=r"export: 15 weights \(first model\.layers\.0\.self_"
                                         r"attn\.q_proj\.weight\) are torch\.bfloat16, narrower "
                                         r"than the torch\.float32 calibrated"):
        cal.check_model(copy.deepcopy(model).bfloat16(), "export")
    # calibrated in bfloat16: the float32 original it was rounded from, or its upcast, match
    half = copy.deepcopy(model).bfloat16()
    cal16 = calibrate(half, batches, "w8a8", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cal16.check_model(model, "export")
        cal16.check_model(copy.deepcopy(half).float(), "apply")
    with pytest.raises(ValueError, match="is not the weight calibrated"):
        cal16.check_model(other, "export")


def test_smoothquant_weights_reapplied_to_a_fresh_model_match(tmp_path):
    model, batches = llama()
    cal = calibrate(model, batches, "w8a8", outliers=Outliers(smooth=0.5), progress=False)
    cal.check_model(model, "export")
    fresh = llama()[0]  # the same float weights, not smoothed
    reapply(fresh, cal)
    cal.check_model(fresh, "export")  # reapply gives the calibrated bits


def test_moe_experts_are_checked_slice_by_slice():
    model, batches = qwen3_moe(layers=1)
    cal = calibrate(model, batches, "w8a8", progress=False)
    layer = "model.layers.0.mlp.experts.2.gate_up_proj"
    experts = model.model.layers[0].mlp.experts
    assert cal.states[layer]["weight"].fingerprint == _reference(experts.gate_up_proj.data[2])
    cal.check_model(model, "export")
    with cal.apply(model):  # the experts attached as views: the same slices
        pass
    other = copy.deepcopy(model)
    other.model.layers[0].mlp.experts.gate_up_proj.data[2, 5, 1] += 1
    with pytest.raises(ValueError, match=rf"^export: {layer}\.weight is not the weight"):
        cal.check_model(other, "export")
