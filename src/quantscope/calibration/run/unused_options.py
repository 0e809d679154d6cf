"""Options set where they would change nothing: warned about, not silently ignored (a
field at its default counts as not set, as in :func:`~..options.from_keywords`); so are a
recipe's targets that match no module and its rules that take none (:func:`warn_idle_rules`).

Each applies to some roles only: sampled rows and the ``missing`` policy to activation
roles (the KV cache's too), ``MoE.min_tokens`` to the static activation ranges of experts
(:func:`~..structure.moe.shrink`). A recipe without such a role takes the option in vain.
"""

from __future__ import annotations

import warnings

from ..._checks import outside_quantscope
from ..options import MoE, Options, Runtime, Sampling
from ..recipe_dict import unmatched

__all__ = ["warn_idle_rules", "warn_unused_activation_options", "warn_unused_moe"]


def _roles(recipes):
    """The activation roles' configs of ``recipes``: every rule's, and the KV cache's."""
    return [cfg for rec in recipes.values()
            for cfg in (*(c for r in rec.rules for c in (r.input, r.output)), rec.kv_cache)
            if cfg]


def warn_unused_activation_options(recipes, opts: Options) -> None:
    """Sampling's rows (for auto and the report) and ``Runtime.missing`` set where no recipe
    quantizes an activation (weight-only); a seed alone is harmless (the command line always
    passes one)."""
    if _roles(recipes):
        return
    s, missing = opts.sampling, opts.runtime.missing
    unused = [str(s)] if (s.tokens, s.budget_mb) != (Sampling.tokens, None) else []
    unused += [f"Runtime(missing={missing!r})"] if missing != Runtime.missing else []
    for what in unused:
        warnings.warn(f"calibrate: {what} changes nothing: it acts on activation roles and no "
                      f"recipe here quantizes an activation (weight-only)",
                      stacklevel=outside_quantscope())


def warn_unused_moe(recipes, moe: MoE, has_experts: bool) -> None:
    """``moe`` set where the model has no MoE layer quantscope knows (``has_experts``
    false), or ``min_tokens`` where no recipe has a static activation role (dynamic ones have
    no range to shrink)."""
    if moe != MoE() and not has_experts:
        warnings.warn(f"calibrate: {moe} changes nothing: the model has no mixture-of-experts "
                      f"layer quantscope knows (moe.py)", stacklevel=outside_quantscope())
    elif moe.min_tokens != MoE.min_tokens and not any(
            cfg.dynamic is not True for cfg in _roles(recipes)):
        warnings.warn(f"calibrate: {moe} changes nothing: min_tokens shrinks experts' static "
                      f"activation ranges and no recipe here has one (weight-only or "
                      f"dynamic)", stacklevel=outside_quantscope())


def warn_idle_rules(model, recipes) -> None:
    """Each recipe's targets that match no module of ``model`` (a misspelt name: the ignore
    list's modules count as matched) and its rules that take no module (every module they
    match ignored, taken by an earlier rule, the first rule that matches taking it, or taking
    none of its roles: a container class, a norm; the first module it matched is named), where
    the recipe takes some module (one taking none raises in :meth:`~..recipe.Recipe.match`):
    one warning per recipe. A rule whose targets all match no module is said once, by its
    targets. compressed-tensors warns of such targets too ("Could not match")."""
    named = [(n, m) for n, m in model.named_modules() if n]
    for rec in recipes.values():
        taken, roleless = set(), {}  # rule index -> the first module it matched in vain
        for n, m, i, roles, why in rec.rule_matches(model):
            if roles:
                taken.add(i)
            else:
                roleless.setdefault(i, f"{n!r} ({type(m).__name__}) {why}")
        if not taken:
            continue
        lost = unmatched([t for r in rec.rules for t in r.targets], named)
        said = [(f"targets {lost} match no module (a misspelt name? a target is a module's "
                 f"name, a class name, or a glob / re: pattern)")] if lost else []
        said += [f"rules[{i}] (targets {list(r.targets)}) takes no module: "
                 + (f"the modules it matches take none of its roles: {roleless[i]}"
                    if i in roleless else "each module it matches is ignored or taken by an "
                    "earlier rule (the first rule that matches a module takes it: put a "
                    "narrower rule first)")
                 for i, r in enumerate(rec.rules)
                 if i not in taken and not set(r.targets) <= set(lost)]
        if said:
            warnings.warn(f"calibrate: recipe {rec.name!r}: {'; '.join(said)}",
                          stacklevel=outside_quantscope())
