"""Property tests over the public API (issue 20): whatever the input, either a clear
exception from the documented set, or finite qparams and, for finite input, finite output.

Documented errors: ``ValueError`` / ``TypeError`` with a message (the argument or the
observer named), and ``NotImplementedError`` for combinations a class declares it does
not take. Anything else (RuntimeError from deep inside torch, IndexError, a segfault,
a hang) fails the property, as does a NaN / inf qparam or output from finite input.

Budgets, the profiles and the counts written with ``QUANTSCOPE_FUZZ_STATS``: fuzzing.py,
shared by every tests/robustness/test_fuzz*.py.
"""

import json
import math
import os
import shutil
import tempfile
import warnings

import torch
from fuzzing import DOCUMENTED, FUZZ
from fuzzing import clear as _clear
from fuzzing import count as _count
from fuzzing import mutate_json as _mutate_json
from fuzzing import start as _start
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn

from quantscope import QuantSpec
from quantscope.calibration import calibrate, load
from quantscope.observers import get_observer, list_observers
from quantscope.qdq import fake_quantize
from quantscope.qparams import qparams_from_range

# --------------------------------------------------------------------- strategies
NATIVE = [n for n in list_observers() if ":" not in n]
COMPAT = [n for n in list_observers() if ":" in n]
FORMATS = ["int2", "int4", "int8", "int16", "uint4", "uint8", "fp8_e4m3", "fp8_e5m2",
           "fp6_e3m2", "fp4_e2m1"]
LAYOUTS = ["tensor", "channel", "channel:-1", "group:4", "group:8", "token", "block:8",
           "block:16", "tile:4x4"]
