"""Weights on demand: a model skeleton with no weights in memory, and a checkpoint's
safetensors read a few tensors at a time (memory-mapped), for sequential calibration
(:mod:`.sequential`) of models larger than memory."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import torch
from torch import nn

from ..._checks import outside_quantscope
from ..._jsonfile import read_json
from ..._plainchecks import quant_method
from ..structure.expert_views import is_experts_3d, is_gated
from .disk_names import checkpoint_names, expert_names

__all__ = ["TASKS", "Checkpoint", "empty_model", "is_meta", "load_params", "model_task",
           "open_checkpoint", "unload_params", "warn_unused"]

#: what ``--task`` takes, the model class and metric following it (:func:`model_task` tells
#: them apart by architecture)
TASKS = ("causal-lm", "embedding")


def model_task(path) -> str:
    """``"causal-lm"`` or ``"embedding"``, from the folder's ``config.json`` architectures."""
    config = read_json(Path(path) / "config.json", "model_task")
    archs = (config.get("architectures") if isinstance(config, dict) else None) or []
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    return "causal-lm" if causal else "embedding"


def empty_model(path, task: str | None = None) -> nn.Module:
    """The model of a Hugging Face folder with every parameter on the meta device (no
    weights in memory): the skeleton :func:`~.sequential.calibrate_sequential` loads block by block.
    Its class is the one the folder's ``config.json`` ``architectures`` names (as its
    ``from_pretrained`` builds it: ``BartForConditionalGeneration`` with its ``lm_head``), else
    (no architectures, or ``task`` given: ``"causal-lm"`` or ``"embedding"``) the one
    ``load_model`` builds for that task. Buffers are those ``from_pretrained`` gives
    (:func:`_real_buffers`). A demo model's folder is
    ``quantscope.demo.models.resolve_model_path(name)``."""
    from ..._versions import require
    from .hf_loader import load_config, parameter_budget

    require("transformers", "empty_model")  # older ones leave the rotary tables unset
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"empty_model: {str(path)!r} is not a Hugging Face model "
                                f"folder (no config.json)")
    _check_task(task)
    config = load_config(path, "empty_model")  # never runs the folder's code
    build = _skeleton_builder(path, config, task)
    ckpt = Checkpoint(path)
    # nothing allocated, not even transiently (RLIMIT_DATA); no model far larger than the
    # checkpoint holds tensors for (a damaged num_hidden_layers)
    with parameter_budget(len(ckpt.where), f"empty_model: {path / 'config.json'}"), \
            torch.device("meta"):
        model = build()
    _real_buffers(model, ckpt, f"empty_model: {str(path)!r}")
    model.eval()
    return model


def _check_task(task) -> None:
    if task is not None and task not in TASKS:
        raise ValueError(f"empty_model: task must be one of {TASKS} (or None: the class "
                         f"config.json's architectures names), got {task!r}")


def _skeleton_builder(path: Path, config, task):
    """What builds the model ``from_pretrained`` would: the first transformers model class
    ``config.architectures`` names, else ``task``'s (default :func:`model_task`) Auto class,
    as ``load_model`` builds it."""
    import transformers

    from .hf_loader import model_class

    archs = getattr(config, "architectures", None)
    if task is None and archs:
        where = f"empty_model: {path / 'config.json'}"
        try:
            cls = model_class(archs, where)
        except ValueError as e:
            raise ValueError(f"{e}; pass task= (one of {TASKS})") from None
        if not isinstance(config, cls.config_class):
            raise ValueError(f"{where}: architectures names {cls.__name__}, whose config is "
                             f"{cls.config_class.__name__}, not the folder's "
                             f"{type(config).__name__}; pass task= (one of {TASKS})")
        return lambda: cls._from_config(config)
    task = task or model_task(path)
    auto = (transformers.AutoModelForCausalLM if task == "causal-lm"
            else transformers.AutoModel)
    return lambda: auto.from_config(config, trust_remote_code=False)


