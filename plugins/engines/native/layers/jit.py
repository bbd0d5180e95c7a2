"""Triton for the op modules, or stand-ins where it does not import (CPU installs), so that the
torch references beside the kernels run everywhere: there `triton` and `tl` are None, `jit`
leaves a kernel a plain function nothing launches, and UNAVAILABLE says why (select_ops warns).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    UNAVAILABLE = None
except Exception as exc:  # not installed, or broken
    triton = tl = None
    UNAVAILABLE = f"{type(exc).__name__}: {exc}"


def jit(fn):
    """triton.jit, or the function itself when there is no Triton (it is then never launched)."""
    return fn if triton is None else triton.jit(fn)
