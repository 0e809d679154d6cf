"""The QDQ rewrite of the ONNX export: each calibrated Linear's ``MatMul`` / ``Gemm`` in the
float graph gets its weight ``DequantizeLinear`` and its input ``QuantizeLinear ->
DequantizeLinear`` (see :mod:`.onnx` for the forms and what ORT runs them as).

A Linear's nodes are found through the module name the dynamo exporter records on each node
(``pkg.torch.onnx.name_scopes``) and checked against the weight's values. A Linear called
more than once has one ``MatMul`` / ``Gemm`` per call: each gets its own input Q/DQ pair and
its own weight ``DequantizeLinear`` with the layer's qparams, as ``apply()`` quantizes
every call; beside an 8-bit input all read the layer's one set of weight codes, else each
call's reads a copy of its own (ORT fuses no shared one into ``MatMulNBits``). A ``Gemm``
(a Linear on a 2-D input) is written as ``MatMul`` (+ ``Add`` for the bias): ONNX Runtime
fuses the QDQ ``MatMul`` into its integer kernels and leaves a QDQ ``Gemm`` with a float
bias in float.
"""

from __future__ import annotations

import ast

import numpy as np
import torch

from .onnx_tensors import code_tensor

_SCOPES = "pkg.torch.onnx.name_scopes"


def storage(spec, layer: str, role: str):
    """The ONNX integer type that holds every code of ``spec``: (type, bits, signed)."""
    from onnx import TensorProto as TP

    if spec.is_float:
        raise ValueError(f"onnx export: {layer}.{role} is {spec}; this exporter writes integer "
                         f"formats only (float formats: fp8 / fp6 / fp4 / MX / NVFP4 are not "
                         f"supported)")
    lo, hi = int(spec.qmin), int(spec.qmax)
    for bits, signed_t, unsigned_t in ((4, TP.INT4, TP.UINT4), (8, TP.INT8, TP.UINT8),
                                      (16, TP.INT16, TP.UINT16)):
        if lo >= -(2 ** (bits - 1)) and hi <= 2 ** (bits - 1) - 1:
            return signed_t, bits, True
        if lo >= 0 and hi <= 2 ** bits - 1:
            return unsigned_t, bits, False
    raise ValueError(f"onnx export: {layer}.{role}: codes [{lo}, {hi}] fit no ONNX integer type")


def check_spec(spec, layer: str, role: str):
    """The ONNX storage type of ``layer.role``'s codes (see :func:`storage`), or the
    ``ValueError`` :func:`_weight_dq` / :func:`_input_qdq` would raise for its spec: the same
    rules, run by the export's up-front check before the (slow) trace."""
    if role == "weight":
        _weight_form(spec.layout, layer)
        return storage(spec, layer, role)
    return _input_storage(spec, layer)


def _weight_form(layout, layer: str) -> str:
    """Which ``DequantizeLinear`` form holds a weight's ``layout``: ``tensor``, ``channel``
    (``axis``) or ``group`` (``block_size``, opset 21)."""
    from ..layout import Channel, Group, Tensor

    if isinstance(layout, Tensor):
        return "tensor"
    if isinstance(layout, Channel) and layout.axis % 2 == 0:
        return "channel"
    if isinstance(layout, Group) and layout.axis % 2 == 1 and layout.order is None:
        return "group"
    raise ValueError(f"onnx export: {layer}.weight: layout {layout} has no DequantizeLinear "
                     f"form (expected per-tensor, per-output-channel or per-group along "
                     f"the input features in column order: no g_idx that moves columns)")


def _input_storage(spec, layer: str):
    """The storage type of a static input's codes: per tensor, a full int8 / uint8 / int16
    range (``QuantizeLinear`` saturates to its type: a narrower range has no form)."""
    from ..layout import Tensor

    if not isinstance(spec.layout, Tensor):  # a spec the graph cannot express, not a bad type
        raise ValueError(  # noqa: TRY004
            f"onnx export: {layer}.input: layout {spec.layout} is not per-tensor; "
            f"static activations export per tensor only")
    dtype, bits, signed = storage(spec, layer, "input")
    full = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2 ** bits - 1)
    if bits == 4 or (int(spec.qmin), int(spec.qmax)) != full:
        raise ValueError(f"onnx export: {layer}.input: codes [{int(spec.qmin)}, "
                         f"{int(spec.qmax)}] are not a full int8 / uint8 / int16 range, which "
                         f"QuantizeLinear saturates to")
    return dtype


