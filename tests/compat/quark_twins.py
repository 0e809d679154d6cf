"""AMD Quark's observer configs and twin observers (Quark's class and quantscope's, of one
config) for the peers tests of :mod:`quantscope.compat.quark`. Importing it imports nothing
of ``quark.torch``: skip on ``pytest.importorskip("quark")``, and mark the tests that use it
``xdist_group("quark")``."""

from __future__ import annotations

import contextlib
import importlib
import io
import warnings
from typing import TYPE_CHECKING

from quantscope.compat import quark

if TYPE_CHECKING:
    from quark.torch.quantization.config.config import QTensorConfig


class LazyModule:
    """The module ``name``, imported (quietly) at its first attribute read. ``quark.torch``'s
    import takes ~27 s (its quark_experts module parses ~600 transformers files): deferred, the
    tests' collection never pays it, and of ``make test``'s two workers only the one that runs
    the ``xdist_group("quark")`` tests does."""

    def __init__(self, name: str):
        self._name, self._module = name, None

    def __getattr__(self, attr: str):
        if attr.startswith("_"):  # pytest's collection probes a module's names (_mock_name ...)
            raise AttributeError(attr)
        if self._module is None:
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


qo = LazyModule("quark.torch.quantization.observer.observer")
qtypes = LazyModule("quark.torch.quantization.config.type")
qconfig = LazyModule("quark.torch.quantization.config.config")


def quark_config(name: str, **kw) -> QTensorConfig:
    """A ``QTensorConfig`` for Quark's observer class ``name``: per tensor, half_even, float
    scales, static, unless ``kw`` says otherwise (enum fields by their values)."""
    kw = {"qscheme": "per_tensor", "round_method": "half_even", "scale_type": "float",
          "is_dynamic": False, **kw}
    kw["dtype"], kw["qscheme"] = qtypes.Dtype(kw["dtype"]), qtypes.QSchemeType(kw["qscheme"])
    kw["round_method"] = qtypes.RoundType[kw["round_method"]]
    kw["scale_type"] = qtypes.ScaleType(kw["scale_type"])
    return qconfig.QTensorConfig(observer_cls=getattr(qo, name), **kw)


def quark_twins(name: str, **kw):
    """Quark's observer ``name`` and quantscope's, of one :func:`quark_config`."""
    c = quark_config(name, **kw)
    return getattr(qo, name)(c), getattr(quark, name)(c)
