"""Safe writes: one guard for every output path, then build under a temporary name and swap.

Every folder or file quantscope writes goes through here; docs/SECURITY.md ("What it
writes") states the rules. :func:`check_writable_target`, the one output-path guard: never
an input of the command or the working folder, nor above one; an existing output replaced
only with ``overwrite``, only when quantscope wrote it (its :data:`MARKER`, listing what it
wrote there), only by an output of its kind (:func:`output_kind`), holding no output of
another kind (:data:`_NESTS`) and nothing this process could not delete; a name that fits
NAME_MAX. :func:`atomic_dir` / :func:`atomic_file` build under a temporary name beside the
target (``.NAME.XXXXXXXX.tmp``, NAME cut to fit) and swap it in (:mod:`.atomic_swap`): one
``renameat2`` exchange on Linux, else under a lock on the parent. What is written gets the
user's umask modes, not tempfile's private ones; files copied in from elsewhere keep their own.
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
import json
import os
import tempfile

from .._jsonfile import read_json
from .._plainchecks import check_bool, check_path
from .atomic_swap import (
    _RENAME_EXCHANGE,  # noqa: F401 (importable here, as before the split)
    _parent_lock,  # noqa: F401 (importable here, as before the split)
    _remove,
    _renameat2,
    flush,
    flush_entries,
    swap_in,
)

__all__ = ["EXPORT_EXTRAS", "MARKER", "atomic_dir", "atomic_file", "check_writable_target",
           "output_kind", "written_by_quantscope"]

#: the file every folder :func:`atomic_dir` writes holds: what ``overwrite`` may replace
MARKER = ".quantscope-output"
#: what a compressed-tensors export copies from the source model folder (patterns), and
#: nothing else (a model folder may hold notes, keys, other weights): the tokenizer's files
#: as transformers' ``save_pretrained`` writes them (its config, special and added tokens,
#: vocabularies, merges, sentencepiece models), the chat template and the generation config
EXPORT_EXTRAS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt", "*.model",
                 "*.spm", "chat_template.jinja", "chat_template.json", "generation_config.json")
#: the weight files the export copied from the source folder before EXPORT_EXTRAS: none
_OLD_UNCOPIED = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")


def written_by_quantscope(path) -> bool:
    """Whether the existing ``path`` is an earlier output of quantscope (:data:`MARKER`), or
    an older output's metadata file in a folder holding only what that kind consists of."""
    path = os.fspath(path)
    if os.path.isfile(path):  # an ONNX export, whatever its name: by its metadata entry
        return _onnx_written_by_quantscope(path)
    if os.path.isfile(os.path.join(path, MARKER)):
        return not _unlisted(path)
    return any(_json_has(os.path.join(path, name), key) and _holds_only(path, files)
               for _, name, key, files in _LEGACY_KINDS)


def _old_export_file(rel: str, is_dir: bool) -> bool:
    """A file an older compressed-tensors export wrote: the model's ``save_pretrained``, or
    a top-level file it copied then from the source: any but hidden ones and weights."""
    if fnmatch.fnmatchcase(rel, "model-*-of-*.safetensors") or rel in (
            "model.safetensors", "model.safetensors.index.json"):
        return True
    return not is_dir and "/" not in rel and not rel.startswith(".") \
        and not rel.endswith(_OLD_UNCOPIED)


_CALIBRATION = ("quantscope.json", "qparams.safetensors", MARKER)  # Calibration.save
#: outputs written before the marker: (kind, metadata file, its key, the files that kind is
#: made of: patterns relative to the folder, or a test of a relative path). The metadata file
#: alone is no proof: a model folder with a calibration saved in ``qparams/`` holds one too.
_LEGACY_KINDS = (
    ("calibration", "quantscope.json", "format", _CALIBRATION),
    # a `quantscope calibrate --out` run: its calibration in qparams/ and the report
    ("calibrate-run", "qparams/quantscope.json", "format",
     ("qparams", *(f"qparams/{n}" for n in _CALIBRATION), "report.json", "report.md")),
    ("compressed-tensors", "config.json", "quantscope", _old_export_file),
    # a `quantscope compare` run: its report and plots
    ("compare-run", "report.json", "runs", ("report.json", "report.md", "hist.png", "sqnr.png")))
#: the kinds of folder quantscope writes, told by their metadata file (first match wins:
#: an export's config.json is a model's too), and what messages call them
_KINDS = (*((kind, name, key) for kind, name, key, _ in _LEGACY_KINDS),
          ("model", "config.json", None))
