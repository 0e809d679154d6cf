"""ONNX external data: the tensors of an export over protobuf's 2 GiB in a data file beside
the model (the ONNX spec's external data, as ``onnx.save_model(save_as_external_data=True)``
and torch.onnx write it), and the check every quantscope reader of an ONNX file makes of
where a model says its tensors lie.

Writing (:func:`write_model`). Every initializer of :data:`SIZE_THRESHOLD` bytes or more goes
to one data file, in graph order (those of 1 MiB or more at offsets aligned to
:data:`ALIGNMENT`, onnx_ir's rule, so ONNX Runtime can map them), each tensor's ``raw_data``
dropped from the proto as it is written (the proto shrinks as the file grows: no third copy
of the weights). The file is named after its content, ``<model name>.<16 hex digits of its
SHA-256>.data`` (a ``location`` relative to the model's folder, no path), because a model must
never point at a data file other than the one written with it: the data file is written
under a temporary name, renamed to its own name without replacing anything (``renameat2``'s
``RENAME_NOREPLACE``; else under the parent's lock), then the model is swapped in atomically
(:func:`~.atomic.atomic_file`). A crash before the swap leaves the previous model and its
data as they were (and at most an unreferenced new data file; a raise, the swap's included,
removes the data file the export made); after it, the new pair. A
file already at the data file's name is reused where its bytes are the same (an identical
re-export), and otherwise refused, ``overwrite`` or not: quantscope never replaces a data
file. Once the new model is in place, the data file of the export it replaced (one named
``<model name>.<16 hex digits>.data`` in its folder, a plain file) is deleted.

Reading (:func:`read_graph`): the model's graph without its data, each external tensor's
``location`` (in the graph, its subgraphs, node attributes, sparse tensors, model-local
functions and training graphs) checked before anything reads it: no key named twice, ``offset``
and ``length`` ASCII digits only, a relative path inside the model's folder
(no absolute path, drive, ``..``), not a symbolic link, nor under one leading out of the
folder, a regular file (not a FIFO or a device), ``offset + length`` within it. onnx
(>= 1.16) and ONNX Runtime (1.32) refuse most of this themselves; quantscope does not rely on
their versions.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import ntpath
import os
import re
import stat
import tempfile

from .atomic import _name_max, _public_modes, _temp_prefix, atomic_file, written_by_quantscope
from .atomic_swap import _RENAME_NOREPLACE, _parent_lock, _renameat2
from .onnx_tensors import check_float32_quantize

__all__ = ["ALIGNMENT", "SIZE_THRESHOLD", "check_external_target", "check_optimized",
           "graph_bytes", "read_graph", "session_entries", "write_model"]

#: the smallest initializer (bytes) written to the data file; smaller ones (scales, zero
#: points, biases of small layers) stay in the model, as onnx's ``size_threshold`` default
SIZE_THRESHOLD = 1024
#: the offset alignment of tensors of :data:`_ALIGN_FROM` bytes or more (Windows' allocation
#: granularity, a multiple of every page size; onnx_ir's default)
ALIGNMENT = 65536
_ALIGN_FROM = 1 << 20
_DIGITS = 16  # hex digits of the data's SHA-256 in its file name
_CHUNK = 1 << 24
_DIGITS_ONLY = re.compile(r"[0-9]+")


#: bits per element of the ONNX types a ``raw_data`` tensor holds (by TensorProto name)
_BITS = {**dict.fromkeys(("INT4", "UINT4", "FLOAT4E2M1"), 4),
         **dict.fromkeys(("INT8", "UINT8", "BOOL", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ",
                          "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "FLOAT8E8M0"), 8),
         **dict.fromkeys(("INT16", "UINT16", "FLOAT16", "BFLOAT16"), 16),
         **dict.fromkeys(("FLOAT", "INT32", "UINT32"), 32),
         **dict.fromkeys(("DOUBLE", "INT64", "UINT64", "COMPLEX64"), 64), "COMPLEX128": 128}


def graph_bytes(model) -> int:
    """An upper bound of ``model`` (a ModelProto) serialized, to tell protobuf's 2 GiB
    limit: a ``raw_data`` tensor of the graph as its element count times its type's size
    plus its other fields, never serialized (upb's ``ByteSize()`` serializes the message: a
    transient copy of the largest tensor, 1.1 GB of a 2.2 GB model's peak); every other field
    (nodes, value_info, functions, metadata, opset imports, doc strings) by ``ByteSize()``
    or its length, each with 12 bytes for its tag and length."""
    graph = model.graph
    total = _fields_bound(model, skip="graph") + _fields_bound(graph, skip="initializer") + 12
    for t in graph.initializer:
        size = _raw_size(t)
        total += 12 + (t.ByteSize() if size is None else
                       size + 12 + _fields_bound(t, skip="raw_data"))
    return total


def _fields_bound(message, skip: str) -> int:
    """An upper bound of ``message``'s fields but ``skip`` serialized (12 bytes a value for
    its tag and its length or varint, more than either takes)."""
    total = 0
    for field in message.DESCRIPTOR.fields:
        if field.name == skip:
            continue
        value = getattr(message, field.name)
        if not field.is_repeated:
            if not message.HasField(field.name):
                continue
            value = (value,)
        for v in value:
            total += 12 + (v.ByteSize() if field.message_type is not None else
                           len(v.encode()) if isinstance(v, str) else
                           len(v) if isinstance(v, bytes) else 0)
    return total


def _raw_size(tensor) -> int | None:
    """The bytes of ``tensor``'s ``raw_data`` from its dims and type, or None (no raw data,
    or a type not in :data:`_BITS`). Reading ``raw_data`` itself copies it (upb)."""
    from onnx import TensorProto

    if not tensor.HasField("raw_data") or tensor.data_type not in TensorProto.DataType.values():
        return None
    bits = _BITS.get(TensorProto.DataType.Name(tensor.data_type))
    return None if bits is None else (math.prod(tensor.dims) * bits + 7) // 8


def check_external_target(path) -> str:
    """Refuse an output ``path`` (checked by :func:`~.atomic.check_writable_target`) that
    cannot hold a model with external data, before the trace where the caller knows it
    will: a data file's name past the file system's limit, or a symbolic link to a file in
    another folder (ONNX Runtime and onnx read the data relative to the folder of the path
    they are given, the link's; the data file lies beside the file written, the link's
    target). Returns the file written (the link's target)."""
    path = os.path.abspath(os.fspath(path))
    target = os.path.realpath(path) if os.path.islink(path) else path
    folder, name = os.path.split(target)
    if target != path and os.path.realpath(os.path.dirname(path)) != os.path.realpath(folder):
        raise ValueError(f"onnx export: {path!r} is a symbolic link to {target!r}, in another "
                         f"folder: a model with external data is read with its data file from "
                         f"the folder of the path opened, and the data file goes beside "
                         f"{target!r}; export to {target!r} itself, or link the folder")
    size = len(os.fsencode(name)) + _DIGITS + 6  # ".<digits>.data"
    probe = folder
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if size > _name_max(probe):
        raise ValueError(f"onnx export: {target!r}: its data file's name would be {size} bytes "
                         f"long ({name}.<{_DIGITS} hex digits>.data); the file system takes "
                         f"names of at most {_name_max(probe)} bytes: choose a shorter name")
    return target


def write_model(onnx, proto, path, *, external: bool, overwrite: bool, inputs) -> None:
    """Write ``proto`` at ``path`` (through :func:`~.atomic.atomic_file`): one file, as
    ``onnx.save`` writes it (checked before anything is written), or with ``external`` its
    tensors in a data file (module doc; checked on the written files, before the swap); the
    data file of the export replaced, if any, deleted after the swap."""
    target = os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path)
    if external:
        check_external_target(path)
    else:
        onnx.checker.check_model(proto)
        check_float32_quantize(proto)  # what the checker passes and ORT refuses (issue 37)
    old = _old_data(target, onnx)
    new = created = None
    try:
        with atomic_file(path, overwrite=overwrite, kind="file", inputs=inputs) as tmp:
            if external:
                new, created = _save_external(onnx, proto, tmp, target)
            else:
                onnx.save(proto, tmp)
    except BaseException:  # the swap failed: the data file this export made is no one's
        if created is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(created)
        raise
    if old is not None and os.path.basename(old) != new:
        with contextlib.suppress(FileNotFoundError):
            os.remove(old)


