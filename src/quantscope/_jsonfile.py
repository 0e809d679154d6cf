"""Reading a JSON file someone else may have written: one reader, one set of messages.

``json`` turns a file nested 10**5 levels deep into a bare ``RecursionError`` (and a huge
one into ``MemoryError``) that names no file. Every reader of quantscope's inputs (a saved
calibration, a checkpoint's ``config.json`` and index, a recipe file, a compare report)
goes through :func:`read_json` / :func:`parse_json`, so each of these is a ``ValueError``
naming the file (docs/SECURITY.md).
"""

from __future__ import annotations

import json
import os

__all__ = ["PARSER_LIMITS", "NotJSON", "parse_json", "parser_limit", "read_json"]

#: what a parser (``json``, PyYAML) raises on a file nested too deeply or too large
PARSER_LIMITS = (RecursionError, MemoryError)


class NotJSON(ValueError):
    """The text is no JSON syntax (``error``: the decoder's): a reader that also takes
    another syntax (a YAML recipe file) tries that one."""

    def __init__(self, message: str, error: json.JSONDecodeError):
        super().__init__(message)
        self.error = error


def parser_limit(where: str, error: BaseException) -> ValueError:
    """The error for a file (``where``: the caller and the file) that a parser gave up on
    with one of :data:`PARSER_LIMITS`: the same words for JSON and YAML."""
    why = "nested too deeply" if isinstance(error, RecursionError) else "too large"
    return ValueError(f"{where} cannot be read: its data is {why} to parse "
                      f"({type(error).__name__})")


def parse_json(text: str, where: str, object_pairs_hook=None):
    """``json.loads(text)``; a syntax error is :class:`NotJSON`, a parser limit or an integer
    too long for Python a ``ValueError``, each naming ``where``."""
    try:
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    except json.JSONDecodeError as e:
        raise NotJSON(f"{where} is not valid JSON ({e})", e) from None
    except PARSER_LIMITS as e:
        raise parser_limit(where, e) from None
    except ValueError as e:  # an integer past Python's digit limit (sys.set_int_max_str_digits)
        raise ValueError(f"{where} cannot be read: {e}") from None


def read_json(path, who: str, object_pairs_hook=None):
    """The data of the JSON file ``path``, read by ``who`` (the caller's name, first in
    every message). A file that is not UTF-8 JSON, nests too deeply or cannot be read is a
    ``ValueError`` naming ``who`` and the file; a missing one stays ``FileNotFoundError``."""
    where = f"{who}: {os.fspath(path)}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ValueError(f"{where} cannot be read ({e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not valid JSON (not UTF-8 text: {e})") from None
    return parse_json(text, where, object_pairs_hook)
