"""The source model folder of an export: what is copied from it and what is never written.

An export copies the folder's ``EXPORT_EXTRAS`` (tokenizer, generation config, chat
template), only its own files, beside the checkpoint; the folders the model came from are
inputs the export's target may never be (:func:`~.atomic.check_writable_target`), whatever
folder ``model_path`` names for the extras.
"""

from __future__ import annotations

import fnmatch
import os
import shutil

from .atomic import EXPORT_EXTRAS

__all__ = ["check_model_path", "copy_extras", "loaded_from", "own_file", "source_dir"]


def check_model_path(model_path, who: str) -> None:
    """Refuse a ``model_path`` that is no path (an int would be read as a file descriptor)."""
    if model_path is not None and not isinstance(model_path, (str, os.PathLike)):
        raise TypeError(f"{who}: model_path must be the source model's folder (a str or "
                        f"os.PathLike) or None, got {type(model_path).__name__} "
                        f"{model_path!r}")


def source_dir(calibration, model, model_path):
    """The model folder (one with a config.json) whose ``EXPORT_EXTRAS`` the export copies:
    ``model_path``, else the first of :func:`loaded_from`."""
    if not model_path:
        return next(iter(loaded_from(calibration, model)), None)
    if not _is_model_folder(model_path):
        raise ValueError(f"export: model_path {model_path!r} is not a model folder (a folder "
                         f"with a config.json)")
    return os.fspath(model_path)


def loaded_from(calibration, model) -> list[str]:
    """The model's folders, never written over: its own first (the model being exported),
    then the calibration's record (a file's say: another machine's path, anyone's edit)."""
    paths = (getattr(getattr(model, "config", None), "_name_or_path", None),
             calibration.info.get("model"))
    return [os.fspath(p) for p in paths if isinstance(p, (str, os.PathLike)) and p
            and _is_model_folder(p)]


def _is_model_folder(path) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def own_file(src: str, p: str) -> bool:
    """Whether ``p``, a name in the model folder ``src``, is the folder's own file: a plain
    file, or a link into the folder's own tree (a Hugging Face cache snapshot links every
    file into its repository's ``blobs/``), never a link elsewhere (a key, a user's notes)."""
    if not os.path.isfile(p) or not os.path.islink(p):
        return os.path.isfile(p)
    root = os.path.realpath(src)
    repo, parent = os.path.split(os.path.dirname(root))  # models--org--name/snapshots/rev
    cache = parent == "snapshots" and os.path.basename(repo).startswith("models--")
    own = (root, os.path.join(repo, "blobs")) if cache else (root,)  # not all of the parent
    return os.path.realpath(p).startswith(tuple(d + os.sep for d in own))


def copy_extras(src: str, dst: str) -> list[str]:
    """The ``EXPORT_EXTRAS`` of the source folder (tokenizer, generation config, chat template),
    with their own modes; only the folder's own files (:func:`own_file`), never ``dst``'s."""
    copied = []
    for name in sorted(os.listdir(src)):
        p = os.path.join(src, name)
        if not any(fnmatch.fnmatchcase(name, pat) for pat in EXPORT_EXTRAS) \
                or not own_file(src, p):
            continue
        if not os.path.exists(os.path.join(dst, name)):
            shutil.copy2(p, os.path.join(dst, name))
            copied.append(name)
    return copied
