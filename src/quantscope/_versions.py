"""The oldest versions of the optional packages that quantscope's features were tested with
(``pyproject.toml`` declares the same in its extras), checked where such a feature starts:
an older transformers builds a checkpoint skeleton whose rotary tables are never computed
(sequential calibration then runs on garbage) and dispatches some attention around the
KV-cache hooks; an older compressed-tensors lacks the decoding API the reader calls."""

from __future__ import annotations

import functools
import re
from importlib import metadata

__all__ = ["MINIMUM", "require"]

#: distribution name -> oldest version tested
MINIMUM = {"transformers": "5.15", "compressed-tensors": "0.19"}


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"5.15.0.dev0"`` -> ``(5, 15, 0)``."""
    m = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


@functools.cache
def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def require(dist: str, who: str) -> None:
    """Raise ``ImportError`` naming ``who`` (the feature) unless ``dist`` is installed at
    :data:`MINIMUM`'s version or later."""
    want, have = MINIMUM[dist], _installed(dist)
    if have is None:
        raise ImportError(f"{who} needs {dist} >= {want}, which is not installed: "
                          f"pip install '{dist}>={want}'")
    if release(have) < release(want):
        raise ImportError(f"{who} needs {dist} >= {want}, found {have}: "
                          f"pip install -U '{dist}>={want}'")
