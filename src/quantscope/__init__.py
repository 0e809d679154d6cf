"""quantscope: quantization observers for PyTorch, every family, format and granularity."""

from . import (
    calibrate,  # a callable package: quantscope.calibrate(model, batches, recipe)
    formats,
    layout,
    presets,
    scales,
)
from .calibrate.sensitivity import keep_float, sensitivity
from .formats import FloatFormat, IntFormat, get_format
from .layout import Block, Channel, Group, Tensor, Tile, Token
from .observers import Observer, get_observer, list_observers
from .qparams import QParams, qparams_from_range
from .quantize import dequantize, fake_quantize, quantize
from .scales import ScaleEncoding
from .spec import QuantSpec

__version__ = "0.1.0"

__all__ = [
    "Block",
    "Channel",
    "FloatFormat",
    "Group",
    "IntFormat",
    "Observer",
    "QParams",
    "QuantSpec",
    "ScaleEncoding",
    "Tensor",
    "Tile",
    "Token",
    "calibrate",
    "dequantize",
    "fake_quantize",
    "formats",
    "get_format",
    "get_observer",
    "keep_float",
    "layout",
    "list_observers",
    "presets",
    "qparams_from_range",
    "quantize",
    "scales",
    "sensitivity",
]
