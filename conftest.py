"""Session-wide test set-up, read before any test module is imported.

Without a GPU, every Triton kernel in the suite runs under the interpreter. Triton decides at
``@triton.jit`` time whether a function is interpreted, so the variable must be set before
the first kernel module is imported by any test, in every xdist worker.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
