"""ONNX QDQ export: the float model from torch's ONNX exporter, quantscope's qparams inserted
as QuantizeLinear / DequantizeLinear (:mod:`.onnx_graph`), shaped so ONNX Runtime
(:func:`session`) runs a quantized Linear on an integer kernel where it has one:
8-bit per-tensor / per-channel weights with an 8-bit static input as ``MatMulIntegerToFloat``,
weight-only Linears and 16-bit inputs as ``MatMulNBits`` (2- to 8-bit weights per tensor, per
channel or in groups of a power-of-two size >= 16). ORT has no kernel for 4-bit weights with an
8-bit input, nor fuses other weight-only ones (16-bit, other group sizes): those run as
a float ``MatMul`` on the dequantized weight (values equal; :func:`integer_kernel_counts`
reports such float fallbacks).

For each calibrated Linear (found through the module name the dynamo exporter records on
each node, ``pkg.torch.onnx.name_scopes``, and checked against the weight's values; a Linear
called more than once gets its Q/DQ nodes at every call):

- the weight is stored as integer codes (int4 / int8 / int16 or unsigned; codes from
  :func:`quantscope.qdq.quantize`, the one quantizer; raw bytes, int4 two per byte:
  :mod:`.onnx_tensors`) feeding ``DequantizeLinear`` with
  ``axis`` (per channel) or ``block_size`` (per group, opset 21);
- a static input gets its own ``QuantizeLinear -> DequantizeLinear`` pair on that Linear's
  input alone. Pairs are never shared between q / k / v: each MatMul then sees the
  ``DQ(int) x DQ(int)`` pattern ORT fuses into ``MatMulIntegerToFloat`` / ``QLinearMatMul``;
- a Linear with a quantized weight on a 2-D input (torch exports a ``Gemm``) is written as
  ``MatMul`` + ``Add``; one whose weight stays float stays a ``Gemm``.

Scales are written as quantscope computed them (compressed-tensors' ``absmax / 127.5`` stays
``/ 127.5``). ``QuantizeLinear`` computes ``saturate(round_half_even(x / scale) + zp)``,
adding the zero point to the rounded integer; :func:`~quantscope.qdq.fake_quantize` (as
compressed-tensors and vLLM) rounds ``x / scale + zp`` in float32. With ``zp = 0`` the two
are equal; with a zero point a code differs by one where ``x / scale`` is a tie (odd ``zp``)
or within float32 rounding of ``x / scale + zp`` of one (about 1e-5 of the values).
int8 codes are stored as
int8: on x86 CPUs with VNNI ORT's int8 kernel is exact and fast; without VNNI it saturates,
and :func:`session` sets the ORT option that runs the exact u8u8 kernel instead
(:data:`PRECISE_U8U8`; ``uint8=True`` stores uint8 codes, exact in any session).

What the graph cannot express is a ``ValueError`` naming the layer before anything is
written: float formats (fp8 / fp4 / MX / NVFP4), run-time (dynamic) activation scales,
per-token or per-channel activations, clipped activation ranges (``quant_min`` /
``quant_max`` narrower than the storage type: ``QuantizeLinear`` saturates to the type),
output and KV-cache roles, 3-D MoE experts, a module without a 2-D weight (a block), 8-bit
per-group weights beside an 8-bit static input (ORT has no kernel for the pair it fuses them
into), and a weight the forward also reads outside its Linear (after the trace).

A graph whose tensors exceed protobuf's 2 GiB (:data:`PROTOBUF_LIMIT`: a 1B Llama in fp32)
is written with its tensors in a data file beside the model, ``<name>.<digest>.data``
(``external_data``; :mod:`.onnx_external` says how the pair is written and replaced, and
what :func:`session` checks before it reads one).
"""

from __future__ import annotations

import importlib
import os

import torch

from .._checks import check_bool
from ..calibration.structure import kv_cache
from ..calibration.structure.conv1d import is_conv1d
from ..calibration.structure.expert_views import view_weight
from ..calibration.structure.placement import check_placement, is_block
from ..calibration.structure.tied import tied_weights
from .atomic import check_writable_target
from .onnx_external import check_external_target, graph_bytes, session_entries, write_model
from .onnx_graph import check_spec, insert_qdq, opset_error, outside_reads
from .onnx_graph import storage as _storage
from .onnx_locations import check_optimized, read_graph
from .onnx_tensors import float32_graph, float32_model, unshared_codes
from .onnx_trace import NoCache, exporter_errors, optimize, warn_specialized
from .registry import register

