"""ONNX QDQ export: the float model from torch's ONNX exporter, quantscope's qparams inserted
as QuantizeLinear / DequantizeLinear, shaped so ONNX Runtime runs every Linear as an integer
kernel.

For each calibrated Linear (found through the module name the dynamo exporter records on
each node, ``pkg.torch.onnx.name_scopes``, and checked against the weight's values):

- the weight is stored as integer codes (int4 / int8 / int16 or unsigned; codes from
  :func:`quantscope.qdq.quantize`, the one quantizer; raw bytes, int4 two per byte:
  :mod:`.onnx_tensors`) feeding ``DequantizeLinear`` with
  ``axis`` (per channel) or ``block_size`` (per group, opset 21);
- a static input gets its own ``QuantizeLinear -> DequantizeLinear`` pair on that Linear's
  input alone. Pairs are never shared between q / k / v: each MatMul then sees the
  ``DQ(int) x DQ(int)`` pattern ORT fuses into ``MatMulIntegerToFloat`` / ``QLinearMatMul``.

Scales are written as quantscope computed them (compressed-tensors' ``absmax / 127.5`` stays
``/ 127.5``); ``QuantizeLinear`` computes ``saturate(round_half_even(x / scale) + zp)``, the
same arithmetic as :func:`~quantscope.qdq.fake_quantize`. int8 codes are stored as
int8: on x86 CPUs with VNNI ORT's int8 kernel is exact and fast; without VNNI it saturates,
and :func:`session` sets the ORT option that runs the exact u8u8 kernel instead
(:data:`PRECISE_U8U8`; ``uint8=True`` stores uint8 codes, exact in any session).

What the graph cannot express is a ``ValueError`` naming the layer before anything is
written: float formats (fp8 / fp4 / MX / NVFP4), run-time (dynamic) activation scales,
per-token or per-channel activations, clipped activation ranges (``quant_min`` /
``quant_max`` narrower than the storage type: ``QuantizeLinear`` saturates to the type),
output roles, and 8-bit per-group weights beside an 8-bit static input (ORT has no kernel
for the pair it fuses them into).
"""

from __future__ import annotations

import ast
import os

import numpy as np
import torch

from ..calibration.structure.conv1d import is_conv1d
from ..calibration.structure.placement import check_placement
from ..calibration.structure.tied import tied_weights
from .atomic import atomic_file, check_writable_target
from .onnx_tensors import check_float32_quantize, code_tensor, float32_graph, float32_model
from .registry import register

__all__ = ["DISABLED_OPTIMIZERS", "FLOAT_MATMULNBITS", "PRECISE_U8U8", "export_onnx", "int8_dot_product",
           "integer_kernel_counts", "session", "session_options"]

#: ORT fusions that change results: MatMulScaleFusion folds a Mul by a constant into the
#: MatMul's float alpha, which reorders the float products (issue 15 saw MiniLM W8A8 results
#: move by up to 0.3 with it on). On the tiny test BERT the default
#: session was exact too; it stays off because the integer kernels apply the scales
#: themselves, so turning it off costs no integer kernel.
DISABLED_OPTIMIZERS = ("MatMulScaleFusion",)

#: ORT session config entry: on x86 without VNNI, ORT's kernel for int8 weights
#: (``vpmaddubsw``) saturates int16 sums of product pairs (MiniLM W8A8 0.69 of the output's
#: max off fake-quant, a tiny BERT 0.0077); with this entry ORT converts int8 weights to uint8
#: at load and runs its exact u8u8 kernel. On VNNI CPUs (``vpdpbusd`` sums in int32) the int8
#: kernel is exact and 1.8x faster than u8u8 (MiniLM, Xeon with AVX512-VNNI), and the entry
#: would switch it off, so :func:`session_options` sets it only where the CPU lacks VNNI.
PRECISE_U8U8 = ("session.x64quantprecision", "1")

