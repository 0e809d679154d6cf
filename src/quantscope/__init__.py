"""quantscope: quantization observers for PyTorch, every family, format and granularity.

Names are imported on first use (PEP 562), so ``quantscope --help`` and other light entry
points answer without importing torch.
"""

import importlib

__version__ = "0.1.0"

#: public name -> the submodule that defines it (``None``: the name is that submodule)
_EXPORTS = {
    "Block": "layout", "Channel": "layout", "Group": "layout", "Tensor": "layout",
    "Tile": "layout", "Token": "layout",
    "FloatFormat": "formats", "IntFormat": "formats", "get_format": "formats",
    "Observer": "observers", "get_observer": "observers", "list_observers": "observers",
    "OBSERVER_MODULES": "observers.registry",
    "QParams": "qparams", "qparams_from_range": "qparams",
    "dequantize": "qdq", "fake_quantize": "qdq", "quantize": "qdq",
    "ScaleEncoding": "scales",
    "QuantSpec": "spec",
    "keep_float": "calibration.choice.sensitivity", "sensitivity": "calibration.run.session",
    "calibrate": "calibration",  # the function; its attributes: quantscope.calibrate.load ...
    "export": "exporters",  # the function; its attributes: quantscope.export.register ...
    "distributed": None, "formats": None, "layout": None, "presets": None, "scales": None,
}

__all__ = [
    "Block", "Channel", "FloatFormat", "Group", "IntFormat", "Observer", "QParams", "QuantSpec",
    "ScaleEncoding", "Tensor", "Tile", "Token", "calibrate", "dequantize", "distributed",
    "export", "fake_quantize", "formats", "get_format", "get_observer", "keep_float", "layout",
    "list_observers", "presets", "qparams_from_range", "quantize", "scales", "sensitivity",
]


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'quantscope' has no attribute {name!r}")
    where = _EXPORTS[name]
    if where is None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value  # once imported, an ordinary attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))