#: the outputs saved into a folder later that replacing it may delete, by its kind: what its
#: writer makes (a calibration in a calibrate run; in a folder of no told kind, one of none).
#: Any other (an export saved inside a run) is refused, never deleted with the folder.
_NESTS = {"calibrate-run": ("calibration",), None: (None,)}
_KIND_NAMES = {"calibration": "a calibration", "calibrate-run": "a `quantscope calibrate` run",
               "compressed-tensors": "a compressed-tensors export",
               "compare-run": "a `quantscope compare` run", "model": "a model folder",
               "onnx": "an ONNX export"}


def output_kind(folder) -> str | None:
    """What kind of output ``folder`` is (a key of :data:`_KIND_NAMES`): the kind its
    :data:`MARKER` records, else (an older marker, or none) its metadata file's; else None."""
    folder = os.fspath(folder)
    kind = _marker_data(folder).get("kind")
    if isinstance(kind, str):
        return kind
    return next((k for k, n, key in _KINDS if _json_has(os.path.join(folder, n), key)), None)


def _entries(top: str, enter=None):
    """``(relative path, is_dir)`` of every file and folder under ``top`` (``/``-separated,
    links not followed); a folder for which ``enter(rel)`` is false is not walked into."""
    for root, dirs, files in os.walk(top):
        for name, is_dir in [(d, True) for d in dirs] + [(f, False) for f in files]:
            rel = os.path.relpath(os.path.join(root, name), top).replace(os.sep, "/")
            yield rel, is_dir
            if is_dir and enter is not None and not enter(rel):
                dirs.remove(name)


def _holds_only(top: str, allowed) -> bool:
    """Whether all under ``top`` is ``allowed``: a pattern, or ``allowed(rel path, is_dir)``."""
    return all(allowed(rel, is_dir) if callable(allowed)
               else any(fnmatch.fnmatchcase(rel, p) for p in allowed)
               for rel, is_dir in _entries(top))


def _json_of(path: str):
    """The JSON in the regular file ``path`` of at most 64 MiB, else None: an output being
    replaced may hold anything (a FIFO, a link to ``/dev/zero``, JSON nested too deep), and
    what is not quantscope's own small file is not its output."""
    if not os.path.isfile(path) or os.path.getsize(path) > 2**26:
        return None
    try:  # (the inputs' reader: its limits and messages, here only "not JSON")
        return read_json(path, "output")
    except (OSError, ValueError):
        return None


def _marker_data(folder: str) -> dict:
    data = _json_of(os.path.join(folder, MARKER))
    return data if isinstance(data, dict) else {}


def _listed(folder: str):
    """The names (relative, ``/``) the folder's :data:`MARKER` lists as quantscope's, or None
    where it lists none (a marker an earlier version wrote: the marker alone counts)."""
    names = _marker_data(folder).get("files")
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else None


def _unlisted(folder: str) -> list[str]:
    """What ``folder`` holds beyond the names its marker lists (a file the user added):
    replacing the folder would delete it. An unlisted folder that is itself a whole output
    of quantscope counts as the folder's only where :data:`_NESTS` says so."""
    listed = _listed(folder)
    if listed is None:
        return []
    listed.add(MARKER)
    nests = _NESTS.get(output_kind(folder), ())
    return [rel + "/" * is_dir for rel, is_dir in _entries(folder, enter=listed.__contains__)
            if rel not in listed and not (is_dir and output_kind(os.path.join(folder, rel))
                                          in nests and _whole_output(os.path.join(folder, rel)))]


def _whole_output(path: str) -> bool:
    """Whether ``path`` (in a folder quantscope wrote) is a whole output of its own."""
    if os.path.isdir(path) and not os.path.islink(path):
        return os.path.isfile(os.path.join(path, MARKER)) and written_by_quantscope(path)
    return os.path.isfile(path) and _onnx_written_by_quantscope(path)


def _write_marker(folder: str, names, kind: str | None = None) -> None:
    """The :data:`MARKER` of ``folder``, listing ``names`` (and ``kind``, where given)."""
    data = {"written_by": "quantscope", "version": _version(), **_marker_data(folder),
            **({"kind": kind} if kind else {}), "files": sorted(set(names) - {MARKER})}
    fd, tmp = tempfile.mkstemp(prefix=f".{MARKER}.", suffix=".tmp", dir=folder)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    _public_modes(tmp)
    flush(tmp)  # before its name: emptied by a power loss, it would leave the folder not ours
    os.replace(tmp, os.path.join(folder, MARKER))


