"""``python -m quantscope``: the command line (see :mod:`quantscope.cli`)."""

import sys

from .cli import main

sys.exit(main())