def _real_buffers(model, ckpt: Checkpoint, who: str) -> None:
    """Replace the model's meta buffers by those transformers' ``from_pretrained`` gives: a
    persistent one the checkpoint holds read from it, any other computed by the initializer
    of the model, or sub-model, it belongs to (``initialize_weights``: a VLM's vision tower
    has its own) with the parameters marked loaded, as the loader marks them. The
    initializer runs twice, on buffers filled with 0 then 1: one that keeps its fill (left
    unset: uninitialised memory in ``from_pretrained``) is refused, naming it."""
    persistent = set(model.state_dict(keep_vars=True))
    # {id(meta buffer): [it, (module, attr) ...]}, {id: its first full name}
    holders, todo = {}, {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for attr, b in module._buffers.items():
            if b is not None and b.device.type == "meta":
                holders.setdefault(id(b), [b]).append((module, attr))
                todo.setdefault(id(b), f"{mname}.{attr}".lstrip("."))
    loaded = {}
    for i, name in list(todo.items()):
        key = _key(model, name, ckpt) if name in persistent else None
        if key is not None:
            b, t = holders[i][0], ckpt.get(key)
            if tuple(t.shape) != tuple(b.shape):
                raise ValueError(f"{who}: checkpoint tensor {key!r} gives shape "
                                 f"{tuple(t.shape)}, the model's buffer {tuple(b.shape)}")
            loaded[i] = torch.empty_like(b, device="cpu").copy_(t)
            del todo[i]
    for i, t in loaded.items():
        _put_buffer(holders[i], t)
    if not todo:
        return
    runs = [_initialized(model, {i: holders[i] for i in todo}, fill) for fill in (0, 1)]
    unset = [todo[i] for i in todo if not _same(runs[0][i], runs[1][i])]
    if unset:
        raise ValueError(f"{who}: transformers' initializer of {type(model).__name__} leaves "
                         f"the buffers {unset} unset (from_pretrained would hold uninitialised "
                         f"memory there); load the model whole instead")


def _put_buffer(holder: list, value: torch.Tensor) -> None:
    """``holder``: ``[meta buffer, (module, attr) ...]``, every place one buffer is in."""
    for module, attr in holder[1:]:
        module._buffers[attr] = value


def _initialized(model, holders: dict, fill) -> dict:
    """``{id: buffer}``: ``holders``' buffers filled with ``fill``, then run through the
    model's ``initialize_weights`` with every other tensor marked initialized (left as it is),
    the random state as it was before (both runs draw the same numbers)."""
    made = {i: torch.full_like(h[0], fill, device="cpu") for i, h in holders.items()}
    for i, t in made.items():
        _put_buffer(holders[i], t)
    fresh = {id(t) for t in made.values()}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in fresh:
            t._is_hf_initialized = True
    for m in model.modules():  # the previous run's marks: every module initialized again
        m.__dict__.pop("_is_hf_initialized", None)
    with torch.random.fork_rng(devices=[]):
        model.initialize_weights()
    for p in model.parameters():  # the skeleton's parameters as from_config made them
        p.__dict__.pop("_is_hf_initialized", None)
    return {i: h[1][0]._buffers[h[1][1]] for i, h in holders.items()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where both hold one (an initializer's own NaN is no unset value)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    same = a == b
    if a.is_floating_point() or a.is_complex():
        same |= a.isnan() & b.isnan()
    return bool(same.all())


#: a sharded checkpoint's map of tensor names to files, as transformers writes it
INDEX = "model.safetensors.index.json"


class Checkpoint:
    """The tensors of a folder's ``*.safetensors`` files, read one at a time (mmap): those
    its ``model.safetensors.index.json`` names, as transformers reads them, else every file
    (a tensor in two of them refused: which one the model is made of cannot be told). A
    quantized checkpoint is refused (:func:`_refuse_quantized`)."""

    def __init__(self, path):
        path = Path(path)
        _refuse_quantized(path)
        index = path / INDEX
        files = _indexed(index) if index.is_file() else {
            f: None for f in (sorted(path.glob("*.safetensors")) if path.is_dir() else [path])}
        if not files or not all(f.is_file() for f in files):
            raise ValueError(f"calibrate: checkpoint {str(path)!r} has no .safetensors files"
                             if not files or not index.is_file() else f"calibrate: {index} names "
                             f"{sorted(str(f) for f in files if not f.is_file())}, not files")
        try:
            from safetensors import safe_open
        except ImportError:
            from ..results.saving import safetensors

            safetensors()  # save / load's ImportError naming the [model] extra
            raise

        self._open = safe_open
        self.where = {}
        for f, names in files.items():
            try:
                with safe_open(f, "pt") as st:
                    keys = set(st.keys())
            except Exception as e:  # safetensors' own error names no file (a truncated shard)
                raise ValueError(f"calibrate: checkpoint file {str(f)!r} is not a readable "
                                 f"safetensors file ({type(e).__name__}: {e})") from e
            for k in sorted(keys) if names is None else names:
                if k not in keys:
                    raise ValueError(f"calibrate: {index} puts tensor {k!r} in {str(f)!r}, "
                                     f"which does not hold it")
                if k in self.where:
                    raise ValueError(f"calibrate: checkpoint tensor {k!r} is in both "
                                     f"{str(self.where[k])!r} and {str(f)!r}; keep one file "
                                     f"or list the shards in {INDEX}")
                self.where[k] = f

    def get(self, name: str) -> torch.Tensor:
        return self.get_many([name])[name]

    def get_many(self, names) -> dict[str, torch.Tensor]:
        """Each file opened once: its tensors are views of one mapping of the file (a
        handle per tensor would map the whole file once per tensor)."""
        by_file = {}
        for n in names:
            by_file.setdefault(self.where[n], []).append(n)
        out = {}
        for f, ns in by_file.items():
            with self._open(f, "pt") as st:
                for n in ns:
                    out[n] = st.get_tensor(n)
        return out


def _refuse_quantized(path: Path) -> None:
    """Refuse the checkpoint of a quantized model (a ``quantization_config`` in the folder's
    ``config.json``: a compressed-tensors export, GPTQ, FP8 ...): its weights are stored as
    codes and scales that transformers decompresses on load; read here as they are, the
    int8 / fp8 codes would be calibrated as float weights."""
    config = (path if path.is_dir() else path.parent) / "config.json"
    if not config.is_file():  # a folder of safetensors alone: not told
        return
    # one that cannot be read tells nothing: refused
    method = quant_method(read_json(config, "calibrate"))
    if method is not None:
        raise ValueError(f"calibrate: checkpoint {str(path)!r} is quantized ({config} has a "
                         f"quantization_config, quant_method {method!r}): its weights are "
                         f"stored as quantized codes and scales (compressed tensors), not float "
                         f"weights; calibrate from the float (unquantized) checkpoint instead")


def is_meta(module: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in module.parameters())


def load_params(model, names: set[str], ckpt: Checkpoint | None,
                device) -> dict[str, nn.Parameter]:
    """Give the parameters called ``names`` (full names) that are on the meta device their
    checkpoint values. A name the checkpoint lacks takes the value of a tied alias
    (``lm_head.weight`` is ``embed_tokens.weight``), or of the tensors transformers writes it
    as (:func:`_disk_source`: a renamed module, an MoE's per-expert tensors). Every tensor is
    read and checked before any is set: a bad one leaves the model as it was. Returns
    ``{name: the meta parameter it replaced}`` (tied aliases too): what
    :func:`unload_params` puts back."""
    aliases = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    todo = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)
            if n in names and p.device.type == "meta"]
    if todo and ckpt is None:
        raise ValueError(f"calibrate: parameter {todo[0][0]!r} is on the meta device; pass "
                         f"sequential=Sequential(checkpoint=...) (the model's safetensors "
                         f"folder)")
    source, disk = {}, {}
    for n, p in todo:
        if id(p) not in source:
            source[id(p)] = _disk_source(model, [n, *aliases[id(p)]], ckpt, disk)
    wanted = {k for keys, _ in source.values() for k in keys}
    tensors = ckpt.get_many(wanted) if todo else {}
    done = {}
    for n, p in todo:
        if id(p) not in done:
            keys, build = source[id(p)]
            t = build([tensors[k] for k in keys])
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"calibrate: checkpoint tensor {keys[0]!r} gives shape "
                                 f"{tuple(t.shape)}, the model expects {tuple(p.shape)}")
            if p.is_floating_point() and (not t.is_floating_point() or t.element_size() == 1):
                # int8 / fp8 codes of a quantized checkpoint that has no config beside it
                raise ValueError(f"calibrate: checkpoint tensor {keys[0]!r} holds {t.dtype} "
                                 f"(quantized codes?), the model's parameter is {p.dtype}; "
                                 f"calibrate from the float (unquantized) checkpoint")
            # the skeleton's requires_grad: torch picks MultiheadAttention's kernel by it
            done[id(p)] = p, nn.Parameter(t.to(device=device, dtype=p.dtype),
                                          requires_grad=p.requires_grad)
    replaced = {}
    for key, (p, loaded) in done.items():
        for alias in aliases[key]:  # tied names stay one tensor
            _set_param(model, alias, loaded)
            replaced[alias] = p
    return replaced


