"""The recipe the command line describes: a preset, a scheme or a file, with the flags'
group size, KV cache and observers, checked against the model's layers."""

from __future__ import annotations

import functools
import re
from collections.abc import Hashable

from .._jsonfile import PARSER_LIMITS, NotJSON, parse_json, parser_limit
from .checks import UsageError, check_observer_name
from .names import DEFAULT_IGNORE, DEFAULT_TARGETS, RECIPE_NAMES


def build_recipe(args, model, observer=None, recipe_name=None, groups_optional=False):
    """The recipe the flags describe, checked against the model's layers. With
    ``groups_optional`` (compare's list of recipes) ``--group-size`` leaves a recipe without
    grouped roles as it is; the caller checks that some recipe has them."""
    from dataclasses import replace

    from ..calibration import recipe as R
    from ..calibration.role_observers import observed

    observer = observer or args.observer  # None: each preset's / scheme's own observers
    kw = {"targets": tuple(args.targets or DEFAULT_TARGETS), "ignore": ignored(args, model)}
    name = recipe_name or args.recipe
    if getattr(args, "recipe_file", None):
        rec = adjust_recipe_file(read_recipe_file(args.recipe_file), args, model)
    elif name in RECIPE_NAMES:  # spelt as checks.check_recipe_name returns it: W8A8 is a scheme
        rec = R.preset(name, observer, **kw)
    else:
        rec = R.scheme(name or args.scheme, observer, **kw)
    if getattr(args, "kv_cache", None):  # as preset's kv_cache: auto keeps its min-max
        rec = replace(rec, kv_cache=observed(R.kv_cache_role(args.kv_cache), "key",
                                             observer or "minmax", {}))
        if args.targets == []:  # `--targets` and no pattern: no layer, the KV cache alone
            rec = replace(rec, rules=())
    _check_kv_cache(rec, model, getattr(args, "kv_cache", None),
                    "file" if getattr(args, "recipe_file", None) else "preset")
    if args.group_size is not None and R.has_groups(rec):
        rec = R.with_group_size(rec, args.group_size)
    elif args.group_size is not None and not groups_optional:
        raise UsageError(no_groups(rec, args.group_size))
    for role in ("weight", "input"):
        rec = _role_observer(rec, role, getattr(args, f"{role}_observer", None))
    rec = _indivisible(rec, model, args.on_indivisible)
    from ..calibration.run.module_roles import check_shapes

    try:  # what calibrate checks first, here before the float model is evaluated
        check_shapes(model, [rec])
    except ValueError as e:
        raise UsageError(str(e)) from None
    return rec


def _check_kv_cache(rec, model, flag: str | None, source: str = "preset") -> None:
    """A KV cache needs an attention module whose keys and values a runtime caches: said
    once the model is loaded, before the float evaluation (calibrate's own check comes after
    it), naming ``--kv-cache`` (``flag``) where that asked for it, else what the recipe's
    ``source`` (a ``"preset"``, a recipe ``"file"``) offers instead. (An encoder-decoder,
    whose decoder has one, never gets here: the command line refuses it as it loads.)"""
    from ..calibration.recipe import KV_PRESETS, RECIPES
    from ..calibration.structure.kv_cache import attention_modules

    if rec.kv_cache is None or attention_modules(model):
        return
    plain = rec.name.removesuffix("-kv")  # the preset without the KV cache (fp8-kv: fp8)
    if flag:
        asked, leave = f"--kv-cache {flag}:", "leave out --kv-cache"
    elif source == "file":
        asked, leave = f"recipe {rec.name!r} sets kv_cache, but", "take kv_cache out of the file"
    elif rec.name in KV_PRESETS and plain in RECIPES:
        asked = f"recipe {rec.name!r} calibrates the KV cache, but"
        leave = f"use the preset {plain!r} instead, the same without the KV cache"
    else:
        asked, leave = f"recipe {rec.name!r} sets kv_cache, but", "use a recipe without one"
    raise UsageError(f"{asked} the model has no attention module whose keys and values a "
                     f"runtime caches (k_proj / v_proj / qkv_proj in a causal attention that "
                     f"takes the cache, as transformers' decoders have); an encoder such as "
                     f"BERT or MiniLM attends over the whole input at once and keeps no KV "
                     f"cache: {leave}")


def no_groups(rec, size: int) -> str:
    """Why ``--group-size`` cannot apply to ``rec``: the layouts its roles have instead. A
    block (NVFP4's 16, MX's 32) is not a group: its size is the number format's own."""
    from ..layout import Block

    roles = [(k, role.spec.layout) for r in rec.rules for k, role in r.roles().items()]
    has = ", ".join(dict.fromkeys(f"{k} {layout.spec_name()}" for k, layout in roles))
    why = ("; blocks are not groups: their size is fixed by the number format"
           if any(isinstance(layout, Block) for _, layout in roles) else "")
    return (f"--group-size {size}: recipe {rec.name!r} has no grouped weights to change "
            f"({has}){why}; --group-size sets the groups of grouped recipes (W4A16, w4a8 ...)")