def _record(path: str) -> None:
    """A file written into a folder whose marker lists its names (a plot redrawn into a
    compare run) is quantscope's too: listed, so replacing the folder may delete it."""
    folder, name = os.path.split(path)
    listed = _listed(folder)
    if listed is not None and name not in listed:
        _write_marker(folder, listed | {name})
        flush_entries(folder)  # the new marker's name: else a power loss may keep the old


def _json_has(path: str, key: str) -> bool:
    data = _json_of(path)
    if key is None or not isinstance(data, dict):  # None: any object (a model's config.json)
        return isinstance(data, dict)
    if key == "format":
        return data.get("format") == "quantscope-calibration"
    if key == "runs":  # compare's report: its setup and one entry per recipe / observer
        return isinstance(data.get("runs"), dict) and isinstance(data.get("setup"), dict)
    return isinstance(data.get(key), dict)


def _onnx_written_by_quantscope(path: str) -> bool:
    """Whether ``path`` is an ONNX model with quantscope's ``quantscope`` metadata entry. Only
    a file that can be one is parsed (under protobuf's 2 GiB, starting as ``onnx.save``
    starts one: ``ir_version``, field 1, varint, byte 0x08): a weights file is not read."""
    try:
        if os.path.getsize(path) >= 2**31:
            return False
        with open(path, "rb") as f:
            if f.read(1) != b"\x08":
                return False
        import onnx

        proto = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 (not a readable ONNX file: not ours)
        return False
    return any(p.key == "quantscope" for p in proto.metadata_props)


def _version() -> str:
    from .. import __version__

    return __version__


def _real(path) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def _check_not_an_input(path: str, inputs) -> None:
    """Refuse an output that is, or lies above, an input or the working folder."""
    out = _real(path)
    for what, inp in [("the current working folder", os.getcwd())] + [
            ("an input", p) for p in inputs if p is not None]:
        if _real(inp) == out or _real(inp).startswith(out.rstrip(os.sep) + os.sep):
            kind = what if what != "an input" else f"the input {os.fspath(inp)!r}"
            where = "is" if _real(inp) == out else "contains"
            raise ValueError(f"output {path!r} {where} {kind}: writing it would replace it; "
                             f"choose another output")


def _check_replaceable(path: str, overwrite: bool, kind: str, what: str | None = None) -> None:
    if kind == "folder" and not os.path.isdir(path):
        raise ValueError(f"output {path!r} exists and is not a folder")
    if kind != "folder" and os.path.isdir(path):
        raise ValueError(f"output {path!r} is a folder; expected a file path")
    if os.path.isdir(path) and not os.listdir(path):
        return  # an empty folder holds nothing to lose
    if kind == "report":  # a report, a plot: replaced whatever its mode, as open(path, "w")
        if not (overwrite or _listed_in_folder(path)):  # (quantscope's own: no flag needed)
            raise ValueError(f"output {path!r} exists and is not one quantscope wrote into "
                             f"an output folder of its own (no {MARKER} file there lists it); "
                             f"pass overwrite=True (--overwrite) to replace it")
        return
    # first: overwrite is offered only where it would replace the output
    _check_ours(path, kind, what)
    if kind == "folder":
        _check_removable(path)
    if not overwrite:
        state = "exists and is not empty" if os.path.isdir(path) else "exists"  # a file
        raise ValueError(f"output {path!r} {state}; pass overwrite=True "
                         f"(--overwrite) to replace it")


def _listed_in_folder(path: str) -> bool:
    """Whether the file ``path`` is one quantscope wrote into its folder: its marker lists
    it (a plot redrawn into a compare run too: :func:`_record`), or the folder is an older
    output of quantscope (a marker listing nothing, or none) holding it."""
    folder, name = os.path.split(path)
    listed = _listed(folder)
    return name in listed if listed is not None else written_by_quantscope(folder)


def _check_ours(path: str, kind: str, what: str | None) -> None:
    """Refuse an existing output ``overwrite`` may not replace: not quantscope's, holding
    what it did not write or another output, or of another kind than ``what``."""
    extra = _unlisted(path) if kind == "folder" else []
    nested = [e for e in extra if _whole_output(os.path.join(path, e))]
    if nested:  # an export saved inside a run: quantscope's, but not this folder's to delete
        held = output_kind(os.path.join(path, nested[0])) if nested[0].endswith("/") else "onnx"
        raise ValueError(f"output {path!r} holds {_KIND_NAMES.get(held, 'an output')} quantscope"
                         f" wrote, {os.path.join(path, nested[0])!r}: replacing the folder would"
                         f" delete it; move it out of the folder or remove it yourself")
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise ValueError(f"output {path!r} holds what quantscope did not write there "
                         f"({', '.join(extra[:3])}{more}): replacing it would delete that; "
                         f"move it out of the folder or choose another output")
    if not written_by_quantscope(path):
        ours = ("an ONNX file quantscope exported" if kind == "file" else
                f"a folder quantscope wrote (it has no {MARKER} file)")
        raise ValueError(f"output {path!r} exists and is not {ours}: overwrite replaces only "
                         f"quantscope's own earlier outputs; choose another output or remove "
                         f"it yourself")
    held = output_kind(path) if kind == "folder" and what is not None else None
    if held is not None and held != what:  # a calibration saved onto the export it read
        raise ValueError(f"output {path!r} holds {_KIND_NAMES.get(held, held)} quantscope "
                         f"wrote, not {_KIND_NAMES.get(what, what)}: overwrite replaces only "
                         f"an earlier output of the same kind; choose another output or "
                         f"remove it yourself")