def _first(tensors):
    return tensors[0]


def _indexed(index: Path) -> dict:
    """``{file: [its tensor names]}`` from a sharded checkpoint's index (its ``weight_map``).
    A shard is a plain file name of the folder, as transformers writes it: a path (absolute,
    with a separator or ``..``) would read a file outside the folder given."""
    data = read_json(index, "calibrate")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ValueError(f"calibrate: {index} has no weight_map of tensor names to files")
    files = {}
    for k, v in weight_map.items():
        if v in ("", ".", "..") or "\\" in v or os.path.basename(v) != v:
            raise ValueError(f"calibrate: {index}: weight_map[{k!r}] is {v!r}, not a shard "
                             f"file name of the folder (a path, which could name a file "
                             f"outside it)")
        files.setdefault(index.parent / v, []).append(k)
    return files


def _key(model, name: str, ckpt: Checkpoint) -> str | None:
    """The checkpoint's key for the model's tensor ``name``: the name itself, else (as
    transformers' loader does) with the model's ``base_model_prefix`` added (a base model
    from a task model's checkpoint: ``bert.embeddings...``) or removed (a task model from a
    base model's). None where none is there."""
    prefix = getattr(model, "base_model_prefix", "")
    for key in (name, *((f"{prefix}.{name}", name.removeprefix(f"{prefix}."))
                        if prefix else ())):
        if key in ckpt.where:
            return key
    return None


def _disk_source(model, names: list[str], ckpt: Checkpoint, disk: dict):
    """``(checkpoint keys, build)``: where the parameter called ``names`` (its tied aliases
    too) lies in ``ckpt`` and how its value is built from them: its own name, else the name
    transformers writes it under (:func:`.disk_names.checkpoint_names`; ``disk`` caches
    them), else, for a 3-D experts parameter, its per-expert tensors stacked."""
    for n in names:
        if _key(model, n, ckpt) is not None:
            return [_key(model, n, ckpt)], _first
    if not disk:
        disk.update(checkpoint_names(model, [m for m, _ in model.named_modules() if m]))
    for n in names:
        owner, _, attr = n.rpartition(".")
        on_disk = _key(model, f"{disk.get(owner, owner)}.{attr}", ckpt)
        if on_disk is not None:
            return [on_disk], _first
        parts = _expert_parts(model, model.get_submodule(owner), attr, disk.get(owner, owner),
                              len(ckpt.where))
        keys = [_key(model, k, ckpt) for k in parts[0]] if parts is not None else [None]
        if None not in keys:
            return keys, parts[1]
    raise ValueError(f"calibrate: checkpoint has no tensor {names[0]!r} (nor under the names "
                     f"transformers writes it with)")


def _expert_parts(model, module, attr: str, on_disk: str, tensors: int):
    """``(keys, build)`` of a 3-D experts parameter from the checkpoint's per-expert tensors
    (``<experts>.<e>.w1.weight`` ...): the exporter's layout (:mod:`quantscope.exporters.
    experts`) read back: gate rows then up rows, transposed where the module is. None where
    the checkpoint's ``tensors`` are too few to hold them all."""
    names = expert_names(model) if is_experts_3d(module) else None
    if names is None:
        return None
    gate, up, down = names
    base, _, suffix = attr.partition("_proj")
    suffix = "bias" if suffix == "_bias" else "weight"
    gated = is_gated(module)
    shards = {"gate_up": [gate, up] if gated else None, "up": [up], "down": [down]}.get(base)
    if shards is None:
        return None
    count = getattr(module, f"{base}_proj").shape[0]
    if count * len(shards) > tensors:  # a damaged num_local_experts: no list of 10**11 keys
        return None
    keys = [f"{on_disk}.{e}.{s}.{suffix}" for e in range(count) for s in shards]
    flip = getattr(module, "is_transposed", False) and suffix == "weight"

    def build(tensors):
        per = len(shards)
        rows = [torch.cat(tensors[e * per:(e + 1) * per], 0) for e in range(count)]
        return torch.stack([r.t() if flip else r for r in rows])

    return keys, build


