"""Triton's interpreter for tests/kernels/test_triton_*.py where no GPU is present.

Triton fixes a function's mode (compiled or interpreted) as it decorates it, its own
library's functions at ``import triton``: ``TRITON_INTERPRET`` must be in the environment
before that. pytest loads this file while collecting this folder; where a module collected
sooner imported triton already, tests/kernels/test_triton_kernels.py runs itself in a child
process instead. Where a GPU is present the kernels run compiled on it.
"""

import os
import sys

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
