"""How many torch ops each step of the min-max path dispatches on CUDA, counted without a GPU
(issue 35's wall-time rows: on a GPU each op costs ~5-15 us of host time, a read-back a sync).

Without CUDA the CUDA path is simulated on the CPU: tensors that say they are on ``cuda:0``
hold CPU tensors (:class:`_OnCuda`, under :class:`Counts`), so every device branch of quantscope runs, the
``quantscope::`` ops run their CUDA implementations (the Triton launchers, under Triton's
interpreter), and each op dispatched is counted once (a ``quantscope::`` op, then the ops its
CUDA implementation dispatches), the kernels' own work not.
With CUDA (``--device cuda``) the same counts come from real CUDA tensors.

``python bench/host_ops.py`` prints per path: aten ops, Triton launches, device reads; and
checks that the simulated CUDA path's qparams equal the CPU path's bit for bit. It also
prints the host microseconds per call of each path on tiny CPU tensors (the CPU path, C
kernels included) and of the simulated CUDA path's launchers with the launches stubbed out
(what the launchers' Python costs, independent of the device).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections import Counter

import torch

if not torch.cuda.is_available():  # the launchers run on CPU tensors: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common import host_us
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import quantscope as qs
from quantscope import QuantSpec, presets
from quantscope.calibration.run import observe
from quantscope.calibration.run.samples import RowSample
from quantscope.layout import Channel, Group
from quantscope.qparams import qparams_from_range

#: where the ``quantscope::`` ops' CUDA implementations (``_cuda_<op>``) are defined
_OP_MODULES = ("quantscope.qparams", "quantscope.kernels.ops", "quantscope.kernels.block_ops",
               "quantscope.kernels.price_ops", "quantscope.kernels.select_ops",
               "quantscope.stats.minmax", "quantscope.stats.hist_ops",
               "quantscope.stats.ao_histogram")


def _cuda_impls() -> dict:
    impls = {}
    for name in _OP_MODULES:
        mod = importlib.import_module(name)
        impls.update({k[len("_cuda_"):]: v for k, v in vars(mod).items()
                      if k.startswith("_cuda_") and callable(v)})
    return impls


class _OnCuda(torch.Tensor):
    """A CPU tensor (``inner``) that says it is on ``cuda:0``."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
            storage_offset=inner.storage_offset(), device=torch.device("cuda", 0),
            requires_grad=inner.requires_grad)
        t.inner = inner
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # only under SimCuda
        raise RuntimeError(f"{func}: a simulated CUDA tensor outside SimCuda")

    def __repr__(self):
        return f"OnCuda({self.inner!r})"

    # a read back to the host: torch's own would set a CUDA device guard first
    def _read(self, how):
        if not _ACTIVE:
            return how(self.inner)
        mode = _ACTIVE[-1]
        if not mode._off:
            mode.reads += 1
            mode.calls["read (item, tolist)"] += 1  # one op on CUDA, and a sync
        mode._off += 1
        try:
            return how(self.inner)
        finally:
            mode._off -= 1

    def __bool__(self):
        return self._read(bool)

    def __int__(self):
        return self._read(int)

    def __float__(self):
        return self._read(float)

    def __index__(self):
        return self._read(lambda t: t.__index__())

    def item(self):
        return self._read(lambda t: t.item())

    def tolist(self):
        return self._read(lambda t: t.tolist())

    def __getitem__(self, idx):  # a basic slice (the row sample's): torch's would set a guard
        if isinstance(idx, slice) and idx.step in (None, 1):
            stop = self.shape[0] if idx.stop is None else idx.stop
            return torch.ops.aten.slice.Tensor(self, 0, idx.start or 0, stop)
        return super().__getitem__(idx)


#: the Counts modes entered (the innermost last)
_ACTIVE: list = []