def warn_unused(model, ckpt: Checkpoint, path) -> None:
    """Warn, as transformers reports unexpected keys, naming the checkpoint tensors no
    parameter or buffer of ``model`` is read from (another model's checkpoint whose shapes
    fit: a Qwen2's q / k / v biases in a Llama, a deeper model's extra layers). Left out, as
    transformers does: the model class's ``_keys_to_ignore_on_load_unexpected``, and
    tensors named as one of the model's buffers (rotary tables older versions saved)."""
    claimed, disk = set(), {}
    aliases = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    for names in aliases.values():
        try:
            claimed.update(_disk_source(model, names, ckpt, disk)[0])
        except ValueError:  # not in the checkpoint: a parameter held in memory
            pass
    buffers = {n.rpartition(".")[2] for n, _ in model.named_buffers()}
    claimed.update(_key(model, n, ckpt) for n, _ in model.named_buffers())
    ignore = [re.compile(r) for r in getattr(model, "_keys_to_ignore_on_load_unexpected",
                                             None) or ()]
    unused = sorted(k for k in ckpt.where if k not in claimed
                    and k.rpartition(".")[2] not in buffers
                    and not any(r.search(k) for r in ignore))
    if unused:
        warnings.warn(f"calibrate: checkpoint {str(path)!r} holds {len(unused)} tensors unused "
                      f"by the model ({', '.join(unused[:5])}"
                      f"{', ...' if len(unused) > 5 else ''}): is it this model's checkpoint?",
                      stacklevel=outside_quantscope())


def open_checkpoint(model, path, device=None) -> Checkpoint | None:
    """The :class:`Checkpoint` at ``path`` (None for None) that ``model``'s parameters on the
    meta device load from, its tensors the model reads none of warned about
    (:func:`warn_unused`). A model with none on the meta device reads nothing from it (its
    files are checked all the same): say so rather than ignore it (and ``device``, where
    loaded weights go), and None."""
    if path is None:
        return None
    ckpt = Checkpoint(path)
    if not is_meta(model):
        moved = (f"; device={device} moves nothing either (it is where weights loaded from "
                 f"the checkpoint go)" if device is not None else "")
        warnings.warn(f"calibrate: checkpoint={str(path)!r} is not read: every parameter of "
                      f"the model is already in memory (none on the meta device), and those "
                      f"weights are calibrated{moved}. To calibrate the checkpoint's weights "
                      f"one block at a time, pass empty_model({str(path)!r}) as the model; "
                      f"else drop checkpoint=", stacklevel=outside_quantscope())
        return None
    warn_unused(model, ckpt, path)
    return ckpt


def _set_param(model, name, value) -> None:
    owner, _, attr = name.rpartition(".")
    model.get_submodule(owner)._parameters[attr] = value


def unload_params(model, replaced: dict[str, nn.Parameter]) -> None:
    """Put back the meta parameters :func:`load_params` replaced: the same objects (their
    ``requires_grad``, the references a caller holds, tied aliases one tensor), and only
    those (a parameter the model held loaded before stays)."""
    for name, p in replaced.items():
        _set_param(model, name, p)
