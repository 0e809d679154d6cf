"""How quantscope defines its ``torch.library`` ops (namespace ``quantscope``).

Each op is one schema with an implementation for every device (the torch path, or the C
kernel on the CPU), optionally a CUDA one (the Triton kernel), and a fake one (output
shapes, and the argument checks) that the ``meta`` device, ``FakeTensor``, ``torch.compile``
and ``torch.export`` run. :func:`define` returns the op itself (an ``OpOverload``: call it).
:func:`never_traced` marks the few Python functions that ``torch.compile`` must leave eager.

They are registered with ``torch.library.define`` and a ``Library``'s ``impl`` rather than
the ``torch.library.custom_op`` decorator, because of the host's time per call: the decorator
wraps every call in Python autograd and in-place-view layers, about 10 us per call where
the dispatcher alone takes under 2 (measured on the CPU with an empty op, inference mode
or not). An observer call off the CPU is one to four ops, and on a GPU the host's time is
what it costs the model. Nothing needs those layers: no op is differentiable (observers
watch detached tensors; :func:`define` refuses an input that requires grad), and the
schemas' ``(a!)`` annotations say what each op writes, which is all ``torch.compile``'s
functionalization reads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["define", "never_traced", "on_tensors_device"]

#: the registrations' library (``allow_override``: torch before 2.12 refuses, by default, a
#: second function for an op and dispatch key, which a re-imported module registers)
_LIB = torch.library.Library("quantscope", "FRAGMENT")


def _defined(name: str) -> bool:
    try:
        getattr(torch.ops.quantscope, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def define(schema: str, impl: Callable, *, fake: Callable, cuda: Callable | None = None):
    """Define ``quantscope::<schema>`` (e.g. ``"unit_minmax(Tensor units) -> (Tensor,
    Tensor)"``): ``impl`` on every device, ``cuda`` instead on CUDA, ``fake`` on the meta
    device and under fake tensors. Returns the op."""
    name = schema[:schema.index("(")]
    qualname = f"quantscope::{name}"
    # torch keeps these registrations for the process; a module imported again (after
    # sys.modules was cleared, or reloaded) registers its functions over the earlier ones
    if not _defined(name):
        torch.library.define(qualname, schema[len(name):])
    _LIB.impl(name, _not_differentiable(name, impl), "CompositeExplicitAutograd",
              allow_override=True)
    if cuda is not None:
        _LIB.impl(name, _not_differentiable(name, on_tensors_device(cuda)), "CUDA",
                  allow_override=True)
    torch.library.register_fake(qualname, fake, allow_override=True)
    return getattr(torch.ops.quantscope, name).default


def _not_differentiable(name: str, kernel: Callable) -> Callable:
    """``kernel``, refusing an input that requires grad while grad mode is on. The ops have
    no autograd formula (none is registered, for the time per call: see above), and torch's
    fallback for such an op gives its output a gradient of zero, with a warning at most."""

    @functools.wraps(kernel)
    def call(*args, **kwargs):
        if torch.is_grad_enabled() and any(_wants_grad(a) for a in args):
            raise RuntimeError(
                f"quantscope::{name} is not differentiable and an input requires grad: call "
                f"it on detached tensors (or under torch.no_grad()); for a straight-through "
                f"gradient through fake-quantization use quantscope.fake_quantize(..., "
                f"ste=True)")
        return kernel(*args, **kwargs)

    return call


def _wants_grad(arg) -> bool:
    if isinstance(arg, torch.Tensor):
        return arg.requires_grad
    return isinstance(arg, (list, tuple)) and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in arg)


def on_tensors_device(cuda: Callable) -> Callable:
    """``cuda`` run with its first tensor's device current (in a tensor list too).

    Triton launches on the current device and its stream, and the dispatcher gives a Python
    kernel no device guard: observers on ``cuda:1`` while ``cuda:0`` is current (a model
    split over GPUs, ``--device cuda:1``) would launch on the wrong device."""

    @functools.wraps(cuda)
    def call(*args, **kwargs):
        for a in args:
            t = a[0] if isinstance(a, (list, tuple)) and a else a
            if isinstance(t, torch.Tensor):
                if t.device.index in (None, torch.cuda.current_device()):
                    break  # (the common case: no device switch, its microseconds saved)
                with torch.cuda.device(t.device):
                    return cuda(*args, **kwargs)
        return cuda(*args, **kwargs)

    return call


def never_traced(fn: Callable) -> Callable:
    """``torch.compiler.disable(fn)``, built at its first traced call rather than at import.

    Built only while dynamo traces (an eager call runs ``fn``, as the disabled function
    would), so that ``torch._dynamo`` is not imported by quantscope: that import takes about
    a second, and it imports ``torch.distributed.nn``, whose functions take ``group.WORLD``
    as a default argument; imported after ``init_process_group``, that keeps the group
    alive past ``destroy_process_group``, and the process may then abort at exit
    ("terminate called without an active exception"; torch 2.13, gloo: 2-25 % of runs here).
    Traced, the call builds it and graph-breaks there as the decorator does."""
    built = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal built
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if built is None:
            built = torch.compiler.disable(fn)
        return built(*args, **kwargs)

    return call