def _check_removable(path: str) -> None:
    """Refuse a folder that this process could not empty once swapped out (a read-only
    folder in it, ``chmod 555``): its old files would stay behind under a hidden name."""
    below = (os.path.join(root, d) for root, dirs, _ in os.walk(path) for d in dirs)
    for folder in itertools.chain([path], below):
        if not os.path.islink(folder) and not os.access(folder, os.R_OK | os.W_OK | os.X_OK):
            raise PermissionError(f"output {path!r} cannot be replaced: {folder!r} is read-only"
                                  f" to this process (mode {os.stat(folder).st_mode & 0o7777:o}):"
                                  f" its old files could not be deleted; make it writable "
                                  f"(chmod -R u+w) or choose another output")


def check_writable_target(path, *, overwrite: bool = False, kind: str = "folder",
                          inputs=(), what: str | None = None) -> str:
    """The one output-path guard (module doc): refuse early what would fail late or destroy
    something. ``kind``: ``"folder"``, ``"file"`` (an exported ONNX model: replaces only
    quantscope's, never the model's weights) or ``"report"`` (a report or plot: replaces
    any file, and without ``overwrite`` one its folder lists as quantscope's); ``inputs``:
    the paths the command reads; ``what``: the kind of folder written (:func:`output_kind`;
    None: not checked). Returns the absolute path."""
    if kind not in ("folder", "file", "report"):
        raise ValueError(f"kind must be 'folder', 'file' or 'report', got {kind!r}")
    # before anything is written: bool("no") is True, and would replace the output
    check_bool("output", "overwrite", overwrite)
    given = check_path("output", path)
    if kind != "folder" and (given.endswith(tuple(filter(None, (os.sep, os.altsep))))
                             or os.path.basename(given) in (".", "..")):
        raise ValueError(f"output {given!r} is a folder path; expected a file path")
    path = os.path.abspath(given)
    _check_not_an_input(path, inputs)
    target = _through_link(path, kind)
    if os.path.lexists(target):
        _check_replaceable(target, overwrite, kind, what)
    probe = os.path.dirname(target)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"output {path!r}: {probe!r} is a file, not a folder")
    size = max(len(os.fsencode(name)) for name in target.split(os.sep))
    if size > _name_max(probe):  # now, not as an OSError on a temporary's name after the work
        raise ValueError(f"output {path!r}: a name in it is {size} bytes long; the file "
                         f"system takes names of at most {_name_max(probe)} bytes")
    try:  # create a file there: os.access says yes to root even on read-only file systems
        fd, name = tempfile.mkstemp(prefix=".quantscope-probe.", dir=probe)
        os.close(fd)
        os.remove(name)
    except OSError as e:
        raise PermissionError(f"output {path!r}: {probe!r} is not writable ({e.strerror})"
                              ) from None
    return path


def _name_max(folder: str) -> int:  # the longest name (bytes) its file system takes
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (AttributeError, OSError, ValueError):  # no pathconf (Windows), or no limit told
        return 255


def _temp_prefix(path: str) -> str:
    """``.NAME.``: NAME cut (at a UTF-8 character's start) so that with tempfile's 8
    characters and a 4-character suffix it fits NAME_MAX, however long the legal name."""
    name = os.fsencode(os.path.basename(path))
    cut = max(0, _name_max(os.path.dirname(path)) - 14)
    while 0 < cut < len(name) and name[cut] & 0xC0 == 0x80:  # a continuation byte
        cut -= 1
    return f".{os.fsdecode(name[:cut])}."


def _through_link(path: str, kind: str) -> str:
    """Where writing ``path`` lands: a folder's or exported file's symbolic link's target
    (``--out runs/latest``: the link kept, the target guarded); a report's link is replaced."""
    return os.path.realpath(path) if kind != "report" and os.path.islink(path) else path