def ignored(args, model) -> tuple[str, ...]:
    """``--ignore``'s patterns; by default (DEFAULT_IGNORE) also the module the model names
    its output head, whatever its name (Whisper's ``proj_out``)."""
    from ..calibration.recipe_dict import matches

    patterns = tuple(args.ignore or ())
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if args.ignore != DEFAULT_IGNORE or head is None:
        return patterns
    names = [n for n, m in model.named_modules() if m is head]
    if not names or any(matches(p, names[0], head) for p in patterns):
        return patterns
    return patterns + (names[0],)


def _role_observer(rec, role: str, observer: str | None):
    """``--weight-observer`` / ``--input-observer``: an error where the recipe calibrates no
    such role (W4A16 has no input; w8a8-dynamic's inputs are quantized at run time)."""
    from ..calibration.recipe import with_role_observer

    if observer is None:
        return rec
    try:
        return with_role_observer(rec, role, observer)
    except ValueError as e:
        raise UsageError(f"--{role}-observer {observer}: {e}; leave it out (--observer sets "
                         f"every calibrated role)") from None


def adjust_recipe_file(rec, args, model):
    """A recipe file as the flags adjust it: ``--ignore``'s patterns (by default the output
    head and pooler) join its ignore list, ``--observer`` replaces every calibrated role's
    observer as it builds a preset's, ``--targets`` narrows its rules. Flags not given leave
    the file as it is."""
    from dataclasses import replace

    rec = replace(rec, ignore=tuple(dict.fromkeys(rec.ignore + ignored(args, model))))
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

    from ..calibration.recipe_dict import matches

    taken, at = [[] for _ in rec.rules], {id(r): i for i, r in enumerate(rec.rules)}
    for name, module in model.named_modules():
        rule = rec.rule_for(name, module)
        if rule is not None and any(matches(t, name, module) for t in targets):
            # a name with glob characters is matched as a regex of itself, exactly
            exact = name if not set(name) & set("*?[") and not name.startswith("re:") \
                else "re:" + re.escape(name) + r"\Z"  # re.match: the end anchored too
            taken[at[id(rule)]].append(exact)
    rules = tuple(replace(r, targets=tuple(t)) for r, t in zip(rec.rules, taken) if t)
    if not rules:
        file_targets = [t for r in rec.rules for t in r.targets]
        raise UsageError(f"--targets {' '.join(targets)}: no module that recipe {rec.name!r}'s "
                         f"rules take (targets {file_targets}, ignore {list(rec.ignore)}) "
                         f"matches it; --targets narrows a recipe file's rules")
    return replace(rec, rules=rules)


def observer_label(rec) -> str:
    """The observers the summary and the saved label name: those the built recipe's
    calibrated roles run (weight/input/output, as the recipe holds them: ``--observer mse``
    runs ``memoryless_mse`` on weights), never a flag's that no role took; with no rule, the
    KV cache's (``--targets`` with no pattern: the KV cache alone)."""
    if not rec.rules and rec.kv_cache is not None:
        return f"{rec.kv_cache.observer} (KV cache only)"
    return "/".join(dict.fromkeys(role.observer for r in rec.rules
                                  for role in r.roles().values()
                                  if role.dynamic is not True)) or "none (all dynamic)"


def _unique(path: str, pairs: list) -> dict:
    """A JSON object whose keys are unique (``json`` keeps the last of a repeated key)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        key = next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i]))
        raise UsageError(f"--recipe-file {path!r}: key {key!r} given twice in one object")
    return d


@functools.cache
def _yaml_loader():
    """PyYAML's SafeLoader (plain data, no objects) that also refuses a key given twice in
    one mapping (PyYAML keeps the last) and aliases (``*name``: a recipe needs none, and
    nested ones expand a short file exponentially)."""
    import yaml

    class RecipeLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                raise yaml.composer.ComposerError(
                    None, None, "aliases (*name) are not allowed in a recipe file",
                    self.peek_event().start_mark)
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, Hashable):
                    continue  # (SafeLoader's own error names it below)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice in one mapping",
                        key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    # YAML 1.2's (and JSON's) floats that YAML 1.1 (PyYAML) reads as text, with no dot (1e-8,
    # 2E+3) or no exponent sign (1.0e5): a hand-written `eps: 1e-8` was refused as '1e-8'
    RecipeLoader.add_implicit_resolver(  # (the subclass's own list: SafeLoader keeps its own)
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+.0123456789"))
    return RecipeLoader


#: the fields of a recipe file that hold text (a key, or ``*``: each item of a list), which a
#: YAML number must not fill: ``name: 2e5`` is the float 200000.0 (YAML 1.2's rule, above)
_ROLE_TEXT = (("observer",), ("spec", "format"), ("spec", "layout"), ("spec", "scale"))
_TEXT_FIELDS = (
    ("name",), ("ignore",), ("ignore", "*"), ("split",), ("split", "*"), ("fuse",),
    ("fuse", "*"), ("fuse", "*", "*"), ("rules", "*", "targets"), ("rules", "*", "targets", "*"),
    *(("kv_cache", *f) for f in _ROLE_TEXT),
    *(("rules", "*", role, *f) for role in ("weight", "input", "output") for f in _ROLE_TEXT))
#: the YAML scalars that are no text, by what YAML reads them as (null aside: "no value")
_NOT_TEXT = {f"tag:yaml.org,2002:{tag}": kind for tag, kind in (
    ("int", "a number"), ("float", "a number"), ("bool", "a boolean"),
    ("timestamp", "a date"))}


def _load_yaml(text: str, path: str):
    """``yaml.load`` with the recipe loader, refusing a number, a boolean or a date where the
    recipe takes text (a UsageError naming the field and saying to quote it)."""
    loader = _yaml_loader()(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        for fields in _TEXT_FIELDS:
            for where, scalar in _not_text_at(node, fields, ""):
                at, key = scalar.start_mark, fields[-1] if fields[-1] != "*" else None
                quoted = f'{key}: "{scalar.value}"' if key else f'"{scalar.value}"'
                off = where == "fuse" and scalar.tag.endswith(":bool")  # (fusion's own key)
                raise UsageError(
                    f"--recipe-file {path!r}: {where} (line {at.line + 1}, column "
                    f"{at.column + 1}) is {scalar.value}, which YAML reads as "
                    f"{_NOT_TEXT[scalar.tag]}; the field takes text: quote it, {quoted}"
                    f"{'; to turn fusion off, write fusion: false' if off else ''}")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _not_text_at(node, fields: tuple, where: str):
    """``(field, node)`` of each YAML scalar that is no text (:data:`_NOT_TEXT`) at
    ``fields`` (see _TEXT_FIELDS) under ``node``."""
    import yaml

    if not fields:
        if isinstance(node, yaml.ScalarNode) and node.tag in _NOT_TEXT:
            yield where, node
    elif fields[0] == "*" and isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _not_text_at(item, fields[1:], f"{where}[{i}]")
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.value == fields[0]:
                yield from _not_text_at(value, fields[1:], f"{where}.{key.value}".lstrip("."))


def _recipe_text(path: str):
    """The data of a recipe file: JSON, else YAML (plain data, no objects; each key once)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--recipe-file {path!r}: cannot read it as UTF-8 text ({e})") from None
    where = f"--recipe-file {path!r}"
    try:
        return parse_json(text, where, object_pairs_hook=functools.partial(_unique, path))
    except NotJSON as e:
        json_error = e.error
    except ValueError as e:  # JSON nested too deeply: no YAML either
        raise UsageError(str(e)) from None
    try:
        import yaml
    except ImportError:
        raise UsageError(f"--recipe-file {path!r} is not JSON ({json_error}), and YAML needs "
                         f"pyyaml") from None
    try:
        return _load_yaml(text, path)  # a SafeLoader (above)
    except PARSER_LIMITS as e:
        raise UsageError(str(parser_limit(where, e))) from None
    except ValueError as e:  # an integer past Python's digit limit, as in parse_json
        raise UsageError(f"{where} cannot be read: {e}") from None
    except yaml.YAMLError as e:
        if path.lower().endswith(".json"):  # YAML's message would describe another syntax
            raise UsageError(f"--recipe-file {path!r} is not valid JSON: {json_error}") from None
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UsageError(f"--recipe-file {path!r} parses as neither JSON nor plain YAML: "
                         f"{getattr(e, 'problem', None) or e}{where}") from None


def read_recipe_file(path: str):
    """``--recipe-file``'s :class:`Recipe`, read before the model loads; a file that does not
    parse or does not hold a recipe is a UsageError naming the flag and the file."""
    from ..calibration.recipe import Recipe
    from ..calibration.results.io import check_patterns

    d = _recipe_text(path)
    try:
        rec = Recipe.from_dict(d)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UsageError(f"--recipe-file {path!r}: not a recipe ({type(e).__name__}: {e}); "
                         f"expected the structure of Recipe.to_dict()") from None
    check_patterns(rec, path, lambda p, field, why: UsageError(
        f"--recipe-file {p!r}: {field.removeprefix('recipe.')}: {why}"))
    return _check_observers(rec, path)


def _check_observers(rec, path: str):
    """``rec`` with each role's observer as the registry spells it (``Auto`` is auto),
    checked as ``--observer`` is (closest names, compat classes refused), and its options'
    names and values (the observer built for the role's spec, as calibrate builds it), before
    the model loads: calibrate would only meet them after the float evaluation. A dynamic
    role's observer computes its qparams at run time: checked too."""
    from dataclasses import replace

    from ..calibration.role_observers import AUTO, unknown_options

    def checked(role, where):
        if role is None:
            return None
        name = check_observer_name(role.observer, f"observer (--recipe-file {path!r}, "
                                                  f"{where})")  # any case
        unknown = unknown_options(name, dict(role.options)) if name != AUTO else ()
        if unknown:  # auto's candidates check theirs
            raise UsageError(f"--recipe-file {path!r}, {where}: observer {name!r} takes no "
                             f"option {', '.join(map(repr, unknown))} (its options are "
                             f"its class's keyword-only arguments)")
        role = replace(role, observer=name)
        if name != AUTO:  # (auto's candidates check theirs at calibration)
            _check_builds(role, f"--recipe-file {path!r}, {where}")
        return role

    rules = tuple(replace(r, **{k: checked(role, f"rules[{i}].{k}")
                                for k, role in r.roles().items()})
                  for i, r in enumerate(rec.rules))
    return replace(rec, rules=rules, kv_cache=checked(rec.kv_cache, "kv_cache"))


def _check_builds(role, where: str) -> None:
    """``role``'s observer built with its options for the spec it watches (what calibrate
    and, for a run-time role, the forward build): an option's value it refuses (``percentile:
    "99"``, a string) is a UsageError naming ``where``."""
    from ..calibration.run.observe import observed_spec
    from ..observers.registry import get_observer

    spec = observed_spec(role)
    try:
        get_observer(role.observer, spec, **dict(role.options))
    except (TypeError, ValueError) as e:
        raise UsageError(f"{where}: observer {role.observer!r} with {spec}: {e}") from None


def _indivisible(rec, model, policy: str):
    """Layers whose weight a grouped or block spec (MX, NVFP4) cannot take in whole segments
    (compressed-tensors and vLLM load no partial last one): an error naming the layer and the
    group sizes that would divide it, or (``policy == "float"``) those layers added to
    ``ignore``."""
    from dataclasses import replace

    from ..calibration.run.module_roles import along_spatial, module_role
    from ..layout import Block, Group

    bad, group_widths = {}, set()
    for layer, (module, roles) in rec.match(model).items():
        role = roles.get("weight")
        if role is None or not isinstance(role.spec.layout, (Group, Block)):
            continue
        if along_spatial(module, role.spec.layout):  # a conv kernel: calibrate refuses it
            continue
        lay = module_role(layer, "weight", role, module).spec.layout  # a Conv1D's transposed
        width = module.weight.shape[lay.axis]
        if isinstance(lay, Group):  # (a format's block size is its own: no flag changes it)
            group_widths.add(width)
        if width % lay.size:
            bad[layer] = (width, lay)
    if not bad:
        return rec
    layer, (width, lay) = next(iter(bad.items()))
    block = isinstance(lay, Block)
    said = (f"layer {layer!r} has width {width}, which {'the format' if block else 'group'} "
            f"size {lay.size} does not divide ({len(bad)} such layers)")
    if not block:  # sizes that divide every grouped layer: one that fits only this one fails
        divisors = [d for d in (16, 32, 64, 96, 128, 192, 256)
                    if all(w % d == 0 for w in group_widths)]
        said += f"; --group-size {' / '.join(map(str, divisors)) or '(none of 16..256)'} would"
    if policy == "float":
        kept = replace(rec, ignore=rec.ignore + tuple(bad))
        try:
            kept.match(model)  # (raises where it matches no module; rec's own errors came)
        except ValueError:
            raise UsageError(f"--on-indivisible float leaves every layer the recipe takes in "
                             f"float: {said}") from None
        return kept
    raise UsageError(f"{said}{'; ' if block else ', or '}--on-indivisible float leaves them "
                     f"in float")


def float_note(rec, model) -> str:
    """Which modules the ignore list left in float (a short list); with no rule, every layer."""
    if not rec.rules:
        return "left in float: every layer (the KV cache alone: --targets with no pattern)"
    top = []  # the ignored modules not inside another (named_modules: parents first)
    for n, m in model.named_modules():
        if n and rec.ignored(n, m) and not (top and n.startswith(top[-1] + ".")):
            top.append(n)
    if not top:
        return ""
    shown = ", ".join(top[:4]) + (f" and {len(top) - 4} more" if len(top) > 4 else "")
    return f"left in float: {shown} (--ignore to change)"

