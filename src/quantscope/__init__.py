"""quantscope: quantization observers for PyTorch, every family, format and granularity."""

from . import formats, layout, presets, scales
from . import calibrate  # a callable package: quantscope.calibrate(model, batches, recipe)
from .formats import FloatFormat, IntFormat, get_format
from .layout import Block, Channel, Group, Tensor, Tile, Token
from .observers import Observer, get_observer, list_observers
from .qparams import QParams, qparams_from_range
from .quantize import dequantize, fake_quantize, quantize
from .scales import ScaleEncoding
from .spec import QuantSpec

__version__ = "0.1.0"

__all__ = [
    "QuantSpec", "QParams", "qparams_from_range", "quantize", "dequantize", "fake_quantize",
    "IntFormat", "FloatFormat", "get_format", "ScaleEncoding",
    "Tensor", "Channel", "Group", "Token", "Block", "Tile",
    "Observer", "get_observer", "list_observers",
    "formats", "layout", "presets", "scales", "calibrate",
]