def _scopes(node) -> list[str]:
    """The module names the exporter recorded ``node`` (an ``onnx`` NodeProto) under, root
    first, its op's last."""
    return _scope_list(next((p.value for p in node.metadata_props if p.key == _SCOPES), "[]"))


def _scope_list(text: str) -> list[str]:
    """The exporter's record of a node's module names (a Python list's text) as a list."""
    return list(ast.literal_eval(text))


def _weight_view(init_array: np.ndarray, weight: np.ndarray, node) -> bool | None:
    """Whether the node's initializer is ``weight`` transposed (True), as is (False), or
    another tensor (None)."""
    trans_b = any(a.name == "transB" and a.i for a in node.attribute)
    if node.op_type == "MatMul" or (node.op_type == "Gemm" and not trans_b):
        return True if init_array.shape == weight.T.shape and np.array_equal(
            init_array, weight.T) else None
    return False if init_array.shape == weight.shape and np.array_equal(
        init_array, weight) else None


def _swaps(node, inits: dict) -> bool:
    """Whether ``node`` transposes a 2-D initializer (a weight left unfolded)."""
    if node.op_type != "Transpose" or not node.input or node.input[0] not in inits:
        return False
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
    return len(inits[node.input[0]].dims) == 2 and perm == [1, 0]


def unsigned(dtype, codes: torch.Tensor | None, zp: torch.Tensor, shift: bool):
    """int8 codes and zero point moved by +128 to uint8 when ``shift``: the same values
    (``(q + 128) - (zp + 128) == q - zp``), the same saturation, but ONNX Runtime then runs
    its u8u8 kernel in any session: exact on every x86 CPU, never the int8 dot-product
    (VNNI) kernel. See :data:`.onnx.PRECISE_U8U8` for the default int8 storage."""
    from onnx import TensorProto as TP

    if shift and dtype == TP.INT8:
        return TP.UINT8, None if codes is None else codes + 128, zp + 128
    return dtype, codes, zp


