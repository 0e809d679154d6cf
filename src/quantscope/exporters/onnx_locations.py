"""Where an ONNX model says its tensors lie, checked before anything reads them (every
quantscope reader of an ONNX file: :func:`read_graph`), and the paths ONNX Runtime may write
an optimized model to (:func:`check_optimized`).

Reading (:func:`read_graph`): the model's graph without its data, each external tensor's
``location`` (in the graph, its subgraphs, node attributes, sparse tensors, model-local
functions, their nodes and default attributes, and training graphs) checked before anything
reads it: no key named twice, ``offset`` and ``length`` ASCII digits only, a relative path
inside the model's folder (no absolute path, drive, ``..``, the last three also as Windows
writes them: ``\\x``, ``C:x``, ``..\\x``), not a symbolic link, nor under one leading out
of the folder, a regular file (not a FIFO or a device; with or without a ``length``),
``offset + length`` within it. onnx (>= 1.16) and ONNX Runtime (1.32) refuse most of this
themselves; quantscope does not rely on their versions.
"""

from __future__ import annotations

import ntpath
import os
import re
import stat

from .atomic import written_by_quantscope

__all__ = ["check_optimized", "read_graph"]

#: ``offset`` / ``length`` as the ONNX spec writes them (``int()`` also takes ``0_0``, `` 0``)
_DIGITS_ONLY = re.compile(r"[0-9]+")


def read_graph(path):
    """``(proto, folder)``: the ONNX model at ``path`` without its external data, every
    external tensor's location checked (module doc); ``folder``, where its data files lie,
    is None for a model without external data. A file in which the bytes ``location`` (the
    key every external tensor names its file by) occur nowhere is not parsed: ``(None,
    None)`` (parsing a 100 MB model took 0.2 s, twice ONNX Runtime's own load)."""
    import onnx

    path = os.fspath(path)
    if not _names_a_location(path):
        return None, None
    proto = onnx.load(path, load_external_data=False)
    folder = os.path.dirname(os.path.abspath(path))
    external = [t for t in _model_tensors(proto) if _external(t)]
    for tensor in external:
        _check_location(tensor, folder, path)
    return proto, (folder if external else None)


def _names_a_location(path: str) -> bool:
    """Whether the bytes ``location`` occur in the file (a tensor's bytes may hold them too:
    then the graph is parsed, no more)."""
    import mmap

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return False
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(b"location") >= 0


def _check_location(tensor, folder: str, path: str) -> None:
    entries = _entries(tensor)
    where = entries.get("location", "")
    keys = [e.key for e in tensor.external_data]
    bad = f"is named with a repeated key ({keys})" if len(set(keys)) < len(keys) else \
        _bad_location(where, folder)
    if bad is None:
        size = os.stat(os.path.join(folder, where)).st_size
        given = entries.get("offset", "0"), entries.get("length", str(size))
        # ASCII digits only: int() also takes "0_0", " 0", "+0" and other scripts' digits
        offset, length = (int(v) if _DIGITS_ONLY.fullmatch(v) else -1 for v in given)
        if "length" not in entries and offset >= 0:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            bad = (f"offset {entries.get('offset')} and length {entries.get('length')} lie "
                   f"outside its {size} bytes")
    if bad is not None:
        raise ValueError(f"onnx model {path!r}: tensor {tensor.name!r} has its data in "
                         f"{where!r}, which {bad}; quantscope reads external data only from "
                         f"a file inside the model's folder, named by a relative path")


def _bad_location(where: str, folder: str) -> str | None:
    """Why ``where`` (a tensor's location) may not be read, or None."""
    parts = where.replace("\\", "/").split("/")
    if not where or "\0" in where or os.path.isabs(where) or ntpath.isabs(where) \
            or ntpath.splitdrive(where)[0]:
        return "is not a relative path"
    if ".." in parts:
        return "leads out of the model's folder (..)"
    full = os.path.join(folder, where)
    real, home = os.path.realpath(full), os.path.realpath(folder)
    if os.path.islink(full):
        return "is a symbolic link"
    if os.path.commonpath([real, home]) != home:
        return "lies outside the model's folder (through a symbolic link)"
    try:
        if not stat.S_ISREG(os.stat(full).st_mode):
            return "is not a regular file"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    return None


