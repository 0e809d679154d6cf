"""The one place that asks transformers for a folder's config, model, tokenizer or model class.

A folder's ``config.json`` (or ``tokenizer_config.json``) may name Python files of the folder
(``auto_map``) that transformers imports and runs, after asking on stdin when
``trust_remote_code`` is left unset. quantscope never lets it ask: every call passes
``trust_remote_code`` explicitly (False unless the caller passes True), and a folder that
needs its own code is refused before transformers sees it, with an error naming the option.
"""

from __future__ import annotations

import contextlib
import os

from ..._jsonfile import read_json

__all__ = ["ConfigTooLarge", "RemoteCodeRefused", "check_no_remote_code", "load_config",
           "load_tokenizer", "model_class", "parameter_budget", "pretrained"]


class RemoteCodeRefused(ValueError):
    """A folder needs its own Python code and ``trust_remote_code`` was not passed."""


class ConfigTooLarge(ValueError):
    """A config describes a model far larger than the checkpoint beside it."""


@contextlib.contextmanager
def parameter_budget(tensors: int, where: str):
    """Refuse, inside the block, a model build that registers far more parameters than the
    checkpoint's ``tensors``. Every parameter of a checkpoint's model is on disk (a few tied,
    a few registered twice), so a damaged size (num_hidden_layers, num_local_experts of
    10**11) is caught before it builds millions of modules: on the meta device they cost
    no tensor memory, only Python objects, enough of them to exhaust the host's."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    limit, count = 8 * tensors + 1024, 0

    def count_one(module, name, param):
        nonlocal count
        count += 1
        if count > limit:
            raise ConfigTooLarge(
                f"{where}: the model it describes has more than {limit} parameters, where "
                f"the checkpoint holds {tensors} tensors (a damaged size: layers, experts?)")

    handle = register_module_parameter_registration_hook(count_one)
    try:
        yield
    finally:
        handle.remove()


def _read_json(path: str, who: str) -> dict:
    data = read_json(path, who)
    if not isinstance(data, dict):
        raise ValueError(  # noqa: TRY004 (a bad file is a ValueError naming it)
            f"{who}: {path} holds a {type(data).__name__}, not a JSON object")
    return data


def _needs_code(config: dict) -> str | None:
    """Why the config needs the folder's code (None when transformers has its classes)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    known = isinstance(model_type, str) and model_type in CONFIG_MAPPING
    if "auto_map" in config and not known:
        return f"its auto_map names the folder's own code for model_type {model_type!r}"
    if model_type is not None and not known:
        return f"transformers has no model_type {model_type!r}"
    return None


_FILES = ("config.json", "tokenizer_config.json")


def check_no_remote_code(path, who: str = "load", trust_remote_code: bool = False,
                         files=_FILES) -> None:
    """Refuse a folder whose config (``files``: or tokenizer config) needs its own code."""
    if trust_remote_code is True:
        return
    if trust_remote_code is not False:
        raise ValueError(f"{who}: trust_remote_code must be True or False, "
                         f"got {trust_remote_code!r}")
    for name in files:
        file = os.path.join(os.fspath(path), name)
        if not os.path.isfile(file):
            continue
        data = _read_json(file, who)
        why = _needs_code(data) if name == "config.json" else (
            "its auto_map names the folder's own tokenizer code" if "auto_map" in data and
            "tokenizer_class" not in data else None)
        if why:
            raise RemoteCodeRefused(
                f"{who}: {file}: {why}; quantscope runs no code from a model folder unless "
                f"you pass trust_remote_code=True (only for a folder you trust)")


def load_config(path, who: str = "load", trust_remote_code: bool = False):
    """``transformers.AutoConfig`` of the folder, never running its code unless trusted."""
    import transformers

    check_no_remote_code(path, who, trust_remote_code, ("config.json",))
    try:
        return transformers.AutoConfig.from_pretrained(os.fspath(path),
                                                       trust_remote_code=trust_remote_code)
    except OSError:  # a file transformers could not open, named (callers check config.json)
        raise
    except Exception as e:  # noqa: BLE001 -- a damaged config fails deep in transformers
        # (a ValueError on a null model_type that names no file, a KeyError ...)
        file = os.path.join(os.fspath(path), "config.json")
        raise ValueError(f"{who}: {file}: transformers cannot read it "
                         f"({type(e).__name__}: {e})") from None


def load_tokenizer(path, who: str = "load", trust_remote_code: bool = False, **kwargs):
    """``transformers.AutoTokenizer`` of the folder, never running its code unless trusted."""
    import transformers

    check_no_remote_code(path, who, trust_remote_code, ("tokenizer_config.json",))
    try:
        return transformers.AutoTokenizer.from_pretrained(
            os.fspath(path), trust_remote_code=trust_remote_code, **kwargs)
    except OSError:  # a file transformers could not open: it names it
        raise
    except Exception as e:  # noqa: BLE001 -- a damaged tokenizer.json fails in the tokenizers
        # library ("expected , or } at line 1 column 888"), naming no file
        raise ValueError(f"{who}: the tokenizer of {os.fspath(path)!r} cannot be read "
                         f"({type(e).__name__}: {e})") from None


def pretrained(auto_cls, path, who: str = "load", trust_remote_code: bool = False, **kwargs):
    """``auto_cls.from_pretrained(path)`` (an ``AutoModel*`` class), never running the
    folder's code unless trusted."""
    check_no_remote_code(path, who, trust_remote_code)
    return auto_cls.from_pretrained(os.fspath(path), trust_remote_code=trust_remote_code,
                                    **kwargs)


def model_class(architectures, where: str):
    """The first of ``architectures`` that names a transformers *model class* (a subclass of
    ``PreTrainedModel``); any other attribute of transformers (``set_seed``) is not one."""
    import transformers

    if not isinstance(architectures, list) or not all(isinstance(a, str)
                                                      for a in architectures):
        raise ValueError(f"{where}: architectures must be a list of class names, "
                         f"got {architectures!r}")
    for name in architectures:
        try:
            cls = getattr(transformers, name, None)
        except (AttributeError, ImportError, RuntimeError):  # lazy module: missing extras
            cls = None
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    raise ValueError(f"{where}: architectures {architectures} names no transformers model "
                     f"class")