__all__ = ["DISABLED_OPTIMIZERS", "FLOAT_MATMULNBITS", "PRECISE_U8U8", "PROTOBUF_LIMIT",
           "export_onnx", "int8_dot_product", "integer_kernel_counts", "session",
           "session_options"]

#: ORT fusions :func:`session` turns off. MatMulScaleFusion folds a Mul by a constant into the
#: MatMul's float alpha, which reorders the float products (issue 15 saw MiniLM W8A8 results
#: move by up to 0.3 with it on); it costs no integer kernel, which applies the scales itself.
#: MatMulAddFusion makes a 2-D ``MatMul`` + ``Add`` (a Linear on a 2-D input; the export
#: writes no ``Gemm`` for a quantized Linear) a ``Gemm`` before the QDQ fusions run, and ORT
#: runs a QDQ ``Gemm`` with a float bias as a float ``Gemm`` / ``FusedGemm``; with it off such
#: a Linear runs as ``MatMulIntegerToFloat`` like one on a 3-D input. WeightBiasQuantization
#: quantizes the float weight (int8 per tensor) and bias of a ``Gemm`` between a DQ and a Q:
#: a Linear with a static input whose weight the recipe keeps float, on a 2-D input (the
#: export leaves it torch's ``Gemm``), ran 0.2-1 % of the output's max off fake-quant.
DISABLED_OPTIMIZERS = ("MatMulScaleFusion", "MatMulAddFusion", "WeightBiasQuantization")

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

#: the most bytes one protobuf message holds (2 GiB): onnx.checker, shape inference and
#: ``onnx.save`` serialize the whole model, and fail past it ("Failed to serialize proto").
#: A graph whose tensors take more is written with external data (``external_data=None``),
#: or refused with ``external_data=False`` (:func:`_check_size`).
PROTOBUF_LIMIT = 2 ** 31 - 1

#: the ops ORT runs a quantized MatMul as
INTEGER_KERNELS = ("MatMulIntegerToFloat", "QLinearMatMul", "DynamicQuantizeMatMul",
                   "MatMulInteger", "MatMulNBits", "QGemm")