def check_optimized(path, proto, folder: str | None, optimized_model_path) -> None:
    """Refuse an ``optimized_model_path`` where what ONNX Runtime writes there (the model,
    and with external data ``<optimized name>.data``) would replace a file the session reads
    (the model or one of its data files, by any path: a link, a hard link) or one quantscope
    did not write. An existing file is replaced only where it is an earlier optimized model
    (quantscope's metadata entry, which ORT keeps) or, for the ``.data`` file, the one such a
    model at the optimized path names (its only location)."""
    if optimized_model_path is None:
        return
    opt = os.path.abspath(os.fspath(optimized_model_path))
    reads = [os.path.abspath(os.fspath(path))]
    if folder is not None:
        reads += [os.path.join(folder, _entries(t)["location"]) for t in _model_tensors(proto)
                  if _external(t)]
    writes = [opt, *([opt + ".data"] if folder is not None else [])]
    for w in writes:
        for r in reads:
            if os.path.realpath(w) == os.path.realpath(r) or _samefile(w, r):
                raise ValueError(f"optimized_model_path: ONNX Runtime would write {w!r}, "
                                 f"which is {r!r}, a file this session reads: choose another "
                                 f"path")
        if os.path.lexists(w) and not _earlier_optimized(opt, w != opt):
            raise ValueError(f"optimized_model_path: {w!r} exists and is not an earlier "
                             f"optimized model of quantscope's (or its data file): ONNX "
                             f"Runtime would replace it; move it away or choose another path")


def _samefile(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _earlier_optimized(opt: str, data: bool) -> bool:
    """Whether ``opt`` is a plain file with quantscope's metadata entry (an earlier optimized
    model) and, with ``data``, ``<opt>.data`` a plain file that model names as its one
    location."""
    import onnx

    paths = (opt, opt + ".data") if data else (opt,)
    if any(os.path.islink(p) or not os.path.isfile(p) for p in paths) \
            or not written_by_quantscope(opt):
        return False
    if not data:
        return True
    try:
        proto = onnx.load(opt, load_external_data=False)
    except Exception:  # noqa: BLE001 (not a model: not ours)
        return False
    return {_entries(t).get("location") for t in _model_tensors(proto) if _external(t)} == \
        {os.path.basename(opt) + ".data"}


def _external(tensor) -> bool:
    return tensor.HasField("data_location") and tensor.data_location == tensor.EXTERNAL


def _entries(tensor) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def _initializers(graph):
    """The initializers of ``graph`` and of its subgraphs (an If's, a Loop's branches)."""
    yield from graph.initializer
    for node in graph.node:
        for sub in _node_graphs(node):
            yield from _initializers(sub)


def _model_tensors(proto):
    """Every tensor ``proto`` (a ModelProto) holds: its graph's, those of its model-local
    functions' nodes and default attributes (ORT inlines a function, a default's tensor
    with it) and of its training graphs."""
    yield from _tensors(proto.graph)
    for function in proto.functions:
        yield from _node_tensors(function.node)
        yield from _attribute_tensors(function.attribute_proto)
    for info in proto.training_info:
        yield from _tensors(info.initialization)
        yield from _tensors(info.algorithm)


def _tensors(graph):
    """Every tensor ``graph`` holds: initializers (dense and sparse), node attributes, and
    those of its subgraphs."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    yield from _node_tensors(graph.node)


def _node_tensors(nodes):
    """The tensors of ``nodes``' attributes, and of the graphs they hold."""
    for node in nodes:
        yield from _attribute_tensors(node.attribute)


def _attribute_tensors(attributes):
    """The tensors ``attributes`` (a node's, or a function's defaults) hold: dense and
    sparse, single and lists, and those of the graphs they hold."""
    for a in attributes:
        if a.HasField("t"):
            yield a.t
        yield from a.tensors
        for sparse in (*([a.sparse_tensor] if a.HasField("sparse_tensor") else []),
                       *a.sparse_tensors):
            yield from (sparse.values, sparse.indices)
    for sub in _attribute_graphs(attributes):
        yield from _tensors(sub)


def _node_graphs(node):
    """The graphs ``node``'s attributes hold (an If's branches, a Loop's body)."""
    return _attribute_graphs(node.attribute)


def _attribute_graphs(attributes):
    """The graphs ``attributes`` hold, single and lists."""
    for a in attributes:
        if a.HasField("g"):
            yield a.g
        yield from a.graphs