def _cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class Counts(TorchDispatchMode):
    """Counts the aten ops dispatched under it (``calls``), Triton launches and device reads;
    with ``simulate`` it also runs "CUDA" tensors on the CPU (:class:`_OnCuda`)."""

    def __init__(self, simulate: bool):
        super().__init__()
        self.simulate = simulate
        self.calls, self.launches, self.reads = Counter(), 0, 0
        self._impls = _cuda_impls() if simulate else {}
        self._off = 0  # > 0 inside a kernel launch: not counted

    def total(self) -> int:
        return sum(self.calls.values())

    @contextlib.contextmanager
    def kernel(self):
        self.launches += 1
        self._off += 1
        try:
            yield
        finally:
            self._off -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if not self._off:
            self.calls[name] += 1
            if _reads_back(name, args, kwargs):
                self.reads += 1
        if not self.simulate:
            return func(*args, **kwargs)
        sim = any(isinstance(t, _OnCuda) for t in tree_flatten((args, kwargs))[0])
        on_cuda = sim
        if "device" in kwargs:  # a factory, or a copy to a device
            on_cuda = _cuda(kwargs["device"])
            if on_cuda:
                kwargs = {**kwargs, "device": torch.device("cpu")}
        inner_args, inner_kwargs = tree_map(_unwrap, (args, kwargs))
        if func.namespace == "quantscope" and sim:
            impl = self._impls.get(func._opname, func)  # (no CUDA implementation: its own)
            with self:  # the implementation's own ops are counted too
                out = impl(*inner_args, **inner_kwargs)
        else:
            out = func(*inner_args, **inner_kwargs)
        if not on_cuda:
            return out
        originals = {id(a.inner): a for a in args if isinstance(a, _OnCuda)}
        return tree_map(lambda t: _rewrap(t, originals), out)


def _reads_back(name: str, args, kwargs) -> bool:
    """Whether an op reads a CUDA tensor back to the host (a sync)."""
    src = args[0] if args else None
    if not (isinstance(src, _OnCuda) or isinstance(src, torch.Tensor) and src.is_cuda):
        return False
    return name == "aten._local_scalar_dense" or (
        name == "aten._to_copy" and kwargs.get("device") is not None
        and torch.device(kwargs["device"]).type == "cpu")


def _rewrap(t, originals: dict):
    """An op's output ``t`` on the simulated device: the argument it is (an in-place op's
    result is its argument itself), else a new wrapper."""
    if not isinstance(t, torch.Tensor):
        return t
    same = originals.get(id(t))
    return same if same is not None else _OnCuda(t)


def _unwrap(t):
    return t.inner if isinstance(t, _OnCuda) else t


@contextlib.contextmanager
def counting(simulate: bool, stub: bool = False, ops: bool = True):
    """A :class:`Counts` mode; with ``simulate``, CUDA "available" to the code it runs
    (no CUDA runtime is touched) and Triton launches counted, not their interpreted work;
    ``stub``: the launches do nothing (their outputs keep what they held); ``ops=False``:
    launches only, no dispatch mode (whose Python would weigh on a timing)."""
    mode = Counts(simulate)
    patches = []
    patches += _launch_patches(mode, stub)
    if simulate:
        patches.append((torch.cuda, "_lazy_init", lambda: None))
        patches.append((torch.cuda, "current_device", lambda: 0))
        patches.append((torch.cuda, "is_current_stream_capturing", lambda: False))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    _ACTIVE.append(mode)
    try:
        with mode if ops else contextlib.nullcontext():
            yield mode
    finally:
        _ACTIVE.pop()
        for obj, name, value in saved:
            setattr(obj, name, value)


def _launch_patches(mode: Counts, stub: bool = False) -> list:
    """Count each ``kernel[grid](...)`` (compiled or interpreted), not what it runs."""
    import triton

    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime.interpreter import InterpretedFunction as cls
    else:
        cls = triton.runtime.jit.JITFunction
    run = cls.run

    def counted(self, *args, **kwargs):
        with mode.kernel():
            return None if stub else run(self, *args, **kwargs)
    return [(cls, "run", counted)]


def on_device(t: torch.Tensor, simulate: bool) -> torch.Tensor:
    return _OnCuda(t.clone()) if simulate else t.cuda()


# ---- the paths --------------------------------------------------------------------------------

SPECS = {
    "int8 channel sym": QuantSpec("int8", Channel(0)),
    "int8 channel asym": QuantSpec("int8", Channel(0), symmetric=False),
    "int4 group-128": QuantSpec("int4", Group(128)),
    "MXFP4": presets.MXFP4,
    "NVFP4": presets.NVFP4,
    "fp8 tensor": QuantSpec("fp8_e4m3"),
}


def _weight(rows=8, cols=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g)