def _umask() -> int:
    try:  # Linux says it without changing it (os.umask would, for every thread at once)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _public_modes(top: str, keep=()) -> None:
    """The modes any file the user writes gets (tempfile's are private: 0700 / 0600); the
    files named in ``keep`` (relative: copied from elsewhere) keep theirs, private or not."""
    mask = _umask()
    if os.path.isfile(top):
        os.chmod(top, 0o666 & ~mask)
        return
    os.chmod(top, 0o777 & ~mask)
    kept = {os.path.join(top, name) for name in keep}
    for root, dirs, files in os.walk(top):
        for name, mode in [(d, 0o777) for d in dirs] + [(f, 0o666) for f in files]:
            p = os.path.join(root, name)
            if not os.path.islink(p) and p not in kept:  # never what a link points at
                os.chmod(p, mode & ~mask)


def _swap_in(tmp: str, path: str, overwrite: bool, kind: str, what: str | None) -> None:
    """Put ``tmp`` at ``path`` (:func:`~.atomic_swap.swap_in`; the old output ends at ``tmp``),
    re-checking an existing ``path``: another writer's may have come meanwhile."""
    swap_in(tmp, path, lambda: _check_replaceable(path, overwrite, kind, what),
            _temp_prefix(path), _renameat2)  # looked up here: tests replace atomic._renameat2


@contextlib.contextmanager
def atomic_dir(path, *, overwrite: bool = False, inputs=(), keep_modes=(), what=None):
    """Yield a fresh temporary folder; on success it replaces ``path``, on error it is removed.
    ``path`` passes :func:`check_writable_target` (with ``inputs``) first, and gets the
    :data:`MARKER`. ``keep_modes``: the names (relative; a list may be filled in the block)
    of files copied from elsewhere, which keep their modes. ``what``: the kind written
    (:func:`output_kind`; default: told from the files), recorded in the marker."""
    path = _through_link(check_writable_target(path, overwrite=overwrite, inputs=inputs,
                                               what=what), "folder")
    parent = os.path.dirname(path)
    made = _made_parents(parent)
    try:
        tmp = tempfile.mkdtemp(prefix=_temp_prefix(path), suffix=".tmp", dir=parent)
        try:
            yield tmp
            what = what or output_kind(tmp)
            _write_marker(tmp, [rel for rel, _ in _entries(tmp)], what)  # complete: ours
            _public_modes(tmp, keep_modes)
            flush(tmp)
            _swap_in(tmp, path, overwrite, "folder", what)
            _flush_names(parent, made)
        finally:
            _remove(tmp)  # the failed build, or the replaced folder
    except BaseException:
        _unmake(made)
        raise


@contextlib.contextmanager
def atomic_file(path, *, overwrite: bool = True, inputs=(), kind: str = "report"):
    """Yield a temporary file path beside ``path``; on success it replaces ``path``. ``kind``:
    ``"report"`` (a report, a plot) or ``"file"`` (an export: :func:`check_writable_target`)."""
    path = _through_link(check_writable_target(path, overwrite=overwrite, kind=kind,
                                               inputs=inputs), kind)
    parent = os.path.dirname(path)
    made = _made_parents(parent)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=".tmp", dir=parent)
        os.close(fd)
        yield tmp
        _public_modes(tmp)
        flush(tmp)
        os.replace(tmp, path)  # a file: one atomic step, the target always exists
        _flush_names(parent, made)
        if kind == "report":  # an export is no part of the folder: unlisted, it is kept
            with contextlib.suppress(OSError):  # unlisted, the folder is refused, never lost
                _record(path)
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        _unmake(made)
        raise


def _made_parents(parent: str) -> list[str]:
    """Make ``parent`` and the missing folders above it; returns those made, innermost
    first, for :func:`_unmake` (a failed first write leaves no empty folders behind)."""
    made, p = [], os.path.abspath(parent)
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        made.append(p)
        p = os.path.dirname(p)
    os.makedirs(parent, exist_ok=True)
    return made


def _flush_names(parent: str, made: list[str]) -> None:
    """``fsync`` the entries naming a new output: ``parent``'s, and those of the folders
    above each folder :func:`_made_parents` made (else a power loss may lose the chain)."""
    for folder in (parent, *map(os.path.dirname, made)):
        flush_entries(folder)


def _unmake(made: list[str]) -> None:
    """Remove the folders :func:`_made_parents` made, innermost first, where still empty
    (another writer's output in one keeps it and those above)."""
    for p in made:
        try:
            os.rmdir(p)
        except OSError:
            return
