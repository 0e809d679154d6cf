"""How a module takes a recipe's roles, checked before any forward: the layout as the module
holds its weight (a transformers Conv1D's transposed, a ConvTranspose's per-channel axis), and
what each role asks of the module's shapes (a group size that divides the width, units that
do not run along a convolution's kernel or image, static activation layouts that do not
depend on the batch, shapes a lazy module has yet to get, no input role on a layer of two
inputs), each refusal naming the layer.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn
from torch.nn.modules.conv import _ConvNd, _ConvTransposeNd
from torch.nn.parameter import is_lazy

from ...layout import Block, Channel, Group, Tensor, Tile, Token
from ..recipe import Role
from ..structure.conv1d import is_conv1d, transposed_layout

__all__ = ["activation_width", "along_spatial", "check_role_shape", "check_shapes", "module_role"]


def _check_static_layout(layer: str, role: str, spec, module: nn.Module) -> None:
    lay, conv = spec.layout, isinstance(module, _ConvNd)
    if isinstance(lay, Tensor) or (isinstance(lay, Channel) and lay.axis == -1 and not conv):
        return
    if conv:  # its channels are fixed, but the report's and auto's sampled rows (the last
        raise ValueError(  # dim's) do not fit a static per-channel scale
            f"calibrate: layer {layer!r} ({type(module).__name__}) {role}: static "
            f"activation qparams on a convolution take a per-tensor layout, got {spec}; use "
            f"'tensor', or dynamic=True for per-channel ('channel:1') or block activations")
    raise ValueError(
        f"calibrate: layer {layer!r} {role}: static activation qparams need a layout whose "
        f"units do not depend on the batch (tensor, or channel:-1), got {spec}; use "
        f"dynamic=True for per-token or block activations")


def _check_lazy(layer: str, module: nn.Module) -> None:
    """A lazy module (``nn.LazyConv2d``, ``nn.LazyLinear``) has no shapes until its first
    forward: torch's own error on them names neither the layer nor the cure."""
    if any(is_lazy(p) for p in module.parameters(recurse=False)):
        raise ValueError(
            f"calibrate: layer {layer!r} ({type(module).__name__}) has uninitialized lazy "
            f"parameters; run one forward of the model first (model(batch)) to initialize "
            f"them, then calibrate")


def _check_two_inputs(layer: str, role: str, module: nn.Module) -> None:
    """``nn.Bilinear`` takes two tensors, ``x1^T W x2``; an input role's hooks (observing and
    ``apply``'s) read the first alone, so the second would run in float under a state that
    says the layer's input is quantized."""
    if role == "input" and isinstance(module, nn.Bilinear):
        raise ValueError(
            f"calibrate: layer {layer!r} (Bilinear) input: a Bilinear takes two input tensors "
            f"and quantscope quantizes one input per layer; give it a weight-only scheme "
            f"('w4a16', or a Rule with a weight role alone) or ignore it (ignore=[{layer!r}])")


def _spatial_activation(module: nn.Module, layout) -> bool:
    """Whether ``layout``'s units on a conv's activations ``[N, C, *spatial]`` run along the
    spatial dims: a channel axis past the channels' (``channel:-1`` is the image width),
    per token (rows of the last dim), or as :func:`along_spatial` says."""
    if not isinstance(module, _ConvNd):
        return False
    if isinstance(layout, Token):
        return True
    ndim = module.weight.dim()  # [N, C, *spatial] has as many dims as the weight
    if isinstance(layout, Channel) and layout.axis % ndim >= 2:
        return True
    return along_spatial(module, layout)


def activation_width(module: nn.Module, role: str):
    """The width of a Linear's (or Conv1D's) input / output features; None for other modules."""
    if is_conv1d(module):  # no in_ / out_features: its weight is [in, out]
        return module.weight.shape[0 if role == "input" else 1]
    return getattr(module, "in_features" if role == "input" else "out_features", None)


def module_role(layer: str, role: str, cfg: Role, module: nn.Module) -> Role:
    """``cfg`` as ``module`` takes it. A Conv1D weight (Linear's transposed) takes the layout
    transposed; a ConvTranspose weight ``[in, out / groups, *k]`` per-channel (``Channel(0)``)
    on axis 1 (torchao's pt2e axis), refused with groups > 1, where an output channel is no
    index of one axis (as torch.ao refuses per-channel observers there): on either channel
    axis, however spelled (axis 1 would share a scale between ``groups`` output channels)."""
    lay = cfg.spec.layout
    if role == "weight" and is_conv1d(module):
        return replace(cfg, spec=replace(cfg.spec, layout=transposed_layout(lay)))
    if (role != "weight" or not isinstance(module, _ConvTransposeNd)
            or not isinstance(lay, Channel)):
        return cfg
    axis = lay.axis % module.weight.dim()
    if axis > 1:  # a kernel dim: not per output channel, left to the layout's own checks
        return cfg
    if module.groups != 1:
        raise ValueError(
            f"calibrate: layer {layer!r} ({type(module).__name__}, groups={module.groups}) "
            f"weight: per-channel {cfg.spec} needs groups == 1 (a grouped ConvTranspose "
            f"weight [in, out / groups, *k] has no axis of output channels); use a "
            f"per-tensor weight layout or ignore the layer")
    return cfg if axis == 1 else replace(cfg, spec=replace(cfg.spec, layout=Channel(1)))


def along_spatial(module: nn.Module, layout) -> bool:
    """Whether ``layout``'s units would run along a convolution's spatial dims (2 and up):
    the kernel's of its weight ``[channels, channels / groups, *kernel]``, or its
    activations' ``[batch, channels, *spatial]``. A tile's two last dims always do, groups and
    blocks where their axis does (:func:`check_role_shape` refuses them)."""
    if not isinstance(module, _ConvNd):
        return False
    if isinstance(layout, Tile):
        return True
    return isinstance(layout, (Group, Block)) and layout.axis % module.weight.dim() >= 2


def check_role_shape(layer: str, role: str, cfg: Role, module: nn.Module) -> Role:
    """The role as the module takes it (:func:`module_role`). Raise ``ValueError`` naming
    the layer, role and sizes unless its spec can take the module's weight (or its
    activations' width): known from the module alone."""
    _check_lazy(layer, module)
    cfg = module_role(layer, role, cfg, module)
    spec = cfg.spec
    if role == "weight":
        shape = tuple(module.weight.shape)
        if along_spatial(module, spec.layout):
            raise ValueError(
                f"calibrate: layer {layer!r} ({type(module).__name__}) weight of shape {shape} "
                f"cannot take {spec}: its units would run along the kernel dims {shape[2:]} "
                f"of [channels, channels / groups, *kernel]; give the conv a per-tensor or "
                f"per-channel weight, or groups / blocks along a channel axis (axis 0 or 1, "
                f"as 'block:32:1')")
        try:
            spec.layout.check(shape)
        except ValueError as e:
            raise ValueError(f"calibrate: layer {layer!r} weight of shape {shape} "
                             f"cannot take {spec}: {e}") from None
        return cfg
    _check_two_inputs(layer, role, module)
    if _spatial_activation(module, spec.layout):
        raise ValueError(
            f"calibrate: layer {layer!r} ({type(module).__name__}) {role} cannot take {spec}: "
            f"its units would run along the spatial dims of [batch, channels, *spatial] (the "
            f"last dim, the image's width, for channel:-1 or per token); give "
            f"the conv's activations a per-tensor layout, or, with dynamic=True, one per "
            f"channel ('channel:1') or blocks along the channels (axis 1, as 'block:32:1')")
    if cfg.dynamic is False:
        _check_static_layout(layer, role, spec, module)
    width = activation_width(module, role)
    if width is not None:
        try:
            spec.layout.check((1, width))
        except ValueError as e:
            raise ValueError(f"calibrate: layer {layer!r} {role} of width {width} "
                             f"cannot take {spec}: {e}") from None
    return cfg


def check_shapes(model: nn.Module, recipes) -> None:
    """Every targeted module's shapes against what each recipe asks of them, before any
    forward: a group size that does not divide a width is known once the model (even its
    skeleton on the meta device) exists, not after a pass over the data."""
    for recipe in recipes:
        try:
            matched = recipe.match(model)
        except ValueError:  # nothing matches yet (MoE experts match once made Linear views):
            continue        # the plan says so, after moe.attach
        for layer, (module, roles) in matched.items():
            for role, cfg in roles.items():
                check_role_shape(layer, role, cfg, module)