def _save_external(onnx, proto, tmp: str, target: str) -> tuple[str, str | None]:
    """``proto`` at ``tmp`` with its tensors in a data file beside it (module doc); returns
    the data file's name and its path where this made it (None: an identical file reused).
    On any failure nothing this wrote is left."""
    folder, name = os.path.split(target)
    fd, data_tmp = tempfile.mkstemp(prefix=_temp_prefix(target + ".data"), suffix=".tmp",
                                    dir=folder)
    created = None
    try:
        with os.fdopen(fd, "wb") as f:
            digest, written = _write_data(proto, f)
        location = f"{name}.{digest[:_DIGITS]}.data"
        for tensor, offset, length in written:
            for key, value in (("location", location), ("offset", offset), ("length", length)):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
        check_float32_quantize(proto)  # (on the graph alone: the data is on the disk)
        _public_modes(data_tmp)
        created = _place(data_tmp, os.path.join(folder, location), digest)
        with open(tmp, "wb") as f:
            f.write(proto.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        onnx.checker.check_model(tmp)  # on the path: the data file's place is checked too
    except BaseException:
        for left in (data_tmp, created):
            if left is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(left)
        raise
    return location, created


def _write_data(proto, f):
    """Every initializer of :data:`SIZE_THRESHOLD` bytes or more written to ``f`` and made
    external (its ``raw_data`` dropped; the ``external_data`` entries are the caller's, once
    the file's name is known). Returns the SHA-256 hex digest of what was written and
    ``(tensor, offset, length)`` per tensor."""
    from onnx import TensorProto

    digest, written, offset = hashlib.sha256(), [], 0
    for tensor in _initializers(proto.graph):
        if tensor.data_location == TensorProto.EXTERNAL:
            raise ValueError(f"onnx export: initializer {tensor.name!r} is already external "
                             f"data; the export writes tensors it holds in memory only")
        if not tensor.HasField("raw_data"):
            continue
        size = _raw_size(tensor)  # (len(tensor.raw_data) would copy the bytes)
        if (len(tensor.raw_data) if size is None else size) < SIZE_THRESHOLD:
            continue
        raw = tensor.raw_data  # the one copy of this tensor, dropped before the next
        pad = bytes(-offset % ALIGNMENT if len(raw) >= _ALIGN_FROM else 0)
        f.write(pad)
        f.write(raw)
        digest.update(pad)
        digest.update(raw)
        offset += len(pad)
        written.append((tensor, offset, len(raw)))
        offset += len(raw)
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        del raw
    f.flush()
    os.fsync(f.fileno())  # on the disk before any model names it
    return digest.hexdigest(), written


def _place(tmp: str, final: str, digest: str) -> str | None:
    """``tmp`` renamed to ``final`` without replacing anything; returns ``final``, or None
    where a file with the same bytes is there already (``tmp`` removed). Any other file
    there is refused."""
    try:
        if not _renameat2(tmp, final, _RENAME_NOREPLACE):
            with _parent_lock(os.path.dirname(final)):
                if os.path.lexists(final):
                    raise FileExistsError(final)
                os.rename(tmp, final)
        return final
    except FileExistsError:
        if not _same_bytes(final, digest):
            raise ValueError(f"onnx export: {final!r} exists ({_what_is(final)}), not this "
                             f"export's data file: quantscope never replaces a data file; "
                             f"move it away or choose another output") from None
    os.remove(tmp)
    return None


def _what_is(path: str) -> str:
    """What is at ``path``, for :func:`_place`'s refusal: a file of other bytes, a folder ..."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "unreadable"
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
             (stat.S_ISBLK, "a device"), (stat.S_ISREG, "a file of other bytes"))
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def _same_bytes(path: str, digest: str) -> bool:
    """Whether ``path`` is a regular file (not a link) whose SHA-256 is ``digest``."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                h.update(chunk)
    except OSError:
        return False
    return h.hexdigest() == digest


def _old_data(target: str, onnx) -> str | None:
    """The data file of the quantscope export at ``target`` (to delete once replaced): its
    one location, where that is ``<model name>.<hex digits>.data``, a plain file beside it."""
    if not os.path.isfile(target) or not _names_a_location(target) \
            or not written_by_quantscope(target):
        return None
    try:
        proto = onnx.load(target, load_external_data=False)
    except Exception:  # noqa: BLE001 (not readable now: nothing of it to delete)
        return None
    folder, name = os.path.split(target)
    locations = {_entries(t).get("location") for t in _model_tensors(proto) if _external(t)}
    own = re.compile(re.escape(name) + rf"\.[0-9a-f]{{{_DIGITS}}}\.data")
    if len(locations) != 1 or not own.fullmatch(next(iter(locations)) or ""):
        return None
    old = os.path.join(folder, locations.pop())
    return old if os.path.isfile(old) and not os.path.islink(old) else None


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


def session_entries(options, folder: str | None, model, optimized_model_path) -> None:
    """The ONNX Runtime session entries a model with external data in ``folder`` needs:
    where its data lies when the session gets the model's bytes (``model`` not a path), and
    an optimized model saved with its tensors in ``<optimized name>.data`` (else ORT writes
    one message, which fails past 2 GiB)."""
    if folder is None:
        return
    if not isinstance(model, str):
        options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", folder)
    if optimized_model_path is not None:
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name",
            os.path.basename(os.fspath(optimized_model_path)) + ".data")
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes",
            str(SIZE_THRESHOLD))


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
    for sub in _subgraphs(graph):
        yield from _initializers(sub)


def _model_tensors(proto):
    """Every tensor ``proto`` (a ModelProto) holds: its graph's, those of its model-local
    functions' nodes (ORT inlines them) and of its training graphs."""
    yield from _tensors(proto.graph)
    for function in proto.functions:
        yield from _node_tensors(function.node)
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
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            for sparse in (*([a.sparse_tensor] if a.HasField("sparse_tensor") else []),
                           *a.sparse_tensors):
                yield from (sparse.values, sparse.indices)
            for sub in (*([a.g] if a.HasField("g") else []), *a.graphs):
                yield from _tensors(sub)


def _subgraphs(graph):
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("g"):
                yield a.g
            yield from a.graphs