def _onnx(module: str = "onnx"):
    """``module`` of the onnx extra (onnx, onnxruntime, onnxscript), or an ImportError naming
    the extra (not a bare ``No module named`` from deep in the export)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"ONNX export needs the onnx extra ({module} is missing): "
                          f"pip install 'quantscope[onnx]'") from e


def _export_float(model, example_inputs, opset: int, states=None):
    """The float model as an ``onnx.ModelProto`` (torch's dynamo exporter; every dimension
    of every input tensor dynamic; a transformers model without its KV cache); a calibrated
    layer of ``states`` whose weight is read outside the layer is a ``ValueError``."""
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        raise TypeError(f"onnx export: example_inputs must be a tensor, a tuple of tensors or "
                         f"a dict of keyword tensors, got {type(example_inputs).__name__}")
    warn_specialized(example_inputs)
    auto = torch.export.Dim.AUTO
    # a non-tensor entry (None for an optional argument, a flag) is a constant of the graph
    dynamic = torch.utils._pytree.tree_map(
        lambda v: {d: auto for d in range(v.dim())} if isinstance(v, torch.Tensor) else None,
        kwargs if kwargs else args)
    with exporter_errors(model), torch.no_grad(), NoCache(model):
        program = torch.onnx.export(model, args, kwargs=kwargs, dynamo=True,
                                    opset_version=opset, dynamic_shapes=dynamic,
                                    optimize=False, verbose=False)
    # before the optimizer folds such reads into constants; not an exporter error
    for layer, why in outside_reads(program.model.graph, model, states or {}).items():
        raise ValueError(f"onnx export: {layer}.weight {why}")
    with exporter_errors(model):
        optimize(program)
    return program.model_proto


def _check_call(calibration, model, example_inputs, opset, overwrite, uint8, external_data,
                options, **_) -> None:
    """The arguments' checks that need neither the disk nor a collective (every rank), all
    before the (slow) export."""
    if options:
        raise ValueError(f"onnx export: unknown options {sorted(options)}")
    for name, flag in (("overwrite", overwrite), ("uint8", uint8),  # bool("no") is True
                       *((("external_data", external_data),) if external_data is not None
                         else ())):
        check_bool("onnx export", name, flag)
    if example_inputs is None:
        raise ValueError("onnx export: example_inputs is required (what the model is called "
                         "with, e.g. a tokenizer's output dict)")
    if not isinstance(opset, int) or opset < 21:
        raise ValueError(f"onnx export: opset must be an integer >= 21 (int4 and block_size), "
                         f"got {opset!r}")
    for module in ("onnx", "onnxscript"):  # what the export and torch.onnx's exporter import
        _onnx(module)
    if opset > _native_opset():  # (insert_qdq tells it from the graph, after the trace)
        raise opset_error(opset)
    states = calibration.states
    check_placement(model, "onnx export")
    check_exportable(states, model)
    if external_data is False:
        _check_size(_estimated_bytes(model, states), "estimated from its parameters and buffers")


def _native_opset() -> int:
    """The highest opset torch.onnx writes with onnxscript's converter, which keeps each
    node's metadata (above it, onnx's C converter drops it); unbounded where onnxscript does
    not say."""
    try:
        from onnxscript.version_converter import _version_converter
    except ImportError:
        return 2 ** 31
    return getattr(_version_converter, "SUPPORTED_MAX_ONNX_OPSET", 2 ** 31)


def _estimated_bytes(model, states) -> int:
    """What ``model``'s tensors take in the graph: float ones as float32 (a bf16 model is
    exported from a float32 copy), a calibrated weight as its codes."""
    bits = {id(model.get_submodule(n).weight): _storage(r["weight"].spec, n, "weight")[1]
            for n, r in states.items() if "weight" in r}
    seen = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * bits[i] // 8 if i in bits else
               t.numel() * max(t.element_size(), 4 if t.is_floating_point() else 1)
               for i, t in seen.items())


def _check_size(nbytes: int, how: str) -> None:
    """Refuse (``external_data=False``) a graph over :data:`PROTOBUF_LIMIT` before onnx
    fails to serialize it."""
    if nbytes > PROTOBUF_LIMIT:
        raise ValueError(f"onnx export: the model's tensors take {nbytes} bytes "
                         f"({nbytes / 2 ** 30:.2f} GiB, {how}), over protobuf's 2 GiB limit "
                         f"on one ONNX file (PROTOBUF_LIMIT = {PROTOBUF_LIMIT} bytes), and "
                         f"external_data=False: leave external_data None (the default) or "
                         f"True to write the tensors in a data file beside the model")


@register("onnx", check=_check_call)
def export_onnx(calibration, model, path, *, example_inputs=None, opset: int = 21,
                overwrite: bool = False, uint8: bool = False,
                external_data: bool | None = None, **options):
    """Write ``model`` with ``calibration``'s qparams as an ONNX QDQ graph at ``path``.

    ``example_inputs``: what ``model`` is called with (a tensor, a tuple, or a dict of
    keyword tensors such as a tokenizer's output; ``None`` or a constant for a non-tensor
    argument); every dimension of every tensor is exported dynamic, but torch.export fixes a
    dimension of size 0 or 1 to that size (a warning names it: give sizes >= 2).
    ``uint8``: store int8 codes as uint8 with the zero point moved by 128 (the same values):
    exact in any ORT session on any x86 CPU, but never ORT's fast VNNI kernel (see
    :func:`.onnx_graph.unsigned`); the default int8 storage is exact in :func:`session`
    (:data:`PRECISE_U8U8` where the CPU lacks VNNI) and fast on VNNI CPUs.
    ``external_data``: the tensors (initializers of 1 KiB or more) in a data file beside the
    model, ``<file name>.<16 hex digits of its SHA-256>.data`` (:mod:`.onnx_external`): None
    (default) where the graph's tensors exceed :data:`PROTOBUF_LIMIT`, else one file as
    ``onnx.save`` writes it; True always; False never (a larger graph is refused). With
    ``overwrite`` the data file of the export replaced is deleted. Returns the path.
    Run it with :func:`session` (ONNX Runtime with the options that keep its results equal
    to quantscope's fake-quant).
    """
    onnx = _onnx()  # (its arguments were checked on every rank: _check_call)
    # the model's folder is an input; overwrite replaces only an ONNX file quantscope wrote
    inputs = _model_folders(calibration, model)
    path = check_writable_target(path, overwrite=overwrite, kind="file", inputs=inputs)
    if external_data:  # (None: known after the trace, then checked by write_model)
        check_external_target(path)
    states = calibration.states
    given, (model, example_inputs) = model, float32_model(model, example_inputs)
    proto = _export_float(model, example_inputs, opset, states)
    if model is not given:  # a bf16 / fp16 model made float32: its forward's casts too
        float32_graph(proto.graph)
    insert_qdq(onnx, proto.graph, model, states, uint8, opset)
    nbytes = graph_bytes(proto)  # (the whole proto's ByteSize() fails past the limit)
    external = nbytes > PROTOBUF_LIMIT if external_data is None else external_data
    if not external:
        _check_size(nbytes, "in the graph")
    mark = proto.metadata_props.add()  # what lets overwrite=True replace this file later
    mark.key, mark.value = "quantscope", "onnx export"
    write_model(onnx, proto, path, external=external, overwrite=overwrite, inputs=inputs)
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
    """Every calibrated layer is a module of ``model`` with a 2-D weight it multiplies by (a
    Linear), before anything is traced: not a container (an input role on a block), another
    layer (a convolution, an LSTM, an Embedding, whose 2-D weight is indexed, not
    multiplied), nor another model's name; transformers' Conv1D (GPT-2's) exports as a
    MatMul by its ``[in, out]`` weight as is, with its per-channel scales on axis 1, a
    layout this Linear writer has no form for. A weight of another shape than calibrated is
    another model's."""
    modules = dict(model.named_modules())
    for n in states:
        module = modules.get(n)
        if module is None and view_weight(model, n) is not None:
            raise ValueError(f"onnx export: layer {n!r} is an expert of a 3-D MoE experts "
                             f"module (transformers 5's experts parameters, no Linear per "
                             f"expert in the graph): the ONNX export does not write MoE "
                             f"experts; export compressed-tensors, which writes every expert, "
                             f"or keep the experts in float (ignore 're:.*experts' in the "
                             f"recipe; torch.onnx traces float experts run as "
                             f"model.set_experts_implementation('batched_mm'))")
        if module is None:
            raise ValueError(f"onnx export: layer {n!r} of the calibration is not a module of "
                             f"this {type(model).__name__} (a calibration of another model?)")
        weight, kind = getattr(module, "weight", None), type(module).__name__
        if is_block(module):
            raise ValueError(f"onnx export: layer {n!r} is a {kind} without a 2-D weight: "
                             f"only Linear layers export (quantize the Linears inside a "
                             f"block, not the block)")
        if (not isinstance(weight, torch.Tensor) or weight.dim() != 2
                or isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag))):
            raise ValueError(f"onnx export: layer {n!r} ({kind}): only Linear layers export "
                             f"to ONNX; ignore {n!r} in the recipe (ignore=[{n!r}]) to leave "
                             f"it in float")
        if is_conv1d(module):
            raise ValueError(f"onnx export: layer {n!r} is a transformers Conv1D (weight "
                             f"[in, out]), which this exporter does not write; leave it in "
                             f"float")
        if "weight" in states[n]:
            states[n]["weight"].check_weight("onnx export", n, weight)


