"""The observer registry: names users know, mapped to classes.

Native names follow llm-compressor (``minmax``, ``static_minmax``, ``mse`` ...).
Classes that keep another toolkit's name and constructor live in
:mod:`quantscope.compat` and register with a prefix (``"torch.ao:MinMaxObserver"``,
``"quark:PerBlockMXObserver"``), since the same short name means different
things in different toolkits.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["OBSERVER_MODULES", "get_observer", "list_observers", "observer_class", "register",
           "register_module", "registered_name"]

_REGISTRY: dict[str, type] = {}  # lower-case name -> class
_DISPLAY: dict[str, str] = {}  # lower-case name -> the name as registered
#: the modules whose import registers observer classes beyond the native families (imported
#: on the first lookup, so that ``import quantscope`` stays light): the compat toolkits. A new
#: toolkit is one module under ``quantscope/compat/`` and one line here (also
#: ``quantscope.OBSERVER_MODULES``).
OBSERVER_MODULES = (
    "quantscope.compat.llmcompressor_legacy",
    "quantscope.compat.quark",
    "quantscope.compat.horizon",
    "quantscope.compat.torch_ao",
    "quantscope.compat.modelopt",
)
# the native families, imported by name before those: the registry does not import its own
# package (quantscope.observers imports the registry), so no import circle
_NATIVE = tuple(f"quantscope.observers.{m}" for m in ("histogram", "imatrix", "minmax", "mse"))
# those declared by register_module (plug-ins)
_MODULES: list[str] = []


def register(*names: str) -> Callable[[type], type]:
    """Class decorator: register under ``names`` (the first is the class's ``name``)."""

    def wrap(cls):
        for n in names:
            if n.lower() in _REGISTRY and _REGISTRY[n.lower()] is not cls:
                raise ValueError(f"register: observer name {n!r} is taken by "
                                 f"{_REGISTRY[n.lower()].__name__}")
            _REGISTRY[n.lower()] = cls
            _DISPLAY[n.lower()] = n
        if "name" not in cls.__dict__:
            cls.name = names[0]
        return cls

    return wrap


def register_module(module: str) -> None:
    """Declare ``module`` (a dotted name) as holding ``@register`` classes: it is imported on
    the first registry lookup. The extension point of observer families outside
    :mod:`quantscope.observers`: :data:`OBSERVER_MODULES` lists quantscope's
    own (the compat toolkits); a plug-in calls this once."""
    if not isinstance(module, str) or not module:
        raise TypeError(f"register_module: module must be a dotted module name, got {module!r}")
    if module not in _MODULES:
        _MODULES.append(module)


def _load_all():
    # importing the modules runs their @register decorators
    import importlib

    for mod in (*_NATIVE, *OBSERVER_MODULES, *_MODULES):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def observer_class(name: str) -> type:
    """The class registered under ``name`` (case-insensitive)."""
    if not isinstance(name, str):
        raise TypeError(f"get_observer: name must be a registry name (str), got "
                        f"{type(name).__name__}")
    _load_all()
    try:
        return _REGISTRY[name.lower()]
    except KeyError:
        raise ValueError(f"get_observer: unknown observer {name!r}; known: "
                         f"{', '.join(list_observers())}") from None


def registered_name(name: str) -> str:
    """``name`` spelt as registered (``"IMATRIX_MSE"`` is ``"imatrix_mse"``), or as given where
    no class is registered under it (its error comes where the observer is made)."""
    _load_all()
    return _DISPLAY.get(name.lower(), name)


def get_observer(name: str, spec=None, **options):
    """An observer by registry name.

    Native observers take ``(spec, **options)``. Prefixed compat names
    (``"torch.ao:MinMaxObserver"``) take their toolkit's own keyword arguments in
    ``options``, and ``spec`` must be None.
    """
    cls = observer_class(name)
    if ":" in name:
        if spec is not None:
            raise ValueError(f"get_observer: {name!r} is a compat class configured by its own "
                             f"arguments; pass them as keywords, not spec")
        return cls(**options)
    return cls(spec, **options)


def list_observers(prefix: str | None = None) -> list[str]:
    """All registered names as registered, sorted; ``prefix="torch.ao"`` keeps one toolkit's."""
    if prefix is not None and not isinstance(prefix, str):  # (.lower() would fail unnamed)
        raise TypeError(f"list_observers: prefix must be a str (a toolkit such as 'torch.ao') "
                        f"or None, got {type(prefix).__name__} {prefix!r}")
    _load_all()
    keys = sorted(_REGISTRY)
    if prefix is not None:
        keys = [k for k in keys if k.startswith(prefix.lower().rstrip(":") + ":")]
    return [_DISPLAY[k] for k in keys]