def paths(spec: QuantSpec, w: torch.Tensor):
    """name -> (setup, call): ``setup()`` makes the state a call needs (not counted)."""

    def observer():
        obs = qs.get_observer("memoryless_minmax", spec).to(w.device)
        obs(w)
        return obs

    def ranges():
        obs = observer()
        return obs.min_vals, obs.max_vals

    def running():  # an activation's observer: its step is one op off the CPU
        obs = qs.get_observer("minmax", spec).to(w.device)
        obs(w)
        return obs

    def hook():  # calibrate's input hook: a static min-max observer and the row sample
        slot = observe.Slot("layer", "input", None, observers={("minmax",): running()})
        slot.sample = RowSample(8 * w.shape[0], None, torch.Generator().manual_seed(0))
        pre, _ = observe._hook([slot])
        observe._IN_PASS.set(True)  # the hooks observe the pass's own forwards only
        return slot, pre

    def runtime_hook():  # a run-time (dynamic) role's input: its NaN / inf flag, the sample
        slot = observe.Slot("layer", "input", None, runtime_check="memoryless_minmax")
        slot.seen_non_finite = w.new_zeros((), dtype=torch.bool)
        slot.sample = RowSample(8 * w.shape[0], None, torch.Generator().manual_seed(0))
        pre, _ = observe._hook([slot])
        observe._IN_PASS.set(True)
        return slot, pre

    def histogram():  # the w8a8-histogram preset's activation observer, a grid made
        obs = qs.get_observer("histogram", spec).to(w.device)
        obs(w)
        return obs

    def call_hook(hooked):
        hooked[0].sample.count = 0  # every call samples as the pass's first batches do
        hooked[1](None, (w,), {})

    return {
        "calibrate hook": (hook, call_hook),
        "calibrate hook, run-time role": (runtime_hook, call_hook),
        "observer forward": (observer, lambda obs: obs(w)),
        "histogram observer forward": (histogram, lambda obs: obs(w)),
        "EMA observer forward": (running, lambda obs: obs(w)),
        "observer calculate_qparams": (observer, lambda obs: obs.calculate_qparams()),
        "qparams_from_range checked": (ranges, lambda r: qparams_from_range(*r, spec)),
        "qparams_from_range unchecked": (
            ranges, lambda r: qparams_from_range(*r, spec, check_finite=False)),
    }


def op_counts(simulate: bool, rows: int, cols: int) -> dict:
    """{(spec, path): (ops, launches, reads, result)}."""
    out = {}
    for sname, spec in SPECS.items():
        w = on_device(_weight(rows, cols), simulate)
        for pname, (setup, call) in paths(spec, w).items():
            with counting(simulate) as c0:
                state = setup()
            with counting(simulate) as c:
                result = call(state)
            del c0
            out[sname, pname] = (c.total(), c.launches, c.reads, result, dict(c.calls))
    return out


def _cpu(t):
    if isinstance(t, _OnCuda):
        return t.inner
    return t.cpu() if isinstance(t, torch.Tensor) else t


def check_values(counts: dict, rows: int, cols: int) -> list[str]:
    """The simulated CUDA path's qparams against the CPU path's, bit for bit."""
    bad = []
    for sname, spec in SPECS.items():
        w = _weight(rows, cols)
        for pname, (setup, call) in paths(spec, w).items():
            ref = call(setup())
            got = counts[sname, pname][3]
            if not isinstance(ref, qs.QParams):
                continue
            for field in ("scale", "zero_point", "global_scale"):
                a, b = _cpu(getattr(got, field)), getattr(ref, field)
                if (a is None) != (b is None) or (a is not None and not (
                        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))):
                    bad.append(f"{sname} / {pname}: {field}")
    return bad


def cpu_times(rows: int, cols: int) -> dict:
    """{(spec, path): host us} of the CPU path on tiny tensors."""
    out = {}
    for sname, spec in SPECS.items():
        w = _weight(rows, cols)
        for pname, (setup, call) in paths(spec, w).items():
            state = setup()
            out[sname, pname] = host_us(lambda: call(state), 400, runs=20, warmup=20)  # noqa: B023
    return out


def launcher_calls(rows: int, cols: int, device: str) -> dict:
    """name -> call: the CUDA implementations of the min-max path's ops, and their Triton
    launchers, on ``device``'s tensors (the CPU: interpreted; what each costs in Python
    with its launch stubbed out)."""
    from quantscope import qparams as qp
    from quantscope.kernels import ops
    from quantscope.kernels.triton import block_qparams, minmax
    from quantscope.stats import minmax as stats_minmax

    units = _weight(rows, cols).to(device)
    lo, hi = units.aminmax(dim=1)
    seen = torch.zeros((), dtype=torch.bool, device=device)
    consts = [-128.0, 127.0, float(torch.finfo(torch.float32).eps), 1.0, 0.0]
    return {
        "launcher unit_minmax": lambda: minmax.unit_minmax(units),
        "launcher update_state (record)": lambda: minmax.update_state(
            lo, hi, None, None, seen, 0, 0.0),
        "launcher int_qparams": lambda: block_qparams.int_qparams(lo, hi, *consts),
        "launcher e8m0_block_scales": lambda: block_qparams.e8m0_block_scales(
            lo, hi, 0, 2, 1, 6.0),
        "launcher global_amax + nvfp4_qparams": lambda: block_qparams.nvfp4_qparams(
            lo, hi, block_qparams.global_amax(lo, hi), 6.0, 448.0, -6, 3, 2.0 ** -9),
        "op impl unit_minmax": lambda: ops._cuda_unit_minmax(units),
        "op impl record_non_finite": lambda: stats_minmax._cuda_record_non_finite(
            lo, hi, seen),
        "op impl int_qparams": lambda: qp._cuda_int_qparams(lo, hi, consts),
    }


def launcher_times(rows: int, cols: int, device: str) -> dict:
    """{name: host us} of :func:`launcher_calls`, every launch stubbed out."""
    calls = launcher_calls(rows, cols, device)
    with counting(False, stub=True, ops=False):
        return {name: host_us(fn, 2000, runs=20, warmup=20) for name, fn in calls.items()}


def launcher_counts(rows: int, cols: int, device: str) -> dict:
    """{name: (aten ops, launches)} of :func:`launcher_calls`."""
    out = {}
    for name, fn in launcher_calls(rows, cols, device).items():
        with counting(False, stub=True) as c:
            fn()
        out[name] = (c.total(), c.launches)
    return out


def report(args) -> dict:
    """Every figure, as a JSON-able dict (``--json``: for a comparison across checkouts)."""
    simulate = args.device == "sim"
    device = "cpu" if simulate else "cuda"
    counts = op_counts(simulate, args.rows, args.cols)
    cpu_counts = {}
    for sname, spec in SPECS.items():
        w = _weight(args.rows, args.cols)
        for pname, (setup, call) in paths(spec, w).items():
            state = setup()
            with counting(False) as c:
                call(state)
            cpu_counts[sname, pname] = c.total()
    out = {"paths": {f"{s} | {p}": {"cuda ops": v[0], "launches": v[1], "reads": v[2],
                                    "cpu ops": cpu_counts[s, p]}
                     for (s, p), v in counts.items()},
           "launchers": {k: {"ops": v[0], "launches": v[1]}
                         for k, v in launcher_counts(args.rows, args.cols, device).items()}}
    if simulate:
        out["values differ"] = check_values(counts, args.rows, args.cols)
    if not args.no_times:
        for k, v in cpu_times(args.rows, args.cols).items():
            out["paths"][f"{k[0]} | {k[1]}"]["cpu us"] = v
        for k, v in launcher_times(args.rows, args.cols, device).items():
            out["launchers"][k]["us"] = v
    return out


def _table(rows: dict, title: str) -> str:
    cols = sorted({c for r in rows.values() for c in r}, key=lambda c: (
        ["cuda ops", "launches", "reads", "cpu ops", "ops", "cpu us", "us"] + [c]).index(c))
    lines = [f"| {title} | " + " | ".join(cols) + " |",
             "|---" * (len(cols) + 1 + title.count("|")) + "|"]
    for name, r in rows.items():
        cells = [f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, ""))
                 for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("sim", "cuda"), default="sim",
                   help="sim: the CUDA path simulated on the CPU (default); cuda: a GPU")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--cols", type=int, default=256)
    p.add_argument("--no-times", action="store_true", help="op counts only")
    p.add_argument("--json", action="store_true", help="one JSON object, no tables")
    args = p.parse_args(argv)
    out = report(args)
    if args.json:
        import json
        print(json.dumps(out))
        return 0
    print(f"# host ops per call, {args.rows}x{args.cols} fp32; cuda: the CUDA path "
          f"({'simulated on the CPU' if args.device == 'sim' else 'on the GPU'}), "
          f"cpu: the CPU path, its host us on one call (median)\n")
    print(_table(out["paths"], "spec | path"))
    print("\n" + _table(out["launchers"], "CUDA implementation, launch stubbed ("
                        + ("CPU tensors" if args.device == "sim" else "CUDA") + ")"))
    bad = out.get("values differ")
    if bad is not None:
        print("\nvalues: the simulated CUDA path's qparams equal the CPU path's" if not bad
              else f"\nvalues DIFFER: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
