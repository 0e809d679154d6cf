"""A context in which the toolkits' loggers and warnings stay quiet (llm-compressor logs each
observer it builds), for the compat tests that run theirs beside ours."""

from __future__ import annotations

import contextlib
import logging
import warnings


@contextlib.contextmanager
def quiet():
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)
