"""What the cached CPU steps share (:mod:`.minmax_step`, the min-max observers', accumulating
or memoryless; :mod:`.hist_step`, the per-tensor histogram observers'; :mod:`.first_step`, a
first-grid histogram's, ModelOpt's): one plan cache, the names of the observer attributes
they keep caches in, which no copy or pickle carries (``Observer.__getstate__`` leaves them
out: a scratch's address is its own object's memory, which a copy would write into), and the
start every step makes (:func:`begin`: the plan, the last shape, leaving inference mode;
first_step leaves it after its NaN / inf test).
"""

from __future__ import annotations

import torch

__all__ = ["CACHES", "MAX_PLANS", "begin", "cached_plan", "leave_inference_mode", "new_shape"]

#: plans kept per observer (keys seen); past it the cache starts over
MAX_PLANS = 16
#: the observer attributes the cached steps cache in: minmax_step's plans and ends, then
#: hist_step's plans and scratch, then first_step's; never copied or pickled
CACHES = ("_cpu_plans", "_cpu_ends", "_hist_plans", "_hist_scratch", "_first_plans",
          "_first_scratch")


def cached_plan(obs, x, attr: str, make):
    """``make(obs, x)``, kept in ``obs.__dict__[attr]`` per ``x``'s ``(shape, stride, dtype)``
    (made on first sight; the cache follows the spec object; past :data:`MAX_PLANS` keys it
    starts over)."""
    spec = obs.spec
    cache = obs.__dict__.get(attr)
    if cache is None or cache[0] is not spec:
        cache = obs.__dict__[attr] = (spec, {})
    plans = cache[1]
    key = (x.shape, x.stride(), x.dtype)
    if key in plans:
        return plans[key]
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plan = plans[key] = make(obs, x)
    return plan


def new_shape(obs, x, units: int = 1) -> bool | None:
    """The cached steps' (:mod:`.hist_step`, :mod:`.first_step`: one unit; :mod:`.minmax_step`)
    test of the last shape: whether ``x``'s shape is new to ``obs`` (the step then records it),
    or None where the last shape held other than ``units`` units under the spec now (a unit
    count changed, or the spec since): the step does not take the call, the general path says
    what is wrong."""
    last = obs._last_shape
    new = last != x.shape
    if new and last is not None and obs.spec.layout.num_units(last) != units:
        return None
    return new


def leave_inference_mode(obs) -> None:
    """``obs.leave_inference_mode()`` (the base class's: a step runs no override) where it
    does something, outside ``torch.inference_mode`` with a buffer made under it; its test
    without the call, which most calls then skip (a step's context is tested before: no
    compile). A step's first update: it may replace buffers."""
    if not torch.is_inference_mode_enabled():
        for buf in obs._buffers.values():
            if buf is not None and buf.is_inference():
                obs.leave_inference_mode()
                return


def begin(obs, x, attr: str, make, units=None, leave: bool = True):
    """A cached step's start: the plan for ``x`` (:func:`cached_plan` of ``make`` in
    ``attr``) and whether ``x``'s shape is new (:func:`new_shape` with ``units(plan)`` units,
    one where ``units`` is None), inference mode left (:func:`leave_inference_mode`: before
    the step reads a buffer; ``leave=False``: the step leaves it itself, after a test that
    may hand the call to a general path refusing it before it leaves, :mod:`.first_step`'s
    NaN / inf); None, nothing changed, where there is no plan or the general path must say
    what is wrong with the shape."""
    plan = cached_plan(obs, x, attr, make)
    if plan is None:
        return None
    shape_is_new = new_shape(obs, x, 1 if units is None else units(plan))
    if shape_is_new is None:
        return None
    if leave:
        leave_inference_mode(obs)
    return plan, shape_is_new
