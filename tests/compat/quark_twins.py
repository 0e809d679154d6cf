"""AMD Quark's observer configs and twin observers (Quark's class and quantscope's, of one
config) for the peers tests of :mod:`quantscope.compat.quark`. Import it after
``pytest.importorskip("quark...")``."""

from __future__ import annotations

import contextlib
import io
import warnings

with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import quark.torch.quantization.observer.observer as qo
    from quark.torch.quantization.config.config import QTensorConfig
    from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType

from quantscope.compat import quark


def quark_config(name: str, **kw) -> QTensorConfig:
    """A ``QTensorConfig`` for Quark's observer class ``name``: per tensor, half_even, float
    scales, static, unless ``kw`` says otherwise (enum fields by their values)."""
    kw = {"qscheme": "per_tensor", "round_method": "half_even", "scale_type": "float",
          "is_dynamic": False, **kw}
    kw["dtype"], kw["qscheme"] = Dtype(kw["dtype"]), QSchemeType(kw["qscheme"])
    kw["round_method"] = RoundType[kw["round_method"]]
    kw["scale_type"] = ScaleType(kw["scale_type"])
    return QTensorConfig(observer_cls=getattr(qo, name), **kw)


def quark_twins(name: str, **kw):
    """Quark's observer ``name`` and quantscope's, of one :func:`quark_config`."""
    c = quark_config(name, **kw)
    return getattr(qo, name)(c), getattr(quark, name)(c)