#: ORT session config entry: ORT fuses a weight-only ``DequantizeLinear -> MatMul`` (W8A16,
#: W4A16) into ``MatMulNBits`` with accuracy level 4 by default, which quantizes the float
#: activations to int8 at run time (issue 37: 0.87 % / 1.2 % of the output's max off
#: fake-quant); level 1 keeps the fused kernel and its packed weights but multiplies in float32,
#: equal to fake-quant to float rounding.
FLOAT_MATMULNBITS = ("session.qdq_matmulnbits_accuracy_level", "1")

#: the ops ORT runs a quantized MatMul as
INTEGER_KERNELS = ("MatMulIntegerToFloat", "QLinearMatMul", "DynamicQuantizeMatMul",
                   "MatMulInteger", "MatMulNBits")


def _onnx():
    try:
        import onnx
    except ImportError as e:  # pragma: no cover - the onnx extra
        raise ImportError("ONNX export needs the onnx extra: pip install 'quantscope[onnx]'") \
            from e
    return onnx


def _storage(spec, layer: str, role: str):
    """The ONNX integer type that holds every code of ``spec``."""
    onnx = _onnx()
    TP = onnx.TensorProto
    if spec.is_float:
        raise ValueError(f"onnx export: {layer}.{role} uses {spec.format}; this exporter writes "
                         f"integer formats only (float formats: fp8 / fp4 / MX / NVFP4 are not "
                         f"supported)")
    lo, hi = int(spec.qmin), int(spec.qmax)
    for bits, signed_t, unsigned_t in ((4, TP.INT4, TP.UINT4), (8, TP.INT8, TP.UINT8),
                                      (16, TP.INT16, TP.UINT16)):
        if lo >= -(2 ** (bits - 1)) and hi <= 2 ** (bits - 1) - 1:
            return signed_t, bits, True
        if lo >= 0 and hi <= 2 ** bits - 1:
            return unsigned_t, bits, False
    raise ValueError(f"onnx export: {layer}.{role}: codes [{lo}, {hi}] fit no ONNX integer type")


def _calibrated_scope(node, states) -> str | None:
    """The innermost module the exporter recorded ``node`` under that ``states`` calibrates
    (the scopes run from the root module down to the op's own name, e.g. ``linear_1``)."""
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            return next((s for s in reversed(ast.literal_eval(p.value)) if s in states), None)
    return None


def _weight_view(init_array: np.ndarray, weight: np.ndarray, node) -> bool | None:
    """Whether the node's initializer is ``weight`` transposed (True), as is (False), or
    another tensor (None)."""
    trans_b = any(a.name == "transB" and a.i for a in node.attribute)
    if node.op_type == "MatMul" or (node.op_type == "Gemm" and not trans_b):
        return True if init_array.shape == weight.T.shape and np.array_equal(
            init_array, weight.T) else None
    return False if init_array.shape == weight.shape and np.array_equal(
        init_array, weight) else None


def _unsigned(dtype, codes: torch.Tensor | None, zp: torch.Tensor, shift: bool):
    """int8 codes and zero point moved by +128 to uint8 when ``shift``: the same values
    (``(q + 128) - (zp + 128) == q - zp``), the same saturation, but ONNX Runtime then runs
    its u8u8 kernel in any session: exact on every x86 CPU, never the int8 dot-product
    (VNNI) kernel. See :data:`PRECISE_U8U8` for the default int8 storage."""
    TP = _onnx().TensorProto
    if shift and dtype == TP.INT8:
        return TP.UINT8, None if codes is None else codes + 128, zp + 128
    return dtype, codes, zp


