"""The tensor types of the ONNX export.

Integer initializers are stored as ONNX stores them on disk: little-endian
``raw_data``, one byte per int8 / uint8 code, two bytes per int16 / uint16 code, two int4 /
uint4 codes per byte (the first in the low nibble, the ONNX spec's packing). ``make_tensor``
with a Python list writes ``int32_data`` varints instead: 5.5 bytes per int8 weight code on
average (a negative code takes 10), an "int8" model larger than its float32 one.

Float values are float32: ONNX Runtime's CPU ``QuantizeLinear`` takes float32 scales only
and has no bf16 kernels (issue 37: a bf16 graph passed onnx.checker, then ORT refused it).
A bf16 / fp16 model is exported from a float32 copy (:func:`float32_model`), its forward's
own casts to bf16 / fp16 made float32 casts (:func:`float32_graph`); a ``QuantizeLinear``
still reading another type is a ``ValueError`` before anything is written
(:func:`check_float32_quantize`)."""

from __future__ import annotations

import numpy as np
import torch

# ONNX integer type -> the numpy type of its codes; the 4-bit types are packed by hand
# (numpy has no int4; onnx's own int4 arrays need ml_dtypes, missing before onnx 1.18)
_NUMPY = {"INT8": np.int8, "UINT8": np.uint8, "INT16": np.int16, "UINT16": np.uint16}
_NIBBLES = ("INT4", "UINT4")
_LOW_TORCH = (torch.bfloat16, torch.float16)
_LOW_ONNX = ("BFLOAT16", "FLOAT16")


def code_tensor(name: str, dtype: int, codes: torch.Tensor):
    """An ``onnx.TensorProto`` of integer ``codes`` (any integer torch dtype, values already
    in ``dtype``'s range) in ``raw_data``, shaped as ``codes``."""
    from onnx import TensorProto, helper

    kind = TensorProto.DataType.Name(dtype)
    flat = codes.detach().cpu().contiguous().reshape(-1).to(torch.int32).numpy()
    if kind in _NIBBLES:
        raw = pack_nibbles(flat)
    elif kind in _NUMPY:
        raw = flat.astype(np.dtype(_NUMPY[kind]).newbyteorder("<")).tobytes()
    else:
        raise ValueError(f"onnx export: {name}: no integer storage for ONNX type {kind} "
                         f"(expected one of {[*_NIBBLES, *_NUMPY]})")
    return helper.make_tensor(name, dtype, list(codes.shape), raw, raw=True)


def pack_nibbles(flat: np.ndarray) -> bytes:
    """4-bit codes two per byte, element ``2i`` in the low nibble of byte ``i`` (an odd count
    leaves the last high nibble 0); signed codes as their two's complement nibble."""
    nib = (flat.astype(np.int64) & 0xF).astype(np.uint8)
    if nib.size % 2:
        nib = np.append(nib, np.uint8(0))
    return (nib[0::2] | (nib[1::2] << 4)).tobytes()


def float32_model(model, example_inputs):
    """``model`` and its inputs in float32: a copy where any parameter or buffer is bf16 /
    fp16, so the graph computes in float32; the weight codes are those of the same values
    (bf16 / fp16 -> fp32 is exact)."""
    import copy

    if not any(t.dtype in _LOW_TORCH for t in (*model.parameters(), *model.buffers())):
        return model, example_inputs

    def cast(v):
        return v.float() if isinstance(v, torch.Tensor) and v.dtype in _LOW_TORCH else v

    if isinstance(example_inputs, dict):
        example_inputs = {k: cast(v) for k, v in example_inputs.items()}
    elif isinstance(example_inputs, (tuple, list)):
        example_inputs = tuple(cast(v) for v in example_inputs)
    else:
        example_inputs = cast(example_inputs)
    return copy.deepcopy(model).float(), example_inputs


def float32_graph(graph) -> None:
    """The graph of :func:`float32_model`'s copy in float32 throughout: a cast the forward
    makes itself (``x.to(torch.bfloat16)``, which the copy cannot change) casts to float32,
    as its parameters are, and the bf16 / fp16 types recorded for values are dropped (shape
    inference finds them again) or, for outputs, made float32."""
    from onnx import TensorProto

    low = {getattr(TensorProto, k) for k in _LOW_ONNX}
    for node in graph.node:
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i in low:
                a.i = TensorProto.FLOAT
    keep = [v for v in graph.value_info if v.type.tensor_type.elem_type not in low]
    del graph.value_info[:]
    graph.value_info.extend(keep)
    for v in graph.output:
        if v.type.tensor_type.elem_type in low:
            v.type.tensor_type.elem_type = TensorProto.FLOAT


def check_float32_quantize(proto) -> None:
    """A ``ValueError`` naming the layer where a quantized Linear's ``QuantizeLinear`` or
    ``MatMul`` / ``Gemm`` reads a float other than float32 (a float64 model, a bf16 constant):
    onnx.checker passes such a graph and ONNX Runtime refuses to load it."""
    from onnx import TensorProto, shape_inference

    graph = shape_inference.infer_shapes(proto).graph
    types = {v.name: v.type.tensor_type.elem_type
             for v in (*graph.value_info, *graph.input, *graph.output)}
    types.update((t.name, t.data_type) for t in graph.initializer)
    other = {getattr(TensorProto, k) for k in (*_LOW_ONNX, "DOUBLE")}
    # the nodes _insert_qdq writes are named "<layer>/input_q" and "<layer>/weight_dq"
    weights = {n.output[0]: n.name.rsplit("/", 1)[0] for n in graph.node
               if n.op_type == "DequantizeLinear" and n.name.endswith("/weight_dq")}
    for node in graph.node:
        if node.op_type == "QuantizeLinear":
            layer = node.name.rsplit("/", 1)[0]
        elif len(node.input) > 1 and node.input[1] in weights:
            layer = weights[node.input[1]]
        else:
            continue
        bad = next((x for x in node.input if types.get(x) in other), None)
        if bad is not None:
            raise ValueError(
                f"onnx export: {layer}: {node.op_type} reads {bad!r} as "
                f"{TensorProto.DataType.Name(types[bad]).lower()}, and ONNX Runtime's quantized "
                f"kernels take float32 only; export a float32 model (model.float()), or where "
                f"the forward casts to a fixed dtype, cast to the layer's own "
                f"(x.to(layer.weight.dtype))")


def unshared_codes(path, proto=None):
    """What ONNX Runtime loads from ``path`` under :data:`.onnx.PRECISE_U8U8`: the path, or,
    where several ``DequantizeLinear`` nodes read one int8 initializer (a Linear called more
    than once: each call's DQ reads the codes the first wrote), the model's bytes with a
    copy of those codes and their zero point per further node. ORT 1.32's s8 -> u8 weight
    conversion, which that option turns on, adds a uint8 copy per node under one name and
    refuses the second ("Attempt to replace the existing tensor"); the file keeps one copy
    of each weight. ``proto``: the model at ``path`` read without its external data (read
    so here otherwise, and changed): a copy of external codes names the same bytes of the
    data file, and the session finds that file through
    :func:`.onnx_external.session_entries`."""
    import onnx
    from onnx import TensorProto

    if proto is None:
        proto = onnx.load(str(path), load_external_data=False)
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    taken = set(inits) | {o for n in graph.node for o in n.output}
    seen, copied = set(), False
    for node in graph.node:
        codes = inits.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if codes is None or codes.data_type != TensorProto.INT8:
            continue
        if codes.name in seen:  # the weight and its zero point (the scale stays shared)
            for i in (0, 2) if len(node.input) > 2 and node.input[2] in inits else (0,):
                copy = TensorProto()
                copy.CopyFrom(inits[node.input[i]])
                copy.name = f"{node.output[0]}/{node.input[i]}"
                while copy.name in taken:
                    copy.name += "_"
                taken.add(copy.name)
                graph.initializer.append(copy)
                node.input[i] = copy.name
            copied = True
        seen.add(codes.name)
    return proto.SerializeToString() if copied else str(path)