def check_exportable(states, model=None) -> None:
    """Refuse what ONNX cannot express: roles other than weight and input, layers other than
    ``model``'s untied Linears (given one), formats without an ONNX storage type, run-time
    activation scales, layouts and ranges without a Q/DQ form (:func:`.onnx_graph.check_spec`)."""
    _check_roles(states)  # a KV cache is told as such, not as a block without a weight
    if model is not None:  # what a layer is before what its specs ask
        _check_linear(model, states)
        _check_untied(model, states)
    for layer, roles in states.items():
        for role, state in roles.items():
            if role == "input" and state.dynamic is not False:
                _storage(state.spec, layer, role)  # a float format is told as such first
                raise ValueError(f"onnx export: {layer}.input is quantized at run time "
                                 f"(dynamic={state.dynamic!r}); this exporter writes static "
                                 f"activation scales only")
            check_spec(state.spec, layer, role)  # the rules the graph is written by
        _check_ort_runs(layer, roles)


def _check_roles(states) -> None:
    """Only weight and input roles have a Q/DQ form here. A KV cache has none: the graph
    holds no cache (a causal LM exports its logits alone), while apply() quantizes the keys
    and values of every forward, so a graph without them would not run as apply() does."""
    for layer, roles in states.items():
        for role in roles:
            if role in kv_cache.ROLES:
                raise ValueError(f"onnx export: {layer} {role}: the calibration quantizes the "
                                 f"KV cache (a recipe's kv_cache, --kv-cache), and the ONNX "
                                 f"export has no KV cache: calibrate without kv_cache to "
                                 f"export the Linears to ONNX, or export compressed-tensors "
                                 f"(vLLM's fp8 KV cache)")
            if role not in ("weight", "input"):
                raise ValueError(f"onnx export: {layer}.{role}: only weight and input roles "
                                 f"export (got {role!r})")