def _weight_dq(layer, state, weight: torch.Tensor, transposed: bool, prefix: str,
               shift: bool):
    """Initializers (codes, scale, zero point) and the DequantizeLinear node of one weight."""
    onnx = _onnx()
    from onnx import helper, numpy_helper

    from ..layout import Channel, Group, Tensor
    from ..qdq import quantize

    spec = state.spec
    if state.dynamic is not False or state.qparams is None:
        raise ValueError(f"onnx export: {layer}.weight has no static qparams "
                         f"(dynamic={state.dynamic!r})")
    dtype, _, _ = _storage(spec, layer, "weight")
    qp = state.qparams
    codes = quantize(weight.detach().float(), qp, spec).to(torch.int32)  # [out, in]
    scale = qp.effective_scale.detach().float()
    zp = qp.zero_point.detach().to(torch.int32)
    layout = spec.layout
    out_f, in_f = weight.shape
    attrs = {}
    if isinstance(layout, Tensor):
        scale, zp = scale.reshape(()), zp.reshape(())
    elif isinstance(layout, Channel) and layout.axis % 2 == 0:
        scale, zp = scale.reshape(out_f), zp.reshape(out_f)
        attrs["axis"] = 1 if transposed else 0
    elif isinstance(layout, Group) and layout.axis % 2 == 1 and layout.g_idx is None:
        scale = scale.reshape(out_f, in_f // layout.size)
        zp = zp.reshape(out_f, in_f // layout.size)
        if transposed:
            scale, zp = scale.T, zp.T
        attrs["axis"] = 0 if transposed else 1
        attrs["block_size"] = layout.size
    else:
        raise ValueError(f"onnx export: {layer}.weight: layout {layout} has no DequantizeLinear "
                         f"form (expected per-tensor, per-output-channel or per-group along "
                         f"the input features without g_idx)")
    if transposed:
        codes = codes.T
    dtype, codes, zp = _unsigned(dtype, codes, zp, shift)
    names = [f"{prefix}.weight_q", f"{prefix}.weight_scale", f"{prefix}.weight_zero_point"]
    inits = [code_tensor(names[0], dtype, codes),  # raw bytes: 1 per int8 code, 1/2 per int4
             numpy_helper.from_array(np.ascontiguousarray(scale.numpy()), names[1]),
             code_tensor(names[2], dtype, zp)]
    out = f"{prefix}.weight_dq"
    node = helper.make_node("DequantizeLinear", names, [out], name=f"{prefix}/weight_dq",
                            **attrs)
    del onnx
    return inits, node, out


def _input_qdq(layer, state, source: str, prefix: str, shift: bool):
    """Initializers and the QuantizeLinear -> DequantizeLinear pair of one static input."""
    from onnx import helper, numpy_helper

    from ..layout import Tensor

    spec = state.spec
    if state.dynamic is not False or state.qparams is None:
        raise ValueError(f"onnx export: {layer}.input is quantized at run time "
                         f"(dynamic={state.dynamic!r}); this exporter writes static activation "
                         f"scales only")
    if not isinstance(spec.layout, Tensor):  # a spec the graph cannot express, not a bad type
        raise ValueError(  # noqa: TRY004
            f"onnx export: {layer}.input: layout {spec.layout} is not per-tensor; "
            f"static activations export per tensor only")
    dtype, bits, signed = _storage(spec, layer, "input")
    full = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2 ** bits - 1)
    if bits == 4 or (int(spec.qmin), int(spec.qmax)) != full:
        raise ValueError(f"onnx export: {layer}.input: codes [{int(spec.qmin)}, "
                         f"{int(spec.qmax)}] are not a full int8 / uint8 / int16 range, which "
                         f"QuantizeLinear saturates to")
    qp = state.qparams
    dtype, _, zp = _unsigned(dtype, None, qp.zero_point.reshape(()).to(torch.int32), shift)
    names = [f"{prefix}.input_scale", f"{prefix}.input_zero_point"]
    inits = [numpy_helper.from_array(
                 qp.effective_scale.detach().float().reshape(()).numpy().copy(), names[0]),
             code_tensor(names[1], dtype, zp)]
    q = helper.make_node("QuantizeLinear", [source, *names], [f"{prefix}.input_q"],
                         name=f"{prefix}/input_q")
    dq = helper.make_node("DequantizeLinear", [f"{prefix}.input_q", *names],
                          [f"{prefix}.input_dq"], name=f"{prefix}/input_dq")
    return inits, [q, dq], f"{prefix}.input_dq"


class _NoCache:
    """A transformers model's ``config.use_cache`` off while exporting: a causal LM then returns
    its logits alone, not a ``DynamicCache`` torch.export cannot trace (issue 37)."""

    def __init__(self, model):
        self.config = getattr(model, "config", None)
        self.saved = getattr(self.config, "use_cache", None)

    def __enter__(self):
        if self.saved is not None:
            self.config.use_cache = False

    def __exit__(self, *exc):
        if self.saved is not None:
            self.config.use_cache = self.saved


def _export_float(model, example_inputs, opset: int):
    """The float model as an ``onnx.ModelProto`` (torch's dynamo exporter; every input
    dimension dynamic; a transformers model without its KV cache)."""
    if isinstance(example_inputs, dict):
        args, kwargs, tensors = (), dict(example_inputs), dict(example_inputs)
    elif isinstance(example_inputs, torch.Tensor):
        args, kwargs, tensors = (example_inputs,), {}, None
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs, tensors = tuple(example_inputs), {}, None
    else:
        raise TypeError(f"onnx export: example_inputs must be a tensor, a tuple of tensors or "
                         f"a dict of keyword tensors, got {type(example_inputs).__name__}")
    auto = torch.export.Dim.AUTO
    if tensors is not None:
        dynamic = {k: {d: auto for d in range(v.dim())} for k, v in tensors.items()}
    else:
        dynamic = tuple({d: auto for d in range(a.dim())} for a in args)
    try:
        with torch.no_grad(), _NoCache(model):
            program = torch.onnx.export(model, args, kwargs=kwargs, dynamo=True,
                                        opset_version=opset, dynamic_shapes=dynamic,
                                        optimize=True, verbose=False)
    except Exception as e:  # torch's exporter raises many types, each pages long
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ValueError(
            f"onnx export: torch.onnx could not export {type(model).__name__} "
            f"({type(e).__name__}: {first[:200]}); supported: models torch.export can trace "
            f"whose forward returns tensors (a transformers model exports without its KV "
            f"cache: a causal LM's output is its logits)") from e
    return program.model_proto


@register("onnx")
def export_onnx(calibration, model, path, *, example_inputs=None, opset: int = 21,
                overwrite: bool = False, uint8: bool = False, **options):
    """Write ``model`` with ``calibration``'s qparams as an ONNX QDQ graph at ``path``.

    ``example_inputs``: what ``model`` is called with (a tensor, a tuple, or a dict of
    keyword tensors such as a tokenizer's output); every dimension is exported dynamic.
    ``uint8``: store int8 codes as uint8 with the zero point moved by 128 (the same values):
    exact in any ORT session on any x86 CPU, but never ORT's fast VNNI kernel (see
    :func:`_unsigned`); the default int8 storage is exact in :func:`session`
    (:data:`PRECISE_U8U8` where the CPU lacks VNNI) and fast on VNNI CPUs. Returns the path.
    Run it with :func:`session` (ONNX Runtime with the options that keep its results equal
    to quantscope's fake-quant).
    """
    onnx = _onnx()
    if options:
        raise ValueError(f"onnx export: unknown options {sorted(options)}")
    if example_inputs is None:
        raise ValueError("onnx export: example_inputs is required (what the model is called "
                         "with, e.g. a tokenizer's output dict)")
    if not isinstance(opset, int) or opset < 21:
        raise ValueError(f"onnx export: opset must be an integer >= 21 (int4 and block_size), "
                         f"got {opset!r}")
    # the model's folder is an input; overwrite replaces only an ONNX file quantscope wrote
    inputs = _model_folders(calibration, model)
    path = check_writable_target(path, overwrite=overwrite, kind="file", inputs=inputs)
    states = calibration.states if hasattr(calibration, "states") else calibration
    check_placement(model, "onnx export")
    _check_exportable(states)  # before the (slow) export
    _check_untied(model, states)
    _check_linear(model, states)
    given, (model, example_inputs) = model, float32_model(model, example_inputs)
    proto = _export_float(model, example_inputs, opset)
    if model is not given:  # a bf16 / fp16 model made float32: its forward's casts too
        float32_graph(proto.graph)
    _insert_qdq(onnx, proto.graph, model, states, uint8)
    _drop_unused_initializers(proto.graph)
    mark = proto.metadata_props.add()  # what lets overwrite=True replace this file later
    mark.key, mark.value = "quantscope", "onnx export"
    onnx.checker.check_model(proto)
    check_float32_quantize(proto)  # what the checker passes and ORT refuses (issue 37)
    with atomic_file(path, overwrite=overwrite, kind="file", inputs=inputs) as tmp:
        onnx.save(proto, tmp)
    return path


def _model_folders(calibration, model) -> list[str]:
    """The folders ``model`` was loaded from (its config's name, the calibration's record)."""
    info = getattr(calibration, "info", None) or {}
    paths = (info.get("model"), getattr(getattr(model, "config", None), "_name_or_path", None))
    return [os.fspath(p) for p in paths if isinstance(p, (str, os.PathLike)) and os.path.isdir(p)]


def _check_untied(model, states) -> None:
    """The graph dequantizes a weight for its MatMul alone; a module sharing it (a tied
    lm_head's embedding) would keep the float tensor, unlike ``apply()``: refuse it."""
    layers = [layer for layer, roles in states.items() if "weight" in roles]
    for layer, others in tied_weights(model, layers).items():
        raise ValueError(f"onnx export: {layer}.weight is tied with {others}: the graph would "
                         f"quantize it for {layer} alone; leave it in float (ignore {layer} in "
                         f"the recipe) or untie the weights")


def _check_linear(model, states) -> None:
    """transformers' Conv1D (GPT-2's) exports as a MatMul by its ``[in, out]`` weight as is,
    with its per-channel scales on axis 1, a layout this Linear writer has no form for."""
    modules = dict(model.named_modules())
    found = [n for n in states if is_conv1d(modules.get(n))]
    if found:
        raise ValueError(f"onnx export: layer {found[0]!r} is a transformers Conv1D (weight "
                         f"[in, out]), which this exporter does not write; leave it in float")


def _check_exportable(states) -> None:
    """Refuse what ONNX cannot express: roles other than weight and input, formats without
    an ONNX storage type, activation scales computed at run time."""
    for layer, roles in states.items():
        for role, state in roles.items():
            if role not in ("weight", "input"):
                raise ValueError(f"onnx export: {layer}.{role}: only weight and input roles "
                                 f"export (got {role!r})")
            _storage(state.spec, layer, role)
            if role == "input" and state.dynamic is not False:
                raise ValueError(f"onnx export: {layer}.input is quantized at run time "
                                 f"(dynamic={state.dynamic!r}); this exporter writes static "
                                 f"activation scales only")
        _check_ort_runs(layer, roles)


def _check_ort_runs(layer, roles) -> None:
    """ORT fuses 8-bit per-group weights and an 8-bit static input into
    ``MatMulIntegerToFloat``, which has no per-group scales: the session fails at run time
    (onnxruntime 1.32; 4-bit groups or a 16-bit input it runs)."""
    from ..layout import Group

    weight, inp = roles.get("weight"), roles.get("input")
    if weight is None or inp is None or not isinstance(weight.spec.layout, Group):
        return
    if _storage(weight.spec, layer, "weight")[1] == 8 == _storage(inp.spec, layer, "input")[1]:
        raise ValueError(f"onnx export: {layer}: 8-bit per-group weights with an 8-bit "
                         f"static input: ONNX Runtime fuses the pair into "
                         f"MatMulIntegerToFloat, which has no per-group scales, and fails at "
                         f"run time; use per-channel weights, 4-bit groups or a 16-bit input")


def _insert_qdq(onnx, graph, model, states, uint8: bool) -> None:
    """Each calibrated layer's MatMul / Gemm gets its input QDQ and weight DQ nodes; every
    calibrated layer must map to exactly one such node."""
    inits = {t.name: t for t in graph.initializer}
    found: set[str] = set()
    new_nodes, new_inits = [], []
    for node in graph.node:
        layer = _calibrated_scope(node, states) if node.op_type in ("MatMul", "Gemm") else None
        roles = states.get(layer) if layer is not None else None
        if roles is None or len(node.input) < 2 or node.input[1] not in inits:
            new_nodes.append(node)
            continue
        if layer in found:
            raise ValueError(f"onnx export: {layer} maps to more than one MatMul / Gemm node")
        weight = model.get_submodule(layer).weight.detach().float()
        transposed = _weight_view(onnx.numpy_helper.to_array(inits[node.input[1]]),
                                  weight.numpy(), node)
        if transposed is None:
            raise ValueError(f"onnx export: {layer}: the exported node {node.name!r} does not "
                             f"multiply by {layer}.weight")
        found.add(layer)
        prefix = layer
        if "input" in roles:
            i, qdq, out = _input_qdq(layer, roles["input"], node.input[0], prefix, uint8)
            new_inits += i
            new_nodes += qdq
            node.input[0] = out
        if "weight" in roles:
            i, dq, out = _weight_dq(layer, roles["weight"], weight, transposed, prefix,
                                      uint8)
            new_inits += i
            new_nodes.append(dq)
            node.input[1] = out
        new_nodes.append(node)
    missing = sorted(set(states) - found)
    if missing:
        raise ValueError(f"onnx export: no MatMul / Gemm node found for {missing[:5]} "
                         f"(calibrated layers must be Linear modules the exporter keeps)")
    del graph.node[:]
    graph.node.extend(new_nodes)
    graph.initializer.extend(new_inits)


def _drop_unused_initializers(graph) -> None:
    """The float weights the DQ nodes replaced (an initializer no node reads, and no output)."""
    used = {i for n in graph.node for i in n.input}
    keep = [t for t in graph.initializer if t.name in used or t.name in
            {o.name for o in graph.output}]
    del graph.initializer[:]
    graph.initializer.extend(keep)


def session_options(threads: int | None = None, optimized_model_path: str | None = None):
    """``onnxruntime.SessionOptions`` for an exported model: all graph optimizations
    (the integer kernels come from them), :data:`FLOAT_MATMULNBITS`, :data:`PRECISE_U8U8` on x86 CPUs without VNNI
    (:func:`int8_dot_product`), ``threads`` intra-op threads if given, and the optimized
    graph saved to ``optimized_model_path`` if given. Pass :data:`DISABLED_OPTIMIZERS` as
    ``disabled_optimizers`` too (:func:`session` does)."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry(*FLOAT_MATMULNBITS)
    if not int8_dot_product():
        so.add_session_config_entry(*PRECISE_U8U8)
    if threads is not None:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    if optimized_model_path is not None:
        so.optimized_model_filepath = str(optimized_model_path)
    return so


def int8_dot_product(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether ORT's int8-weight kernels are exact here: not an x86 CPU, or one with VNNI
    (AVX512-VNNI, AVX-VNNI). An x86 CPU whose flags cannot be read counts as without VNNI
    (exact, possibly slower)."""
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return True
    try:
        with open(cpuinfo) as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")),
                         [])
    except OSError:
        return False
    return any(f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


def session(path, threads: int | None = None, optimized_model_path: str | None = None):
    """An ``onnxruntime.InferenceSession`` on the CPU whose results equal quantscope's
    fake-quant to float rounding (:data:`DISABLED_OPTIMIZERS` off)."""
    import onnxruntime as ort
    return ort.InferenceSession(str(path), session_options(threads, optimized_model_path),
                                providers=["CPUExecutionProvider"],
                                disabled_optimizers=list(DISABLED_OPTIMIZERS))


def integer_kernel_counts(optimized_model_path) -> dict[str, int]:
    """Op counts of an optimized graph: each integer MatMul kernel and the plain float
    ``MatMul`` / ``Gemm`` left."""
    onnx = _onnx()
    proto = onnx.load(str(optimized_model_path), load_external_data=False)
    counts: dict[str, int] = {}
    for n in proto.graph.node:
        if n.op_type in (*INTEGER_KERNELS, "MatMul", "Gemm", "FusedMatMul"):
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts
