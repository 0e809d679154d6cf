"""What the cached CPU steps share (:mod:`.minmax_step`, the accumulating min-max observers';
:mod:`.hist_step`, the per-tensor histogram observers'; :mod:`.first_step`, a first-grid
histogram's, ModelOpt's): their one plan cache and the names
of the observer attributes they keep caches in, which no copy or pickle carries
(``Observer.__getstate__`` leaves them out: a scratch's address is its own object's memory,
which a copy would write into).
"""

from __future__ import annotations

__all__ = ["CACHES", "MAX_PLANS", "cached_plan"]

#: plans kept per observer (keys seen); past it the cache starts over
MAX_PLANS = 16
#: the observer attributes the cached steps cache in: minmax_step's plans and scratch, then
#: hist_step's, then first_step's; never copied or pickled
CACHES = ("_cpu_plans", "_cpu_scratch", "_hist_plans", "_hist_scratch", "_first_plans",
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
