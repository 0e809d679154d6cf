"""ONNX external data: the tensors of an export over protobuf's 2 GiB in a data file beside
the model (the ONNX spec's external data, as ``onnx.save_model(save_as_external_data=True)``
and torch.onnx write it).

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
file. Once the new model is in place, the data file of the export it replaced is deleted
where that model's tensors name one file, ``<model name>.<16 hex digits>.data`` exactly, a
plain file in its folder (not a link); any other file they name is left (a kept
``<that>.orig``, two such files, a file outside the folder).
The readers' location checks: :mod:`.onnx_locations`.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import stat
import tempfile

from .atomic import _name_max, _public_modes, _temp_prefix, atomic_file, written_by_quantscope
from .atomic_swap import _RENAME_NOREPLACE, _parent_lock, _renameat2
from .onnx_locations import _entries, _external, _initializers, _model_tensors, _names_a_location
from .onnx_tensors import check_float32_quantize

__all__ = ["ALIGNMENT", "SIZE_THRESHOLD", "check_external_target", "graph_bytes",
           "session_entries", "write_model"]

#: the smallest initializer (bytes) written to the data file; smaller ones (scales, zero
#: points, biases of small layers) stay in the model, as onnx's ``size_threshold`` default
SIZE_THRESHOLD = 1024
#: the offset alignment of tensors of :data:`_ALIGN_FROM` bytes or more (Windows' allocation
#: granularity, a multiple of every page size; onnx_ir's default)
ALIGNMENT = 65536
_ALIGN_FROM = 1 << 20
_DIGITS = 16  # hex digits of the data's SHA-256 in its file name
_CHUNK = 1 << 24


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


def _written(path) -> str:
    """The file an export to ``path`` writes: ``path`` made absolute, or a link's target."""
    path = os.path.abspath(os.fspath(path))
    return os.path.realpath(path) if os.path.islink(path) else path


def check_external_target(path) -> None:
    """Refuse an output ``path`` (checked by :func:`~.atomic.check_writable_target`) that
    cannot hold a model with external data, before the trace where the caller knows it
    will: a data file's name past the file system's limit, or a symbolic link to a file in
    another folder (ONNX Runtime and onnx read the data relative to the folder of the path
    they are given, the link's; the data file lies beside the file written, the link's
    target)."""
    path, target = os.path.abspath(os.fspath(path)), _written(path)
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


def write_model(onnx, proto, path, *, external: bool, overwrite: bool, inputs) -> None:
    """Write ``proto`` at ``path`` (through :func:`~.atomic.atomic_file`): one file, as
    ``onnx.save`` writes it (checked before anything is written), or with ``external`` its
    tensors in a data file (module doc; checked on the written files, before the swap); the
    data file of the export replaced, if any, deleted after the swap."""
    target = _written(path)
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
        with open(tmp, "wb") as f:  # (atomic_file flushes it to the disk)
            f.write(proto.SerializeToString())
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
