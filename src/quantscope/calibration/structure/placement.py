"""Where a model's weights are. quantscope observes, fake-quantizes and exports whole tensors
held in memory; two placements hold less, and are refused up front, naming the parameter:

* a **DTensor** (FSDP2's ``fully_shard``, tensor parallelism): each rank holds a shard, and
  a tensor-parallel layer's hooks see each rank's slice of its activations, so every range
  would be one rank's. Calibrate the whole model on each rank with
  ``Runtime(distributed=True)`` instead (batches, not tensors, are split).
* the **meta device** (a skeleton, or accelerate's offload: ``device_map`` with CPU / disk
  offload, ``cpu_offload``, where a weight is loaded only inside its module's forward), and
  compressed-tensors' offload (llm-compressor's), where each read of a weight is a copy:
  there is no data to observe or quantize. A skeleton calibrates block by block from its
  checkpoint (``sequential=Sequential(checkpoint=folder)``, which loads each block itself);
  an offloaded model is loaded without offload, or calibrated the same way from its folder.

A module's own weights (:func:`own_weights`) are what the refusals of a module quantscope does
not quantize name: an LSTM's ``weight_ih_l0``, none of a block's (its layers hold them). They
decide which roles of a recipe's rule a module takes (:func:`taken_roles`), and why none
(:func:`no_weight_role`).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize

from ..._checks import write_refused
from ...observers.base import is_dtensor

__all__ = ["check_module", "check_placement", "held_weight", "is_block", "loaded_copies",
           "no_weight_role", "own_weights", "plain", "refuse_compiled", "restore_problem", "stored",
           "taken_roles", "unhooked"]

_SEQUENTIAL = ("calibrate it block by block from its checkpoint: calibrate(empty_model(folder), "
               "..., sequential=Sequential(checkpoint=folder))")


def check_module(model, who: str) -> None:
    """Raise ``TypeError`` naming ``who`` where ``model`` is no ``torch.nn.Module`` (None, a
    Calibration: an AttributeError deep inside otherwise)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}: model must be a torch.nn.Module, got {type(model).__name__}")


def check_placement(model: nn.Module, who: str, *, calibrating: bool = False,
                    skeleton: bool = False) -> None:
    """Raise ``ValueError`` naming the first parameter or buffer of ``model`` that is a
    DTensor or lies on the meta device, or the first parameter that is no dense tensor
    (:func:`plain`) (``calibrating``: the error suggests a sequential calibration), and
    ``TypeError`` where ``model`` is no module. ``skeleton``: meta parameters are expected (a
    sequential calibration loads them), but not meta buffers (it loads none), nor under
    accelerate's offload hooks, which would move the loaded weights back to the meta device
    after each forward."""
    check_module(model, who)
    also = f", or {_SEQUENTIAL}" if calibrating or skeleton else ""
    for prefix, module in model.named_modules():
        copies = loaded_copies(module)
        if copies is not None:
            raise ValueError(
                f"{who}: the parameters of {prefix or 'the model'!r} are offloaded by "
                f"compressed-tensors ({copies}: each read loads a copy, so values written "
                f"into it are lost); load the model without offload{also}")
        offloaded = hasattr(module, "_hf_hook")  # accelerate's hook on a dispatched model
        for name, t in [*module.named_parameters(recurse=False),
                        *module.named_buffers(recurse=False)]:
            full = f"{prefix}.{name}" if prefix else name
            if is_dtensor(t):  # (a tensor subclass too, with a message of its own)
                raise ValueError(
                    f"{who}: {full!r} is a DTensor sharded across ranks ({t.placements}, by "
                    f"FSDP2 or tensor parallelism): quantscope works on whole tensors; load the "
                    f"whole model on each rank (calibrate's Runtime(distributed=True) splits "
                    f"the batches instead: docs/guide/distributed.md)")
            if isinstance(t, nn.Parameter) and not plain(t):
                raise ValueError(
                    f"{who}: {full!r} is a tensor of type {type(t).__name__} ({t.layout}), not "
                    f"a dense one (a torchao-quantized or sparse weight): quantscope reads float "
                    f"values; give the layer a dense float weight (e.g. its dequantize()) or "
                    f"ignore it")
            buffer = name in module._buffers
            if t.device.type != "meta" or (skeleton and not offloaded and not buffer):
                continue
            if skeleton and not offloaded:  # its blocks load parameters, not buffers
                raise ValueError(
                    f"{who}: the buffer {full!r} is on the meta device: a sequential "
                    f"calibration loads the parameters from the checkpoint, not buffers (rotary "
                    f"tables are computed); build the skeleton with "
                    f"quantscope.calibration.empty_model(folder) (or accelerate's "
                    f"init_empty_weights() without include_buffers)")
            if offloaded:
                raise ValueError(
                    f"{who}: {full!r} is offloaded by accelerate (device_map with CPU / disk "
                    f"offload, cpu_offload: on the meta device between forwards); load the "
                    f"model without offload{also}")
            raise ValueError(f"{who}: {full!r} is on the meta device (no data); load the "
                             f"weights{also}")