SCALES = ["fp32", "fp32", "pow2:round", "e8m0:floor", "fp8_e4m3"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SPECIALS = ["none", "zero", "subnormal", "huge", "inf", "nan", "constant", "empty"]


@st.composite
def specs(draw):
    kw = {"format": draw(st.sampled_from(FORMATS)), "layout": draw(st.sampled_from(LAYOUTS)),
          "symmetric": draw(st.booleans()), "scale": draw(st.sampled_from(SCALES))}
    try:
        return QuantSpec(**kw)
    except ValueError:
        assume(False)


@st.composite
def tensors(draw):
    """A small tensor of ``dtype`` with one kind of special value mixed in."""
    dtype = draw(st.sampled_from(DTYPES))
    special = draw(st.sampled_from(SPECIALS))
    rows = 0 if special == "empty" else draw(st.integers(1, 6))
    cols = draw(st.sampled_from([1, 4, 8, 16, 32]))
    seed = draw(st.integers(0, 2**16))
    mag = 10.0 ** draw(st.integers(-6, 6))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * mag
    fi = torch.finfo(dtype)
    n = x.numel()
    if n:
        idx = torch.randint(0, n, (max(1, n // 4),), generator=g)
        flat = x.view(-1)
        value = {"none": None, "zero": 0.0, "subnormal": fi.tiny / 4,
                 "huge": fi.max * draw(st.sampled_from([1.0, -1.0, 0.5])),
                 "inf": draw(st.sampled_from([math.inf, -math.inf])), "nan": math.nan,
                 "constant": None, "empty": None}[special]
        if value is not None:
            flat[idx] = value
        if special == "constant":
            x.fill_(draw(st.sampled_from([0.0, 1.0, -3.5, 1e9, -1e9, fi.max])))
    return x.to(dtype), special


def _finite(t: torch.Tensor | None) -> bool:
    return t is None or bool(torch.isfinite(t.float()).all())


def _check_qparams(qp, spec):
    assert _finite(qp.scale) and bool((qp.scale > 0).all()), f"scale {qp.scale}"
    assert _finite(qp.global_scale), f"global_scale {qp.global_scale}"
    if qp.global_scale is not None:
        assert bool((qp.global_scale > 0).all())
    assert _finite(qp.effective_scale) and bool((qp.effective_scale > 0).all())
    zp = qp.zero_point.float()
    assert bool(((zp >= spec.qmin) & (zp <= spec.qmax)).all()), f"zero point {zp}"


# ----------------------------------------------------------------------- properties
@FUZZ
@given(name=st.sampled_from(NATIVE), spec=specs(), data=tensors(),
       batches=st.integers(1, 2), ignore=st.booleans())
def test_native_observers(name, spec, data, batches, ignore):
    _start("native_observers")
    x, special = data
    finite_in = bool(torch.isfinite(x.float()).all())
    try:
        obs = get_observer(name, spec, non_finite="ignore" if ignore else "error")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(batches):
                obs(x)
            qp = obs.calculate_qparams()
            out = fake_quantize(x, qp, spec) if x.numel() else x
    except DOCUMENTED as e:
        assert _clear(e), f"unclear {type(e).__name__}: {e!r}"
        # NaN / inf input in "error" mode must be reported, not absorbed
        _count("native_observers", "clear_errors")
        return
    assert finite_in or ignore, f"{special} input in error mode was not reported"
    _check_qparams(qp, spec)
    assert out.shape == x.shape and out.dtype == x.dtype
    if finite_in:
        assert _finite(out), f"non-finite output from finite {special} input"
    _count("native_observers", "ok")


def _compat_observer(name):
    """A compat class with its toolkit's minimal configuration."""
    if name.startswith("quark:"):  # Quark's classes take their qspec (a dict works)
        return get_observer(name, qspec={"dtype": "int8", "qscheme": "per_tensor",
                                         "symmetric": True, "round_method": "half_even",
                                         "ch_axis": 0, "group_size": 8})
    if name.startswith("llmcompressor:"):
        return get_observer(name, base_name="input", args={"num_bits": 8, "strategy": "tensor"})
    return get_observer(name)


@FUZZ
@given(name=st.sampled_from(COMPAT), data=tensors(), batches=st.integers(1, 3))
def test_compat_observers(name, data, batches):
    _start("compat_observers")
    x, special = data
    finite_in = bool(torch.isfinite(x.float()).all())
    try:
        obs = _compat_observer(name)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(batches):
                obs(x * (i + 1) if finite_in and special != "huge" else x)
            qp = obs.qparams()
            scale, zp = obs.calculate_qparams()
    except DOCUMENTED as e:
        assert _clear(e), f"unclear {type(e).__name__}: {e!r}"
        _count("compat_observers", "clear_errors")
        return
    # torch.ao's rule (its HistogramObserver, Quark's Pro over it): inf dropped with a warning
    dropped = any("torch.inf detected" in str(w.message) for w in caught)
    assert finite_in or dropped or getattr(obs, "non_finite", "error") == "ignore", \
        f"{special} input was not reported"
    _check_qparams(qp, obs.spec)
    assert _finite(torch.as_tensor(scale)) and _finite(torch.as_tensor(zp).float())
    if x.numel():
        assert not finite_in or _finite(fake_quantize(x, qp, obs.spec))
    _count("compat_observers", "ok")


FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from([0.0, -0.0, 1e-45, 3.4028235e38, -3.4028235e38]))


@FUZZ
@given(spec=specs(), lo=st.lists(FLOATS, min_size=1, max_size=4), data=st.data(),
       global_amax=st.one_of(st.none(), FLOATS))
def test_qparams_from_range(spec, lo, data, global_amax):
    hi = data.draw(st.lists(FLOATS, min_size=len(lo), max_size=len(lo)))
    _start("qparams_from_range")  # after the last draw: an aborted generation is no case
    lo_t, hi_t = torch.tensor(lo), torch.tensor(hi)
    gam = None if global_amax is None else torch.tensor(abs(global_amax))
    try:
        qp = qparams_from_range(lo_t, hi_t, spec, global_amax=gam)
    except DOCUMENTED as e:
        assert _clear(e)
        ok_inputs = [lo_t, hi_t] + ([] if gam is None else [gam])
        ordered = bool((lo_t <= hi_t).all())  # lo > hi is refused (torch.ao asserts it)
        assert not (ordered and all(_finite(t) for t in ok_inputs)), \
            f"finite range rejected: {e}"
        _count("qparams_from_range", "clear_errors")
        return
    _check_qparams(qp, spec)
    _count("qparams_from_range", "ok")


# ------------------------------------------------------------ damaged calibrations
_SAVED: dict = {}


def _saved_calibration():
    if not _SAVED:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        root = tempfile.mkdtemp(prefix="quantscope-fuzz-")
        for preset in ("w8a8", "nvfp4", "w8a8-dynamic"):
            c = calibrate(model, [torch.randn(8, 16)], preset, progress=False)
            c.save(os.path.join(root, preset))
        _SAVED.update(root=root, model=model)
    return _SAVED


@FUZZ
@given(preset=st.sampled_from(["w8a8", "nvfp4", "w8a8-dynamic"]),
       target=st.sampled_from(["json", "tensors", "truncate"]), data=st.data())
def test_load_damaged(preset, target, data):
    saved = _saved_calibration()
    path = tempfile.mkdtemp(prefix="quantscope-fuzz-case-")
    try:
        case = os.path.join(path, "c")
        shutil.copytree(os.path.join(saved["root"], preset), case)
        if target == "json":
            p = os.path.join(case, "quantscope.json")
            with open(p) as f:
                meta = json.load(f)
            meta = _mutate_json(meta, data.draw)
            with open(p, "w") as f:
                json.dump(meta, f)
        else:
            p = os.path.join(case, "qparams.safetensors")
            with open(p, "rb") as f:
                raw = bytearray(f.read())
            if target == "truncate":
                raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
            else:  # flip a few bytes, header or data
                for _ in range(data.draw(st.integers(1, 4))):
                    i = data.draw(st.integers(0, len(raw) - 1))
                    raw[i] = data.draw(st.integers(0, 255))
            with open(p, "wb") as f:
                f.write(bytes(raw))
        _start("load_damaged")  # after the last draw
        try:
            calib = load(case)
            model = saved["model"]
            with calib.apply(model):
                out = model(torch.randn(4, 16))
        except DOCUMENTED as e:
            assert _clear(e), f"unclear {type(e).__name__}: {e!r}"
            _count("load_damaged", "clear_errors")
            return
        assert _finite(out), "a damaged calibration loaded and gave NaN / inf"
        _count("load_damaged", "ok")
    finally:
        shutil.rmtree(path, ignore_errors=True)
