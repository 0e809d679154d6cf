"""Shared test setup.

Under pytest-xdist (``make test`` runs ``-n 2``) every worker is its own process; with
torch's default of one thread per core, two workers oversubscribe a 2-core machine and
OpenMP's spinning threads slow small tensor ops 10-100x. One torch thread per worker.
"""

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