def loaded_copies(module: nn.Module) -> str | None:
    """What offloads ``module``'s parameters where each read of one is a fresh copy (its
    ``_parameters`` is compressed-tensors' ``OffloadCache``, llm-compressor's offloading, from
    disk or another device): a write into the copy is lost. None where reads are the tensors
    held (a plain dict, or a cache that onloads to where it offloads)."""
    store = module._parameters
    if type(store) is dict or not store:
        return None
    off, on = getattr(store, "offload_device", None), getattr(store, "onload_device", None)
    if off is not None and on is not None:
        copies = off == "disk" or not _same_device(torch.device(off), torch.device(on))
    else:  # another Mapping: two reads of one tensor (not a None, which is never copied)
        key = next((k for k in store if store[k] is not None), None)
        copies = key is not None and store[key] is not store[key]
    return f"{type(store).__name__} offloading to {off or 'elsewhere'}" if copies else None


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` alike where one names no index (the current device)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def stored(module: nn.Module, name: str) -> torch.Tensor:
    """The tensor ``module`` stores as ``name``: a weight parametrized after apply()
    (``torch.nn.utils.parametrize``) is stored as its parametrization's ``original``, which
    holds the QDQ'd values as they were (where no ``right_inverse`` changed them:
    :func:`restore_problem`); ``module.weight`` is then a value computed from it."""
    if parametrize.is_parametrized(module, name):
        return module.parametrizations[name].original
    return getattr(module, name)


def restore_problem(module: nn.Module, name: str) -> tuple[str, str] | None:
    """Why values written into ``module``'s ``name`` now would not be its weight (or cannot be
    written: an inference tensor outside inference mode), and the way out; None where they
    would. A parametrization registered after apply() through a
    ``right_inverse`` stores other values; a model offloaded after apply() holds the
    quantized values in the offload's store (accelerate's: the module a meta tensor;
    compressed-tensors': a copy at each read)."""
    if parametrize.is_parametrized(module, name) and any(
            hasattr(p, "right_inverse") for p in module.parametrizations[name]):
        why = "was parametrized after apply() through a right_inverse"
        return (f"{why}, which stores other values than the fake-quantized weight",
                "remove the parametrization first (parametrize.remove_parametrizations)")
    if write_refused(stored(module, name)):
        why = "is an inference tensor (made under torch.inference_mode())"
        return f"{why}, which torch writes only inside it", "call remove() in inference mode"
    copies = loaded_copies(module)
    if copies is not None or stored(module, name).is_meta:
        why = f"was offloaded after apply() ({copies or 'accelerate: on the meta device'})"
        return (f"{why}, whose store now holds the fake-quantized values",
                "call remove() before offloading the model")
    return None


def unhooked(work: nn.Module) -> nn.Module:
    """``work`` (a copy quantscope exports) without accelerate's dispatch hooks (a
    ``device_map``, ``force_hooks``): they wrap each module's forward in a partial, which
    compressed-tensors wraps again as a method, and move tensors between devices, which a
    copy whose weights are whole (:func:`check_placement`) and on one device needs not."""
    if any(hasattr(m, "_hf_hook") for m in work.modules()):
        from accelerate.hooks import remove_hook_from_module

        remove_hook_from_module(work, recurse=True)
    return work


def plain(t: torch.Tensor) -> bool:
    """Whether ``t`` holds its values as a dense tensor: strided, and no tensor subclass with
    a dispatch of its own (a torchao-quantized weight holds codes and scales). For a model's
    parameters: a traced observer's input is a FakeTensor, a subclass of that kind."""
    return (t.layout == torch.strided
            and type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__)


def held_weight(who: str, layer: str, module: nn.Module):
    """``module``'s weight as a tensor it holds, which fake-quantizing writes into: raises
    ``ValueError`` naming ``layer`` where a write would be lost (a weight computed at each
    forward: weight_norm, pruning, any parametrization) or cannot be made (an expanded
    tensor, whose elements share memory). None where the module has no weight tensor."""
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor):
        return None
    if w is not module._parameters.get("weight", module._buffers.get("weight")):
        raise ValueError(
            f"{who}: {layer}.weight ({type(module).__name__}) is computed at each forward (a "
            f"parametrization such as weight_norm, or pruning), not a tensor the module holds; "
            f"fold it first (torch.nn.utils.parametrize.remove_parametrizations, "
            f"torch.nn.utils.prune.remove) or ignore the layer")
    if torch._debug_has_internal_overlap(w) == 1:  # 1: certainly overlapping (stride 0)
        raise ValueError(f"{who}: {layer}.weight has elements sharing memory (an expanded "
                         f"tensor, stride {tuple(w.stride())}): no value of it can be "
                         f"quantized alone; give the layer a weight of its own (.clone())")
    return w


def own_weights(module: nn.Module) -> list[str]:
    """The names of ``module``'s own Parameters of 2 dims or more, its submodules' left out: a
    Linear's ``weight``, an LSTM's ``weight_ih_l0`` / ``weight_hh_l0``, none of a block's."""
    return [n for n, p in module.named_parameters(recurse=False)
            if not is_lazy(p) and p.dim() >= 2]


def is_block(module: nn.Module) -> bool:
    """Whether ``module`` holds no weight of its own and the layers in it hold theirs (a
    Sequential, a transformer block): a target for the Linears in it, not for itself."""
    return (getattr(module, "weight", None) is None and not own_weights(module)
            and any(own_weights(m) for m in module.modules() if m is not module))


def no_weight_role(module: nn.Module) -> str:
    """Why ``module`` takes no weight role: its ``weight`` has under 2 dims (a norm's scale),
    or it has none: the layers in it hold theirs, or its own weights are Parameters of other
    names (an LSTM's), or it has no weights."""
    weight = getattr(module, "weight", None)
    if weight is not None:
        return f"has a {weight.dim()}-D weight (a norm's scale), no layer's"
    if is_block(module):
        return "holds no weight for the weight role (the layers in it do)"
    own = own_weights(module)
    if not own:
        return "holds no weight for the weight role"
    names = ", ".join(own[:4]) + (", ..." if len(own) > 4 else "")
    return (f"holds no `weight` for the weight role: its weights are the Parameters {names}, "
            f"which quantscope does not quantize (it quantizes a layer's `weight`: a "
            f"Linear's, a convolution's, an Embedding's); give it a rule with an input role "
            f"alone, or rules on the Linear layers around it")


#: modules whose input is indices, not an activation: a rule's input role skips them
_INDEXED = (nn.Embedding, nn.EmbeddingBag)


def taken_roles(name: str, module: nn.Module, rule, recipe: str = "custom"):
    """``(roles, why)``: the roles of ``rule`` (a :class:`~..recipe.Rule`: recipe imports this
    module, so it is not imported here) that ``module`` takes, and why none. A weight
    role takes a weight Parameter of 2 dims or more, with the rule's other roles, as
    compressed-tensors quantizes the Linear / Embedding layers a target matches, not the
    modules holding them nor norms (a computed weight raises); an Embedding no input role."""
    roles = rule.roles()
    weight = getattr(module, "weight", None) if "weight" in roles else None  # a parametrized
    if weight is not None and not isinstance(weight, nn.Parameter):  # one is computed if read
        raise ValueError(f"recipe {recipe!r}: module {name!r} ({type(module).__name__}) "
                         f"matches {rule.targets} with a weight role but has no weight parameter")
    if "weight" in roles and (weight is None or not isinstance(  # a lazy one: refused later
            weight, nn.parameter.UninitializedParameter) and weight.dim() < 2):
        return {}, no_weight_role(module)
    if isinstance(module, _INDEXED):  # its input is token ids: no activation there
        roles.pop("input", None)
    return roles, None if roles else ("takes no input role (Embedding / EmbeddingBag: its "
                                      "input is token ids); give a weight role")


def refuse_compiled(model: nn.Module, who: str) -> None:
    """Refuse a ``torch.compile(module)`` wrapper (``OptimizedModule``), as the model or one of
    its submodules: once it ran, its cached graphs skip hooks added later (dynamo does not
    guard on module hooks by default), so activations would go unobserved or unquantized
    without a word. ``module.compile()`` in place keeps calling them: accepted."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not loaded: nothing compiled
    compiled = getattr(eval_frame, "OptimizedModule", None)
    if compiled is None:
        return
    found = [name for name, module in model.named_modules() if isinstance(module, compiled)]
    if found:
        where, inner = ("model", "model._orig_mod") if not found[0] else (
            f"submodule {found[0]!r}", f"{found[0]}._orig_mod")
        raise ValueError(
            f"{who}: the {where} is a torch.compile'd module (OptimizedModule): its compiled "
            f"graphs do not run forward hooks added after it ran, so activations would be "
            f"neither observed nor fake-quantized; pass the module it wraps ({inner}) and "
            f"torch.compile after apply()")
