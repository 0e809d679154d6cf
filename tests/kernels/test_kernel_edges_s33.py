"""C-kernel edges a sanitizer build found (probe s33).

- ``stats.minmax.unit_minmax`` on units of no elements killed the process (SIGFPE: the C divides
  its rows by E; SIGSEGV: E = 0 took the 8-wide row path); now a ``ValueError`` naming
  ``units``, as the ``quantscope::unit_minmax`` op gives.
- A histogram state whose grid exponents lie outside ``[E_MIN, E_MAX]`` loaded unchecked, and
  binning then shifted a negative value in C; now refused at load, naming the key.
- The extended test builds the kernels with AddressSanitizer and UndefinedBehaviorSanitizer and
  runs those cases and a first bin recorded from ``-inf`` (``first - B`` overflowed int64 in
  ``qs_hist_fused``) under them.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantscope.layout import Channel
from quantscope.observers.histogram import PercentileObserver
from quantscope.spec import QuantSpec
from quantscope.stats import histogram as H
from quantscope.stats.minmax import unit_minmax

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.parametrize("shape,dtype", [((1, 0), torch.bfloat16), ((1, 0), torch.float16),
                                         ((5, 0), torch.float32), ((8, 0), torch.float32),
                                         ((2, 0), torch.float32), ((0, 0), torch.float32)])
@pytest.mark.parametrize("step", ["none", "ends", "update"])
def test_units_of_no_elements_are_refused(shape, dtype, step):
    units = torch.empty(*shape, dtype=dtype)
    kwargs = {"ends": torch.empty(2)} if step == "ends" else {
        "update": ("min", 0.0, torch.zeros(shape[0]), torch.zeros(shape[0]))} \
        if step == "update" else {}
    with pytest.raises(ValueError, match=r"unit_minmax: units must have elements"):
        unit_minmax(units, **kwargs)


def test_a_state_with_grid_exponents_out_of_range_is_refused():
    spec = QuantSpec("int8", Channel(0))
    obs = PercentileObserver(spec, bins=64)
    obs(torch.randn(3, 40))
    state = obs.state_dict()
    for bad in ([1000, -1000, 200], [H.E_MAX + 1, 0, 0], [0, H.E_MIN - 1, 0]):
        state["hist_exp"] = torch.tensor(bad)
        with pytest.raises(ValueError, match=r"hist_exp: its grid exponents must lie in "
                                             r"\[-126, 126\]"):
            PercentileObserver(spec, bins=64).load_state_dict(state)
    state["hist_exp"] = torch.tensor([H.E_MIN, 0, H.E_MAX])  # the ends themselves load
    PercentileObserver(spec, bins=64).load_state_dict(state)


_CASES = r'''
import torch; torch.set_num_threads(2)
from quantscope import kernels
from quantscope.layout import Channel, Tensor
from quantscope.observers.histogram import L2HistogramObserver, PercentileObserver
from quantscope.spec import QuantSpec
from quantscope.stats.minmax import unit_minmax
assert kernels.lib("hist_kernel") is not None and kernels.lib("unit_minmax") is not None
for shape, dt in (((1, 0), torch.bfloat16), ((5, 0), torch.float32)):
    try:
        unit_minmax(torch.empty(*shape, dtype=dt), ends=torch.empty(2))
    except ValueError:
        pass
o = L2HistogramObserver(QuantSpec("int8", Tensor()), bins=64)
o(torch.tensor([[-float("inf")]]))
o(torch.randn(1, 70000))  # the fused one-unit path, on a grid first recorded from -inf
for cols in (1, 3, 17, 33, 65, 129):
    p = PercentileObserver(QuantSpec("int8", Channel(0)), bins=64)
    p(torch.randn(5, cols)); p(torch.randn(5, cols) * 4)
print("clean")
'''


def _sanitizer_libs():
    cc = shutil.which("gcc")
    if cc is None:
        return None
    libs = [subprocess.run([cc, f"-print-file-name={n}"], capture_output=True, text=True,
                           check=False).stdout.strip() for n in ("libasan.so", "libubsan.so")]
    return libs if all(os.path.isabs(p) and os.path.exists(p) for p in libs) else None


@pytest.mark.extended  # builds every C kernel with the sanitizers (about a minute)
def test_the_kernels_run_clean_under_address_and_undefined_behavior_sanitizers(tmp_path):
    libs = _sanitizer_libs()
    if libs is None:
        pytest.skip("needs gcc with libasan and libubsan")
    env = dict(os.environ, PYTHONPATH=str(SRC), QUANTSCOPE_CACHE=str(tmp_path / "cache"),
               CC="gcc -fsanitize=address,undefined,float-cast-overflow "
                  "-fno-sanitize-recover=all -fno-omit-frame-pointer",
               LD_PRELOAD=" ".join(libs), ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    env.pop("QUANTSCOPE_NO_KERNEL", None)
    r = subprocess.run([sys.executable, "-c", _CASES], env=env, capture_output=True, text=True,
                       timeout=900, check=False)
    assert r.returncode == 0 and "clean" in r.stdout, r.stderr[-3000:]
    assert "runtime error" not in r.stderr, r.stderr[-3000:]
