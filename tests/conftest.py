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


def pytest_collection_modifyitems(config, items):
    """The learning runs (minutes each) first, then the other `slow` tests, then the rest, each
    group in its usual order: scripts/run_tests.sh hands tests to its pytest-xdist workers one at
    a time in this order, so the longest runs start at once and the short tests fill in around
    them, instead of one learning run left to finish alone at the end."""
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, "learns" not in item.name))
