"""Session-wide set-up of the test suite."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's CPU interpreter must be switched on before anything imports triton, and
    # transformers imports it on import: tests/unit/test_native_triton.py runs the native
    # engine's kernels under the interpreter on machines without a GPU (CI among them).
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    tiny tensors only gain contention from more on a shared 2-core machine, and a long learning
    trajectory is chaotic, so BLAS reductions that round differently at 1 and 2 threads would make
    it depend on the machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