def _check_ort_runs(layer, roles) -> None:
    """ORT fuses 8-bit per-group weights and an 8-bit static input into
    ``MatMulIntegerToFloat``, which has no per-group scales: the session fails at run time
    (onnxruntime 1.32; 4-bit groups or a 16-bit input it runs)."""
    from ..layout import Group

    weight, inp = roles.get("weight"), roles.get("input")
    if weight is None or inp is None or not isinstance(weight.spec.layout, Group):
        return
    if _storage(weight.spec, layer, "weight")[1] == 8 == _storage(inp.spec, layer, "input")[1]:
        raise ValueError(f"onnx export: {layer}: per-group weights ({weight.spec}) and a "
                         f"static input ({inp.spec}) are both stored in 8 bits: ONNX Runtime "
                         f"fuses the pair into MatMulIntegerToFloat, which has no per-group "
                         f"scales, and fails at run time; use per-channel weights, weights of "
                         f"<= 4 bits in groups or a 16-bit input")


def session_options(threads: int | None = None, optimized_model_path: str | None = None):
    """``onnxruntime.SessionOptions`` for an exported model: all graph optimizations
    (the integer kernels come from them), :data:`FLOAT_MATMULNBITS`, :data:`PRECISE_U8U8` on x86
    CPUs without VNNI (:func:`int8_dot_product`), ``threads`` intra-op threads if given, and the
    optimized graph saved to ``optimized_model_path`` if given. Pass :data:`DISABLED_OPTIMIZERS` as
    ``disabled_optimizers`` too (:func:`session` does)."""
    ort = _onnx("onnxruntime")
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
    fake-quant to float rounding (:data:`DISABLED_OPTIMIZERS` off). A model with external
    data is read only from files inside its folder (:func:`.onnx_locations.read_graph`); its
    optimized model, if saved, keeps its tensors in ``<optimized_model_path>.data``. What
    ORT would write there may replace neither a file the session reads nor one quantscope
    did not write (:func:`.onnx_locations.check_optimized`: a ``ValueError`` naming it)."""
    ort = _onnx("onnxruntime")
    graph, folder = read_graph(path)  # each external tensor's location checked first
    check_optimized(path, graph, folder, optimized_model_path)
    model = str(path) if int8_dot_product() else unshared_codes(path, graph)
    options = session_options(threads, optimized_model_path)
    session_entries(options, folder, model, optimized_model_path)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"],
                                disabled_optimizers=list(DISABLED_OPTIMIZERS))


def integer_kernel_counts(optimized_model_path) -> dict[str, int]:
    """Op counts of an optimized graph: every op that multiplies matrices, each integer
    kernel (:data:`INTEGER_KERNELS`) and each float one left (``MatMul``, ``Gemm``,
    ``FusedMatMul``, ``FusedGemm``, ...), so that no float fallback goes uncounted. The
    graph alone is read: no external data file is opened."""
    onnx = _onnx()
    proto = onnx.load(str(optimized_model_path), load_external_data=False)
    counts: dict[str, int] = {}
    for n in proto.graph.node:
        if "MatMul" in n.op_type or "Gemm" in n.op_type:
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts
