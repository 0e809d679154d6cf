"""The embedded default data: the Lee corpus bundled with gensim's tests.

gensim is installed ``--no-deps`` as a data package: its files are found through
``importlib`` and read directly, never imported (its code needs scipy).

* ``lee_background.cor``: 300 news documents, one per line (calibration).
* ``lee.cor``: 50 documents (evaluation).
* ``similarities0-1.txt``: a 50 x 50 matrix of human similarity scores in [0, 1];
  row ``i``, column ``j`` scores documents ``i`` and ``j`` of ``lee.cor``. As
  gensim's own ``test_lee.py`` reads it, the 1,225 pairs are the strict upper
  triangle ``numpy.triu_indices(50, 1)`` (row-major: (0,1), (0,2) ... (48,49)).
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the CLI reads --calib-file before torch loads
    import torch

__all__ = ["lee_background", "lee_documents", "lee_pairs", "read_corpus", "test_data_dir"]


def test_data_dir() -> str:
    """gensim's ``test/test_data`` directory (without importing gensim)."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the Lee corpus comes with gensim's test data; install it with "
            "`pip install --no-deps gensim` (data only: quantscope never imports it)")
    path = os.path.join(next(iter(spec.submodule_search_locations)), "test", "test_data")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"gensim is installed but has no test data at {path}")
    return path


def read_corpus(path: str, encoding: str = "UTF-8") -> list[str]:
    """One document per non-empty line of a text file in ``encoding``: UTF-8 (a byte-order
    mark is dropped), as text is written today; the Lee files are latin-1 (``lee.cor``
    holds a 0xa3 pound sign), as gensim reads them."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus file {path!r} does not exist")
    with open(path, "rb") as f:
        raw = f.read()
    try:  # decoded whole, split at "\n" only: a line is never cut inside a character
        text = raw.decode(encoding).removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"corpus file {path!r} is not {encoding} text: byte "
                         f"0x{raw[e.start]:02x} at offset {e.start} (line {line}) {e.reason}; "
                         f"save it as {encoding}") from None
    docs = [d for d in (line.strip() for line in text.split("\n")) if d]
    if not docs:
        raise ValueError(f"corpus file {path!r} holds no text")
    return docs


def lee_background() -> list[str]:
    """The 300 calibration documents."""
    return read_corpus(os.path.join(test_data_dir(), "lee_background.cor"), "latin-1")


def lee_documents() -> list[str]:
    """The 50 evaluation documents."""
    return read_corpus(os.path.join(test_data_dir(), "lee.cor"), "latin-1")


def lee_pairs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(i, j, score)`` of the 1,225 human-scored document pairs (``i < j``)."""
    import torch

    path = os.path.join(test_data_dir(), "similarities0-1.txt")
    with open(path) as f:
        rows = [[float(v) for v in line.split()] for line in f if line.strip()]
    sim = torch.tensor(rows, dtype=torch.float64)
    n = sim.shape[0]
    if sim.shape != (n, n):
        raise ValueError(f"{path}: expected a square matrix, got shape {tuple(sim.shape)}")
    i, j = torch.triu_indices(n, n, offset=1)
    return i, j, sim[i, j]
