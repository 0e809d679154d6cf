"""``python -m quantscope.cli``: the command line, as ``quantscope`` and
``python -m quantscope``."""

import sys

from . import main

sys.exit(main())