def _weight_dq(layer, state, weight: torch.Tensor, transposed: bool, prefix: str,
               shift: bool):
    """Initializers (codes, scale, zero point) and the DequantizeLinear node of one weight."""
    from onnx import helper, numpy_helper

    from ..qdq import quantize

    spec = state.spec
    if state.dynamic is not False or state.qparams is None:
        raise ValueError(f"onnx export: {layer}.weight has no static qparams "
                         f"(dynamic={state.dynamic!r})")
    dtype, _, _ = storage(spec, layer, "weight")
    qp = state.qparams
    codes = quantize(weight.detach().float(), qp, spec).to(torch.int32)  # [out, in]
    scale = qp.effective_scale.detach().float()
    zp = qp.zero_point.detach().to(torch.int32)
    layout = spec.layout
    out_f, in_f = weight.shape
    attrs = {}
    kind = _weight_form(layout, layer)
    if kind == "tensor":
        scale, zp = scale.reshape(()), zp.reshape(())
    elif kind == "channel":
        scale, zp = scale.reshape(out_f), zp.reshape(out_f)
        attrs["axis"] = 1 if transposed else 0
    else:
        scale = scale.reshape(out_f, in_f // layout.size)
        zp = zp.reshape(out_f, in_f // layout.size)
        if transposed:
            scale, zp = scale.T, zp.T
        attrs["axis"] = 0 if transposed else 1
        attrs["block_size"] = layout.size
    if transposed:
        codes = codes.T
    dtype, codes, zp = unsigned(dtype, codes, zp, shift)
    names = [f"{prefix}.weight_q", f"{prefix}.weight_scale", f"{prefix}.weight_zero_point"]
    inits = [code_tensor(names[0], dtype, codes),  # raw bytes: 1 per int8 code, 1/2 per int4
             numpy_helper.from_array(scale.contiguous().numpy(), names[1]),  # 0-d kept
             code_tensor(names[2], dtype, zp)]
    out = f"{prefix}.weight_dq"
    node = helper.make_node("DequantizeLinear", names, [out], name=f"{prefix}/weight_dq",
                            **attrs)
    return inits, node, out


def _input_qdq(layer, state, source: str, prefix: str, shift: bool):
    """Initializers and the QuantizeLinear -> DequantizeLinear pair of one static input."""
    from onnx import helper, numpy_helper

    if state.dynamic is not False or state.qparams is None:
        raise ValueError(f"onnx export: {layer}.input is quantized at run time "
                         f"(dynamic={state.dynamic!r}); this exporter writes static activation "
                         f"scales only")
    dtype = _input_storage(state.spec, layer)
    qp = state.qparams
    dtype, _, zp = unsigned(dtype, None, qp.zero_point.reshape(()).to(torch.int32), shift)
    names = [f"{prefix}.input_scale", f"{prefix}.input_zero_point"]
    inits = [numpy_helper.from_array(
                 qp.effective_scale.detach().float().reshape(()).numpy().copy(), names[0]),
             code_tensor(names[1], dtype, zp)]
    q = helper.make_node("QuantizeLinear", [source, *names], [f"{prefix}.input_q"],
                         name=f"{prefix}/input_q")
    dq = helper.make_node("DequantizeLinear", [f"{prefix}.input_q", *names],
                          [f"{prefix}.input_dq"], name=f"{prefix}/input_dq")
    return inits, [q, dq], f"{prefix}.input_dq"


def _plain_gemm(node) -> bool:
    """A ``Gemm`` that is ``A @ B (+ C)``: alpha = beta = 1, A not transposed."""
    attrs = {a.name: a for a in node.attribute}
    return node.op_type == "Gemm" and not (attrs.get("transA") and attrs["transA"].i) and all(
        k not in attrs or attrs[k].f == 1.0 for k in ("alpha", "beta"))


def _as_matmul(node, product: str) -> list:
    """``node`` (a plain Gemm whose weight input is already the ``[in, out]`` DQ output) as
    ``MatMul`` then ``Add`` of its bias (the MatMul's output then named ``product``), under
    its name scopes."""
    from onnx import helper

    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    out = node.output[0]
    mm = helper.make_node("MatMul", list(node.input[:2]), [product if bias else out],
                          name=node.name)
    nodes = [mm] if bias is None else [
        mm, helper.make_node("Add", [mm.output[0], bias], [out], name=f"{node.name}/bias")]
    for n in nodes:
        n.metadata_props.extend(node.metadata_props)
    return nodes


#: the tensors :func:`_input_qdq` and :func:`_weight_dq` name ``prefix + suffix``
_SUFFIXES = (".input_scale", ".input_zero_point", ".input_q", ".input_dq", ".weight_q",
             ".weight_scale", ".weight_zero_point", ".weight_dq")


def _graph_names(graph) -> set[str]:
    """Every tensor name of ``graph``: initializers, inputs, outputs, what nodes read and
    write."""
    return {*(t.name for t in graph.initializer), *(v.name for v in graph.input),
            *(v.name for v in graph.output), *(v.name for v in graph.value_info),
            *(o for n in graph.node for o in (*n.input, *n.output))}


def _alias_names(model, states) -> dict[str, str]:
    """Every name a calibrated module is registered under -> its name in ``states``: the
    exporter records the attribute the forward called (``self.alias = self.b`` called as
    ``self.alias`` is scoped ``alias``), while calibrate names the module once."""
    owner = {id(model.get_submodule(layer)): layer for layer in reversed(list(states))}
    return {name: owner[id(m)] for name, m in model.named_modules(remove_duplicate=False)
            if id(m) in owner}


def outside_reads(graph, model, states) -> dict[str, str]:
    """Calibrated layer -> why the export cannot quantize its weight (``"{layer}.weight"``
    comes first): a node outside it reads the weight, in torch.onnx's graph (an ``onnx_ir``
    graph) before its optimizer folds such reads into constants (``self.a.weight.sum(1)``
    becomes a float tensor), or a control-flow branch does, whose nodes are not rewritten.
    The rewrite quantizes the weight for the layer's own MatMuls alone: such a read would
    see the float weight, unlike ``apply()``."""
    names = _alias_names(model, states)
    params = {}  # id(weight) -> the names torch.onnx may give its initializer
    for name, p in model.named_parameters(remove_duplicate=False):
        params.setdefault(id(p), []).append(name)
    found = {}
    for layer, roles in states.items():
        weight = getattr(model.get_submodule(layer), "weight", None)
        values = [graph.initializers.get(n) for n in params.get(id(weight), ())] \
            if "weight" in roles else []
        for node, _ in (use for v in values if v is not None for use in v.uses()):
            scopes = _scope_list(node.metadata_props.get(_SCOPES, "[]"))  # (an onnx_ir node)
            if node.graph is not graph:  # a branch's nodes record no scopes; none is rewritten
                found[layer] = (f"is read by a {node.op_type} in a control-flow branch "
                                f"(torch.cond: an If / Loop subgraph), whose nodes the export "
                                f"does not rewrite: leave {layer} in float (ignore it in the "
                                f"recipe) or call it outside the branch")
                break
            if not any(names.get(s) == layer for s in scopes):
                where = scopes[-2] if len(scopes) > 1 else ""
                reader = f"a {node.op_type} in " + (
                    f"module {where!r}" if where else "the model's own forward")
                found[layer] = (f"is also read outside {layer} (by {reader}): the graph "
                                f"quantizes it for {layer}'s MatMul alone, so that read would "
                                f"see the float weight, unlike apply(); leave {layer} in float "
                                f"(ignore it in the recipe) or read the weight through the "
                                f"layer")
                break
    return found


class _Rewrite:
    """The new node list and initializers of :func:`insert_qdq`."""

    def __init__(self, onnx, graph, model, states, shift: bool):
        self.onnx, self.model, self.states, self.shift = onnx, model, states, shift
        self.inits = {t.name: t for t in graph.initializer}
        # a weight read by several MatMuls (a layer called twice on 3-D inputs) may stay a
        # Transpose of its initializer: onnxscript folds no constant over 8192 elements used
        # twice. The weight is read through it; it goes once no node reads it (drop_dead)
        self.transposes = {n.output[0]: n.input[0] for n in graph.node if _swaps(n, self.inits)}
        self.names = _alias_names(model, states)
        self.taken = _graph_names(graph)  # the new names must not reuse the model's own
        self.calls: dict[str, int] = {}  # layer -> its MatMul / Gemm nodes rewritten so far
        self.weights: dict[tuple[str, bool], object] = {}  # (layer, transposed) -> first DQ
        self.nodes: list = []
        self.new_inits: list = []

    def node(self, node) -> None:
        layer = next((self.names[s] for s in reversed(_scopes(node)) if s in self.names),
                     None) if node.op_type in ("MatMul", "Gemm") else None
        source = node.input[1] if len(node.input) > 1 else None
        held = source if source in self.inits else self.transposes.get(source)
        if layer is None or held is None:  # (a float layer's weight is never decoded)
            self.nodes.append(node)
            return
        if self.inits[held].data_location == self.onnx.TensorProto.EXTERNAL:
            # onnx would read it relative to the working folder: the rewrite reads only
            # what the proto holds (torch.onnx's model_proto holds every tensor's bytes)
            raise ValueError(f"onnx export: {layer}: the graph holds its weight {held!r} as "
                             f"external data, which the rewrite does not read")
        array = self.onnx.numpy_helper.to_array(self.inits[held])
        array = array if held == source else array.T
        roles = self.states[layer]
        weight = self.model.get_submodule(layer).weight.detach().float()
        transposed = _weight_view(array, weight.numpy(), node)
        if transposed is None:
            raise ValueError(f"onnx export: {layer}: the exported node {node.name!r} does not "
                             f"multiply by {layer}.weight")
        matmul = _plain_gemm(node) and "weight" in roles
        if matmul:  # the weight DQ is written [in, out] for the MatMul
            transposed = True
        k = self.calls[layer] = self.calls.get(layer, -1) + 1
        prefix = self._free(layer if k == 0 else f"{layer}.call{k}", _SUFFIXES)
        if "input" in roles:
            i, qdq, out = _input_qdq(layer, roles["input"], node.input[0], prefix, self.shift)
            self.new_inits += i
            self.nodes += qdq
            node.input[0] = out
        if "weight" in roles:
            node.input[1] = self._weight(layer, roles, weight, transposed, prefix)
        self.nodes += _as_matmul(node, self._free(f"{node.output[0]}_matmul")) \
            if matmul else [node]

    def drop_dead(self, outputs: set[str]) -> None:
        """The weight Transposes (above) that no node reads now the DQs replaced them."""
        read = _reads(self.nodes) | outputs
        self.nodes = [n for n in self.nodes if n.output[0] not in self.transposes
                      or n.output[0] in read]

    def _free(self, base: str, suffixes=("",)) -> str:
        """``base``, or ``base_1``, ``base_2``... the first whose names ``+ suffix`` no tensor
        of the graph has yet (then taken): a Linear's own buffer ``input_scale`` is the model's
        tensor ``layer.input_scale``, a name the rewrite's ``prefix.input_scale`` would reuse
        (onnx refuses an initializer name twice)."""
        name, n = base, 0
        while any(name + s in self.taken for s in suffixes):
            n += 1
            name = f"{base}_{n}"
        self.taken.update(name + s for s in suffixes)
        return name

    def _weight(self, layer, roles, weight, transposed: bool, prefix: str) -> str:
        """The output of a new weight DequantizeLinear, one per call (ORT fuses each with its
        MatMul). Beside an 8-bit input the later calls read the codes, scale and zero point
        the first call wrote (``MatMulIntegerToFloat`` takes shared ones: the file holds the
        weight once); else each call writes its own, as ORT (1.32) fuses a DQ into
        ``MatMulNBits`` only where no other node reads its initializers."""
        key = (layer, transposed)
        first = self.weights.get(key) if _int8_input(roles, layer) else None
        if first is None:
            i, first, out = _weight_dq(layer, roles["weight"], weight, transposed, prefix,
                                       self.shift)
            self.new_inits += i
            self.weights[key] = first
            self.nodes.append(first)
            return out
        dq = self.onnx.helper.make_node("DequantizeLinear", list(first.input),
                                        [f"{prefix}.weight_dq"], name=f"{prefix}/weight_dq")
        dq.attribute.extend(first.attribute)
        self.nodes.append(dq)
        return dq.output[0]


def _int8_input(roles, layer: str) -> bool:
    """Whether ``layer`` has a static input stored in 8 bits (what ORT fuses with its weight
    into ``MatMulIntegerToFloat``)."""
    return "input" in roles and storage(roles["input"].spec, layer, "input")[1] == 8


def opset_error(opset: int) -> ValueError:
    """The refusal of an opset torch.onnx does not write itself."""
    # torch.onnx converts an opset its exporter does not reach (26+ with torch 2.13) with
    # onnx's C API, which drops every node's metadata: no layer could be found
    return ValueError(f"onnx export: torch.onnx's graph at opset {opset} records no module "
                      f"names ({_SCOPES}), which the export finds each Linear's nodes by "
                      f"(its converter to opsets above its own drops them): export with "
                      f"an opset torch.onnx writes itself (21 to 25 with torch 2.13)")


def insert_qdq(onnx, graph, model, states, shift: bool, opset: int) -> None:
    """Each calibrated layer's MatMul / Gemm nodes (one per call) get their input QDQ and
    weight DQ nodes; a layer with none is a ``ValueError`` naming it."""
    if states and not any(_scopes(n) for n in graph.node):
        raise opset_error(opset)
    rewrite = _Rewrite(onnx, graph, model, states, shift)
    for node in graph.node:
        rewrite.node(node)
    missing = sorted(set(states) - set(rewrite.calls))
    if missing:
        _missing_error(graph, missing, rewrite.names)
    rewrite.drop_dead({o.name for o in graph.output})
    del graph.node[:]
    graph.node.extend(rewrite.nodes)
    graph.initializer.extend(rewrite.new_inits)
    drop_unused_initializers(graph)


def _missing_error(graph, missing: list[str], names: dict[str, str]) -> None:
    """Why a calibrated Linear has no MatMul / Gemm: never called as a module (nothing is
    recorded under its name), or called without multiplying by its weight initializer."""
    seen = {names.get(s, s) for n in graph.node for s in _scopes(n)}
    never = [m for m in missing if m not in seen]
    if never:
        raise ValueError(
            f"onnx export: {never[:5]} never called as a module in the forward (an unused "
            f"layer, or one whose weight another module reads directly, as "
            f"nn.MultiheadAttention reads out_proj.weight): the graph has no node of its own "
            f"to quantize; leave it out of the recipe (ignore it) or call the layer itself")
    raise ValueError(f"onnx export: the nodes of {missing[:5]} include no MatMul / Gemm "
                     f"multiplying by the layer's weight (a constant initializer)")


def _reads(nodes) -> set[str]:
    """The names ``nodes`` read, their control-flow branches' (If / Loop subgraphs) too."""
    read = set()
    for n in nodes:
        read.update(n.input)
        for a in n.attribute:
            for sub in (*([a.g] if a.HasField("g") else []), *a.graphs):
                read |= _reads(sub.node)
    return read


def drop_unused_initializers(graph) -> None:
    """The float weights the DQ nodes replaced (an initializer no node reads, not even in a
    control-flow branch, and no output)."""
    used = _reads(graph.node) | {o.name for o in graph.output}
    # deleted in place: extend() would copy every kept tensor (protobuf's upb: a 2.2 GB
    # float model's embeddings held twice, the export's peak 2 GB higher)
    for i in reversed([i for i, t in enumerate(graph.initializer) if t.name not in used]):
        del graph.initializer[i]
