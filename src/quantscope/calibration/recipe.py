"""Recipes: which modules get which spec and observer, for each role.

A :class:`Recipe` is a list of :class:`Rule` s. A rule names its modules by ``targets`` (a
module class name such as ``"Linear"``, a glob on the module's name such as
``"encoder.layer.*.attention.*"``, or a regular expression on the name prefixed ``"re:"``,
matched from the name's start as compressed-tensors matches llm-compressor's: ``re.match``, not
``re.fullmatch``) and gives a :class:`Role` for each tensor it quantizes: ``weight``, ``input``
(the activation entering the module) and ``output`` (the one leaving it). The first rule that
matches a module wins; ``ignore`` (same syntax) removes modules.

Observer names are registry names (:func:`quantscope.list_observers`) or ``"auto"``: per layer,
the candidate whose range gives the lowest quantization error on that layer's data. Weights are
observed once, so a recipe built from an observer name gives weights its memoryless variant
(``minmax`` -> ``memoryless_minmax``, ``mse`` -> ``memoryless_mse``, as llm-compressor does)
and histogram observers' weights min-max (:func:`weight_observer`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property

from torch import nn

from .. import presets
from ..layout import Group, Tensor
from ..spec import QuantSpec
from .recipe_dict import (
    FirstMatch,
    built,
    fields_from,
    matches,
    own_options,
    patterns,
    preset_key,
    role_options,
)
from .role_observers import AUTO, check_taken, ct_observer, folded, observed, weight_observer
from .structure.placement import taken_roles

__all__ = ["AUTO", "DEFAULT_CANDIDATES", "KV_CACHE", "PRESETS", "RECIPES", "ROLES", "Recipe",
           "Role", "Rule", "preset", "scheme", "weight_observer"]

ROLES = ("weight", "input", "output")
#: what ``observer="auto"`` chooses from (those registered; weights take memoryless variants)
DEFAULT_CANDIDATES = ("minmax", "mse", "percentile", "entropy", "mix", "histogram_mse")
DYNAMIC_MODES = (False, True, "local")


@dataclass(frozen=True)
class Role:
    """How one tensor of a module is quantized.

    Args:
        spec: the quantization scheme.
        observer: a registry name or ``"auto"``.
        dynamic: False (static qparams from calibration), True (qparams computed from each tensor at
            run time, as llm-compressor's ``dynamic=True``: no calibration) or ``"local"`` (NVFP4
            activations: the global scale is calibrated, block scales are computed at run time; a
            spec with no global scale raises).
        options: keyword options for the observer (``{"averaging_constant": 0.1}``, or
            its ``(name, value)`` pairs); kept as a sorted tuple of pairs (hashable).
    """

    spec: QuantSpec
    observer: str = "minmax"
    dynamic: bool | str = False
    options: tuple = ()

    def __post_init__(self):
        if not isinstance(self.spec, QuantSpec):
            raise TypeError(f"Role.spec must be a QuantSpec, got {type(self.spec).__name__}")
        if not isinstance(self.observer, str) or not self.observer:
            raise ValueError(f"Role.observer must be an observer name, got {self.observer!r}")
        object.__setattr__(self, "observer", folded(self.observer))
        # by identity: 1 == True, but everything downstream asks `dynamic is True`
        if not (self.dynamic is True or self.dynamic is False or self.dynamic == "local"):
            raise ValueError(f"Role.dynamic must be one of {DYNAMIC_MODES}, got {self.dynamic!r}")
        if self.dynamic == "local" and not self.spec.scale.has_global_scale:
            # elsewhere the calibrated range would go unused (compressed-tensors refuses it too)
            raise ValueError(f"Role.dynamic: 'local' (a calibrated global scale, block scales "
                             f"at run time) needs fp8 block scales under a global scale "
                             f"(NVFP4), got {self.spec}; use True or False")
        object.__setattr__(self, "options", role_options(self.options))

    @property
    def needs_data(self) -> bool:
        """Whether calibration data is needed (static or ``local`` activations)."""
        return self.dynamic is not True

    def to_dict(self) -> dict:
        """JSON-able ``{"spec", "observer", "dynamic", "options"}``; :meth:`from_dict` reads it."""
        return {"spec": self.spec.to_dict(), "observer": self.observer, "dynamic": self.dynamic,
                "options": dict(self.options)}

    @classmethod
    def from_dict(cls, d: dict, where: str = "Role") -> Role:
        """The role :meth:`to_dict` wrote (``observer``, ``dynamic`` and ``options`` may be
        left out: the defaults); ``where`` names it in errors."""
        return built(cls, fields_from(cls, d, where, spec=_spec_from), where)


def _spec_from(d, where: str) -> QuantSpec:
    """The spec ``QuantSpec.to_dict`` wrote, read key by key as the levels above it."""
    d = fields_from(QuantSpec, d, where)
    try:
        return QuantSpec.from_dict(d)
    except ValueError as e:  # QuantSpec names the field, this the role it belongs to
        raise ValueError(f"{where}: {e}") from None


@dataclass(frozen=True)
class Rule:
    """Modules matched by ``targets`` and the roles they quantize (None: left in float)."""

    targets: tuple[str, ...] = ("Linear",)
    weight: Role | None = None
    input: Role | None = None
    output: Role | None = None

    def __post_init__(self):
        object.__setattr__(self, "targets", patterns("Rule.targets", self.targets))
        for r in ROLES:  # a QuantSpec there would fail only deep inside calibration
            if not isinstance(getattr(self, r), (Role, type(None))):
                raise TypeError(f"Rule.{r} must be a Role (Role(spec, observer)) or None, got "
                                f"{type(getattr(self, r)).__name__}")
        if not self.targets:
            raise ValueError("Rule.targets must name at least one module type or name pattern")
        if self.weight is None and self.input is None and self.output is None:
            raise ValueError(f"Rule {self.targets}: give at least one of weight, input, output")

    def roles(self) -> dict[str, Role]:
        """``{role: Role}`` of the roles given (not None), in ``weight, input, output`` order."""
        return {r: getattr(self, r) for r in ROLES if getattr(self, r) is not None}

    def to_dict(self) -> dict:
        """JSON-able ``{"targets", "weight", "input", "output"}`` (roles: :meth:`Role.to_dict`)."""
        return {"targets": list(self.targets),
                **{r: (None if v is None else v.to_dict())
                   for r, v in ((r, getattr(self, r)) for r in ROLES)}}

    @classmethod
    def from_dict(cls, d: dict, where: str = "Rule") -> Rule:
        role = lambda v, at: None if v is None else Role.from_dict(v, at)  # a role or None
        return built(cls, fields_from(cls, d, where, **dict.fromkeys(ROLES, role)), where)


def _rules(rules, where: str) -> tuple[Rule, ...]:
    if not isinstance(rules, (list, tuple)):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError naming the field)
            f"{where} must be a list of rules, got {type(rules).__name__}")
    return tuple(Rule.from_dict(r, f"{where}[{i}]") for i, r in enumerate(rules))


@dataclass(frozen=True)
class Recipe:
    """Rules (first match wins) and an ignore list; ``name`` labels reports.

    Fusion groups (layers a runtime fuses, so they share scales: see
    :mod:`~quantscope.calibration.structure.fusion`) are found from the model's forward when
    ``fusion`` is True; ``fuse`` adds groups (each entry a tuple of name patterns: the
    matching layers of each parent module form one group, e.g.
    ``(("*.q_a_proj", "*.kv_a_proj_with_mqa"),)``), ``split`` takes layers matching its
    patterns out of their groups.

    ``kv_cache`` (a :class:`Role`, or ``"fp8"``: static fp8 e4m3 per tensor, min-max) gives
    every attention module not ignored the roles ``key`` and ``value``: its key and value states
    as the KV cache holds them, after the rotary embedding (see :mod:`.structure.kv_cache`),
    written as vLLM's ``k_scale`` / ``v_scale``."""

    rules: tuple[Rule, ...]
    ignore: tuple[str, ...] = ()
    name: str = "custom"
    fusion: bool = True
    fuse: tuple = ()
    split: tuple[str, ...] = ()
    kv_cache: Role | None = None

    def __post_init__(self):
        rules = (self.rules,) if isinstance(self.rules, Rule) else self.rules
        if isinstance(rules, (str, Mapping)) or not isinstance(rules, Iterable):  # None, 5
            raise TypeError(f"Recipe.rules must be a Rule or a list of Rules, got {rules!r}")
        object.__setattr__(self, "rules", tuple(rules))
        if not isinstance(self.name, str):  # it labels reports and names the saved recipe
            raise TypeError(f"Recipe.name must be a string, got {self.name!r}")
        object.__setattr__(self, "ignore", patterns("Recipe.ignore", self.ignore))
        fuse = (self.fuse,) if isinstance(self.fuse, str) else self.fuse or ()  # one group
        if not isinstance(fuse, (tuple, list)):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError naming the field)
                f"Recipe.fuse must be a list of groups of name patterns, got {fuse!r}")
        object.__setattr__(self, "fuse", tuple(patterns("Recipe.fuse groups", p)
                                               for p in fuse))
        object.__setattr__(self, "split", patterns("Recipe.split", self.split))
        if not isinstance(self.fusion, bool):
            raise TypeError(f"Recipe.fusion must be True or False, got {self.fusion!r}")
        object.__setattr__(self, "kv_cache", kv_cache_role(self.kv_cache))
        if not self.rules and self.kv_cache is None:  # a KV-cache-only recipe has none
            raise ValueError("Recipe.rules: a recipe needs at least one rule or a kv_cache")
        if bad := [r for r in self.rules if not isinstance(r, Rule)]:
            raise TypeError(f"Recipe.rules must hold Rule objects, got {type(bad[0]).__name__}")

    def match(self, model: nn.Module) -> dict[str, tuple[nn.Module, dict[str, Role]]]:
        """``{module name: (module, {role: Role})}`` for every module a rule takes
        (:func:`taken_roles`) or the KV cache's roles take; raises ``ValueError`` naming the
        targets if the rules take nothing (a KV-cache-only recipe has no rules)."""
        found, dropped = {}, {}
        for name, module, _, roles, why in self.rule_matches(model):
            if roles:
                found[name] = (module, roles)
            elif why:  # one module of each kind and reason, for the error
                dropped.setdefault((type(module).__name__, why), name)
        # rules that take nothing are an error with a KV cache too (a misspelt target)
        if self.kv_cache is not None and (found or not self.rules):
            from .structure.kv_cache import attention_modules

            attention = {n: m for n, m in attention_modules(model).items()
                         if not self.ignored(n, m)}
            for n, m in attention.items():  # (none at all: calibrate_many says so)
                found[n] = (m, {**found.get(n, (m, {}))[1], "key": self.kv_cache,
                                "value": self.kv_cache})
        if not found:
            targets = [t for r in self.rules for t in r.targets]
            if dropped:  # modules match, but none takes a role of its rule: say which and why
                said = "; ".join(f"{n!r} ({kind}) {why}" for (kind, why), n in dropped.items())
                raise ValueError(f"recipe {self.name!r}: modules match targets {targets}, but "
                                 f"none takes a role of its rule: {said}")
            named = [(n, m) for n, m in model.named_modules() if n]  # ignored ones too
            if (any(matches(t, "", model) for t in targets)
                    and not any(matches(t, n, m) for n, m in named for t in targets)):
                raise ValueError(f"recipe {self.name!r}: only the model itself "
                                 f"({type(model).__name__}) matches targets {targets}, and the "
                                 f"root module is never quantized (a layer is named by its path "
                                 f"in the model): wrap it, e.g. nn.Sequential(model)")
            kinds = sorted({type(m).__name__ for _, m in model.named_modules()})
            raise ValueError(f"recipe {self.name!r}: no module matches targets {targets}"
                             f"{f' (ignore {list(self.ignore)})' if self.ignore else ''}; the "
                             f"model's module types are {kinds}")
        return found

    def rule_matches(self, model: nn.Module):
        """``(name, module, rule index, roles, why)`` for each module of ``model`` a rule
        matches (:meth:`rule_index`): the roles it takes of that rule and why none
        (:func:`taken_roles`); :meth:`match` and the idle rules' warning read them."""
        for name, module in model.named_modules():
            i = self.rule_index(name, module)
            if i is not None:
                yield (name, module, i, *taken_roles(name, module, self.rules[i], self.name))

    def rule_for(self, name: str, module: nn.Module) -> Rule | None:
        """The rule that takes the module ``name``: the first whose targets match it, None
        where the ignore list holds it or no rule does (the root module: never)."""
        i = self.rule_index(name, module)
        return None if i is None else self.rules[i]

    def rule_index(self, name: str, module: nn.Module) -> int | None:
        """The index in :attr:`rules` of :meth:`rule_for`'s rule (None: no rule's)."""
        return self._lookups[1](name, module) if name and not self.ignored(name, module) \
            else None

    def ignored(self, name: str, module: nn.Module) -> bool:
        """Whether the ignore list holds the module ``name``."""
        return self._lookups[0](name, module) is not None

    @cached_property  # built once: a mixed-precision recipe names every layer, each a rule
    def _lookups(self) -> tuple[FirstMatch, FirstMatch]:
        return FirstMatch([self.ignore]), FirstMatch(r.targets for r in self.rules)

    def with_observer(self, observer: str, **options) -> Recipe:
        """A copy whose calibrated roles (not dynamic) and KV cache run ``observer`` (weights:
        its :func:`weight_observer`) with ``options`` and their own it takes; run-time roles
        (``dynamic=True``), and the KV cache under ``auto`` (which chooses no KV scales), keep
        theirs, with those of ``options`` it takes. An option no role takes raises."""
        observer = folded(observer)
        rules = tuple(replace(r, **{k: observed(getattr(r, k), k, observer, options)
                                    for k in ROLES}) for r in self.rules)
        kv = observed(self.kv_cache, "key", observer, options)
        roles = [(k, v) for r in self.rules for k, v in r.roles().items()]
        roles += [("key", self.kv_cache)] * (kv is not None)
        check_taken(f"recipe {self.name!r}", [(k, v, observer) for k, v in roles], options)
        return replace(self, rules=rules, name=self.name, kv_cache=kv)

    @property
    def needs_data(self) -> bool:
        """Whether calibration needs batches: a KV cache or a non-``dynamic=True`` activation."""
        return self.kv_cache is not None or any(
            role.needs_data for r in self.rules for k, role in r.roles().items() if k != "weight")

    def to_dict(self) -> dict:
        """All fields, JSON-able (rules, kv_cache by their ``to_dict``), for :meth:`from_dict`."""
        return {"name": self.name, "ignore": list(self.ignore),
                "rules": [r.to_dict() for r in self.rules], "fusion": self.fusion,
                "fuse": [list(p) for p in self.fuse], "split": list(self.split),
                "kv_cache": None if self.kv_cache is None else self.kv_cache.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> Recipe:
        # patterns as written (a string is one pattern) and a kv_cache name ("fp8") as Recipe()
        kv = lambda v, at: Role.from_dict(v, at) if isinstance(v, Mapping) else v
        return cls(**fields_from(cls, d, "Recipe", rules=_rules, kv_cache=kv))


#: ``kv_cache=`` names: the KV cache format vLLM's ``kv_cache_dtype`` takes
KV_CACHE = {"fp8": QuantSpec("fp8_e4m3", Tensor())}


def kv_cache_role(kv_cache) -> Role | None:
    """The :class:`Role` of a recipe's ``kv_cache`` option: None, a Role, or a name of
    :data:`KV_CACHE` (min-max). The KV cache is static and per tensor, as vLLM scales it."""
    if kv_cache is None or isinstance(kv_cache, Role):
        role = kv_cache
    elif isinstance(kv_cache, str) and kv_cache.lower() in KV_CACHE:
        role = Role(KV_CACHE[kv_cache.lower()], "minmax")
    else:
        raise ValueError(f"Recipe.kv_cache must be None, a Role or one of {sorted(KV_CACHE)}, "
                         f"got {kv_cache!r}")
    if role is not None and (role.dynamic is not False
                             or not isinstance(role.spec.layout, Tensor)):
        raise ValueError(f"Recipe.kv_cache: the KV cache takes static per-tensor scales "
                         f"(vLLM's k_scale / v_scale), got {role.spec} dynamic={role.dynamic}")
    if role is not None and role.observer == AUTO:
        raise ValueError("Recipe.kv_cache: name an observer (auto does not choose KV scales)")
    return role


_INT8_ACT = QuantSpec("int8", Tensor())
_INT8_TOKEN = QuantSpec("int8", presets.INT8_PER_TOKEN.layout)
_FP8_ACT = QuantSpec("fp8_e4m3", Tensor())
_FP8_TOKEN = QuantSpec("fp8_e4m3", presets.INT8_PER_TOKEN.layout)


#: recipe name -> function of the observer name giving the Rule for Linear layers (the
#: "recipes"; specs are :data:`quantscope.presets.SPECS`)
RECIPES = {
    # int8 per-channel weights, static int8 per-tensor activations
    "w8a8": lambda obs: Rule(("Linear",), weight=Role(presets.INT8_PER_CHANNEL, obs),
                             input=Role(_INT8_ACT, obs)),
    # int8 per-channel weights, int8 per-token activations computed at run time
    "w8a8-dynamic": lambda obs: Rule(("Linear",), weight=Role(presets.INT8_PER_CHANNEL, obs),
                                     input=Role(_INT8_TOKEN, "memoryless_minmax", True)),
    # int4 symmetric groups of 128 along the input dim; activations stay in float
    "w4a16": lambda obs: Rule(("Linear",), weight=Role(presets.INT4_GROUP128, obs)),
    # int4 asymmetric groups of 128 (integer zero points; llm-compressor's W4A16_ASYM)
    "w4a16-asym": lambda obs: Rule(("Linear",), weight=Role(presets.INT4_GROUP128_ASYM, obs)),
    # int4 g128 weights, static int8 per-tensor activations
    "w4a8": lambda obs: Rule(("Linear",), weight=Role(presets.INT4_GROUP128, obs),
                             input=Role(_INT8_ACT, obs)),
    # fp8 e4m3 per-channel weights, static fp8 per-tensor activations
    "fp8": lambda obs: Rule(("Linear",), weight=Role(presets.FP8_PER_CHANNEL, obs),
                            input=Role(_FP8_ACT, obs)),
    # fp8 e4m3 per-channel weights, fp8 per-token activations at run time (FP8_DYNAMIC)
    "fp8-dynamic": lambda obs: Rule(("Linear",), weight=Role(presets.FP8_PER_CHANNEL, obs),
                                    input=Role(_FP8_TOKEN, "memoryless_minmax", True)),
    # MXFP4 weights and activations: E8M0 block scales, activation blocks at run time
    "mxfp4": lambda obs: Rule(("Linear",), weight=Role(presets.MXFP4, obs),
                              input=Role(presets.MXFP4, "memoryless_minmax", True)),
    # NVFP4: weights with e4m3 block scales under a global scale; activations with a
    # calibrated global scale and run-time block scales (llm-compressor's dynamic="local")
    "nvfp4": lambda obs: Rule(("Linear",), weight=Role(presets.NVFP4, obs),
                              input=Role(presets.NVFP4, obs, "local")),
    # fp8, and the KV cache in fp8 (per-tensor k_scale / v_scale: vLLM's kv_cache_dtype fp8)
    "fp8-kv": lambda obs: RECIPES["fp8"](obs),
}
#: presets that also calibrate the KV cache, and its format
KV_PRESETS = {"fp8-kv": "fp8"}
#: presets whose inputs run their own observer when none is given: llm-compressor's NVFP4
#: scheme calibrates the input global scale on the running max of all batches
INPUT_OBSERVERS = {"nvfp4": "static_minmax"}

#: the earlier name of :data:`RECIPES`
PRESETS = RECIPES


def preset(name: str, observer: str | None = None, *, targets=None, ignore=(),
           kv_cache=None, **options) -> Recipe:
    """A preset recipe by name (:data:`RECIPES`) with ``observer`` (by default ``minmax``, and
    for ``nvfp4``'s inputs ``static_minmax`` as in llm-compressor: :data:`INPUT_OBSERVERS`) for
    modules ``targets`` (``Linear``) minus ``ignore``; ``kv_cache="fp8"`` also calibrates the
    KV cache with ``observer`` (``auto``: min-max, with the options it takes), or as a
    :class:`Role` says (``fp8-kv`` is ``fp8`` with ``kv_cache="fp8"``). A :class:`Recipe` as
    ``name`` comes back as it is, or :meth:`Recipe.with_observer` ``(observer, **options)``;
    the other arguments raise then."""
    if isinstance(name, Recipe):  # nothing given beside it is dropped silently
        given = [k for k, v in (("targets=", targets), ("ignore=", ignore), ("kv_cache=", kv_cache),
                                ("options without observer=", observer is None and options)) if v]
        if given:
            raise ValueError(f"preset: {given[0]} given with Recipe {name.name!r}: only observer= "
                             f"and its options apply to one (change it with dataclasses.replace)")
        return name if observer is None else name.with_observer(observer, **options)
    key, observer = preset_key(name, RECIPES), folded(observer)
    if own_input := (INPUT_OBSERVERS.get(key) if observer is None else None):  # its own observer:
        own_options(f"preset {key!r}", "input", own_input, options)  # with_observer checks minmax
    observer = "minmax" if observer is None else observer
    targets = ("Linear",) if targets is None else targets
    kv_cache = KV_PRESETS.get(key) if kv_cache is None else kv_cache
    named_kv = isinstance(kv_cache, str)  # a format name: with_observer observes it
    # Rule and Recipe read targets / ignore (a string is one pattern, None no ignore list)
    recipe = Recipe((replace(RECIPES[key](observer), targets=targets),), ignore, key,
                    kv_cache=kv_cache if named_kv else None).with_observer(observer, **options)
    (rule,) = recipe.rules
    if own_input:  # the observer llm-compressor's scheme gives these inputs
        rule = replace(rule, input=observed(rule.input, "input", own_input, options))
    return replace(recipe, rules=(rule,), kv_cache=recipe.kv_cache if named_kv else kv_cache)


def scheme(name: str, observer: str | None = None, *, targets=("Linear",), ignore=(),
           **options) -> Recipe:
    """A recipe from a compressed-tensors preset scheme name (``W8A8``, ``W4A16``,
    ``W4A16_ASYM``, ``FP8``, ``FP8_DYNAMIC``, ``NVFP4``, ``MXFP4`` ... : its
    ``PRESET_SCHEMES``), with the same weight and activation specs and dynamic modes, as
    compressed-tensors defines them, but for 8-bit MX (``MXFP8`` ...): its E8M0 scales round
    the block amax with e4m3's mantissa, not fp4's as compressed-tensors does (half its scale
    where the amax mantissa lies in [1.75, 1.9375): docs/guide/pipelines.md). Needs the
    ``compressed-tensors`` package.

    With ``observer`` None each calibrated role runs the scheme's own observer, as
    llm-compressor's oneshot does (``FP8`` and ``NVFP4`` inputs: ``static_minmax``, the running
    max over all batches; a role naming none: ``minmax``), weights its
    :func:`~quantscope.calibration.recipe.weight_observer`, ``options`` going to them as
    :meth:`~quantscope.calibration.recipe.Recipe.with_observer` gives them (an option an
    activation's own observer does not take is a ``ValueError``: name the observer). An ``observer``
    runs on every calibrated role instead (``Recipe.with_observer(observer, **options)``).
    Dynamic roles (``dynamic=True``) are quantized at run time: no observer.
    """
    try:
        from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES, QuantizationScheme
    except ImportError:
        raise ImportError("recipes from scheme names need compressed-tensors: pip install "
                          "'quantscope[peers]'") from None
    from ..compat.llmcompressor_spec import llmcompressor_spec

    key, observer = str(name).upper(), folded(observer)
    if key not in PRESET_SCHEMES or not PRESET_SCHEMES[key]:
        raise ValueError(f"recipe: unknown scheme {name!r}; expected one of "
                         f"{sorted(k for k, v in PRESET_SCHEMES.items() if v)}")
    targets = patterns("targets", targets)
    s = QuantizationScheme(targets=list(targets), **PRESET_SCHEMES[key])
    roles, runs = {}, []
    for role, args in (("weight", s.weights), ("input", s.input_activations),
                       ("output", s.output_activations)):
        if args is None:
            continue
        dynamic = args.dynamic if isinstance(args.dynamic, bool) else "local"
        if dynamic is True:  # computed at run time: keeps its observer, with those it takes
            own = "memoryless_minmax"
        else:
            own = ct_observer(key, role, args.observer) if observer is None else observer
        if observer is None and role != "weight" and dynamic is not True:
            own_options(f"scheme {key!r}", role, own, options)
        bare = Role(llmcompressor_spec(args, role), own, dynamic)
        roles[role] = observed(bare, role, own, options)
        runs.append((role, bare, own))
    check_taken(f"scheme {key!r}", runs, options)  # as Recipe.with_observer: none dropped
    return Recipe((Rule(targets, **roles),), ignore, key)


def with_group_size(recipe: Recipe, size: int) -> Recipe:
    """A copy of ``recipe`` whose grouped roles (``Group`` layouts) use groups of ``size``."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:  # True is no size
        raise ValueError(f"group size must be a positive integer, got {size!r}")

    def regroup(role):
        if role is None or not isinstance(role.spec.layout, Group):
            return role
        return replace(role, spec=replace(role.spec, layout=replace(role.spec.layout, size=size)))
    if not has_groups(recipe):
        raise ValueError(f"recipe {recipe.name!r} has no grouped role for a group size to change")
    rules = tuple(replace(r, **{k: regroup(getattr(r, k)) for k in ROLES}) for r in recipe.rules)
    return replace(recipe, rules=rules)


def has_groups(recipe: Recipe) -> bool:
    """Whether a role of ``recipe`` has a ``Group`` layout (a size ``with_group_size`` sets)."""
    return any(isinstance(role.spec.layout, Group) for r in recipe.rules
               for role in r.roles().values())


def with_role_observer(recipe: Recipe, role: str, observer: str) -> Recipe:
    """A copy of ``recipe`` whose calibrated ``role`` (weight / input / output) runs ``observer``
    as named (the caller chose it: no memoryless variant); a ValueError where none calibrates."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    held = [getattr(r, role) for r in recipe.rules if getattr(r, role) is not None]
    if all(h.dynamic is True for h in held):  # no role the observer would calibrate
        raise ValueError(f"recipe {recipe.name!r} has " + (f"no {role} role" if not held else
                         f"dynamic {role}s, quantized at run time: none is calibrated"))

    def swap(r):
        return r if r is None or r.dynamic is True else replace(r, observer=observer, options=())
    rules = tuple(replace(r, **{role: swap(getattr(r, role))}) for r in recipe.rules)
    return replace(recipe, rules=rules)
