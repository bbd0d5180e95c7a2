"""Triton for the op modules, or stand-ins where it is missing, so that they import everywhere.

Each op module holds its torch reference beside its Triton kernel; the references must run where
triton is not installed (CPU installs) or does not import. There `triton` and `tl` are None,
`jit` leaves a kernel a plain function that nothing launches, and UNAVAILABLE says why, for the
warning of select_ops, which then keeps the references.
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
