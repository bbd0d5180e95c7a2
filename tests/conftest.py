"""Session-wide set-up of the test suite."""

import os

import torch

if not torch.cuda.is_available():
    # Triton's CPU interpreter must be switched on before anything imports triton, and
    # transformers imports it on import: tests/unit/test_native_triton.py runs the native
    # engine's kernels under the interpreter on machines without a GPU (CI among them).
    os.environ.setdefault("TRITON_INTERPRET", "1")
