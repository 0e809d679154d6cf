"""The recipe the command line describes: a preset, a scheme or a file, with the flags'
group size, KV cache and observers, checked against the model's layers."""

from __future__ import annotations

import json
import re

from .checks import UsageError
from .names import DEFAULT_TARGETS, RECIPE_NAMES


def build_recipe(args, model, observer=None, recipe_name=None):
    """The recipe the flags describe, checked against the model's layers."""
    from dataclasses import replace

    from ..calibration import recipe as R

    observer = observer or args.observer or "minmax"
    kw = {"targets": tuple(args.targets or DEFAULT_TARGETS), "ignore": tuple(args.ignore or ())}
    name = recipe_name or args.recipe
    if getattr(args, "recipe_file", None):
        rec = adjust_recipe_file(_read_recipe_file(args.recipe_file), args, model)
    elif name is not None and name.lower() in RECIPE_NAMES:
        rec = R.preset(name, observer, **kw)
    else:
        rec = R.scheme(name or args.scheme, observer, **kw)
    if args.group_size is not None:
        rec = R.with_group_size(rec, args.group_size)
    if getattr(args, "kv_cache", None):
        rec = replace(rec, kv_cache=replace(R.kv_cache_role(args.kv_cache), observer=(
            "minmax" if observer == R.AUTO else observer)))
    if getattr(args, "weight_observer", None):
        rec = R.with_role_observer(rec, "weight", args.weight_observer)
    if getattr(args, "input_observer", None):
        rec = R.with_role_observer(rec, "input", args.input_observer)
    rec = _indivisible(rec, model, args.on_indivisible)
    from ..calibration.run.observe import check_shapes

    try:  # what calibrate checks first, here before the float model is evaluated
        check_shapes(model, [rec])
    except ValueError as e:
        raise UsageError(str(e)) from None
    return rec


def adjust_recipe_file(rec, args, model):
    """A recipe file as the flags adjust it: ``--ignore``'s patterns (by default the output
    head and pooler) join its ignore list, ``--observer`` replaces every calibrated role's
    observer as it builds a preset's, ``--targets`` narrows its rules. Flags not given leave
    the file as it is."""
    from dataclasses import replace

    rec = replace(rec, ignore=tuple(dict.fromkeys(rec.ignore + tuple(args.ignore or ()))))
    if args.observer:
        rec = rec.with_observer(args.observer)
    if args.targets:
        rec = _narrow(rec, model, args.targets)
    return rec


def _narrow(rec, model, targets):
    """Each rule of ``rec`` restricted to the modules it takes that ``targets`` also match.
    A rule's targets are alternatives, so the intersection is written as the modules' exact
    names: the saved recipe says what was quantized. Rules left with no module are dropped."""
    from dataclasses import replace

    from ..calibration.recipe import _matches

    taken = [[] for _ in rec.rules]
    for name, module in model.named_modules():
        rule = rec.rule_for(name, module)
        if rule is not None and any(_matches(t, name, module) for t in targets):
            # a name with glob characters is matched as a regex of itself, exactly
            exact = name if not set(name) & set("*?[") and not name.startswith("re:") \
                else "re:" + re.escape(name)
            taken[rec.rules.index(rule)].append(exact)
    rules = tuple(replace(r, targets=tuple(t)) for r, t in zip(rec.rules, taken) if t)
    if not rules:
        file_targets = [t for r in rec.rules for t in r.targets]
        raise UsageError(f"--targets {' '.join(targets)}: no module that recipe {rec.name!r}'s "
                         f"rules take (targets {file_targets}, ignore {list(rec.ignore)}) "
                         f"matches it; --targets narrows a recipe file's rules")
    return replace(rec, rules=rules)


def observer_label(args, rec) -> str:
    """The observers the summary and the report name: the flags' (a preset is built from
    them), or for a recipe file the ones its calibrated roles run (weight/input/output)."""
    if getattr(args, "recipe_file", None):
        return "/".join(dict.fromkeys(role.observer for r in rec.rules
                                      for role in r.roles().values()
                                      if role.dynamic is not True)) or "none (all dynamic)"
    return "/".join(dict.fromkeys(o for o in (args.weight_observer, args.input_observer)
                                  if o)) or args.observer or "minmax"


def _read_recipe_file(path):
    from ..calibration.recipe import Recipe

    with open(path) as f:
        text = f.read()
    try:
        d = json.loads(text)
    except json.JSONDecodeError:
        try:
            import yaml
        except ImportError:
            raise UsageError(f"--recipe-file {path!r} is not JSON, and YAML needs pyyaml"
                             ) from None
        d = yaml.safe_load(text)
    try:
        return Recipe.from_dict(d)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UsageError(f"--recipe-file {path!r}: not a recipe ({type(e).__name__}: {e}); "
                         f"expected the structure of Recipe.to_dict()") from None


def _indivisible(rec, model, policy: str):
    """Layers whose weight a grouped spec cannot take: an error naming the layer and the group
    sizes that would divide it, or (``policy == "float"``) those layers added to ``ignore``."""
    from dataclasses import replace

    from ..layout import Group

    bad = {}
    for layer, (module, roles) in rec.match(model).items():
        role = roles.get("weight")
        if role is None or not isinstance(role.spec.layout, Group):
            continue
        width = module.weight.shape[role.spec.layout.axis]
        if width % role.spec.layout.size:
            bad[layer] = (width, role.spec.layout.size)
    if not bad:
        return rec
    if policy == "float":
        return replace(rec, ignore=rec.ignore + tuple(bad))
    layer, (width, size) = next(iter(bad.items()))
    divisors = [d for d in (16, 32, 64, 96, 128, 192, 256) if width % d == 0]
    raise UsageError(f"layer {layer!r} has width {width}, which group size {size} does not "
                     f"divide ({len(bad)} such layers); --group-size "
                     f"{' / '.join(map(str, divisors)) or '(none of 16..256)'} would, or "
                     f"--on-indivisible float leaves them in float")



def float_note(rec, model) -> str:
    """Which modules the ignore list left in float (a short list)."""
    from ..calibration.recipe import _matches

    names = [n for n, m in model.named_modules()
             if n and any(_matches(p, n, m) for p in rec.ignore)]
    top = [n for n in names if not any(n.startswith(m + ".") for m in names)]
    if not top:
        return ""
    shown = ", ".join(top[:4]) + (f" and {len(top) - 4} more" if len(top) > 4 else "")
    return f"left in float: {shown} (--ignore to change)"

