"""The check a kernel passes before it is installed: one run on the device next to its torch reference.

A kernel that cannot build or run there (triton broken, tiles too large for the GPU's shared
memory) or that is off its reference is not used: its caller warns, naming what turns the kernel
on, and keeps the torch path, so a broken kernel costs speed, never correctness. Users: the fused
log-prob head, the fused MLP and the native rollout engine's Triton ops.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


class Mismatch(AssertionError):
    """The kernel ran but its outputs are off the reference's; the message says how."""


def self_check(check: Callable[[], None], device: torch.device | str, failed: str = "failed") -> str | None:
    """Run `check` (the kernel and its reference on small inputs, compared with expect_close or
    expect_near) and say why the kernel cannot be used, or None when it can: the Mismatch's
    message, or f"{failed} (ErrorType: message)" for anything the kernel raised. It runs with
    gradients on, outside inference mode and autocast: the verdict is the same in any caller's mode.
    """
    device_type = torch.device(device).type
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device_type, enabled=False):
            check()
    except Mismatch as exc:
        return str(exc)
    except Exception as exc:  # the kernel could not be built or run here
        return f"{failed} ({type(exc).__name__}: {str(exc)[:200]})"
    return None


def expect_close(
    got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], rtol: float, atol: float, problem: str
) -> None:
    """Raise Mismatch(problem) unless each pair is allclose (NaN anywhere fails)."""
    if not all(torch.allclose(a, b, rtol=rtol, atol=atol) for a, b in zip(got, want, strict=True)):
        raise Mismatch(problem)


def expect_near(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Raise Mismatch unless ‖got − want‖ / ‖want‖ is below 1e-4 in float32, 2e-2 in a half
    precision `dtype` (a few roundings of 8 mantissa bits; a wrong index or mask is far off)."""
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    got, want = got.float(), want.float()
    err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
    if not err < tol:  # also catches NaN
        raise Mismatch(f"disagrees with its torch reference ({what}: relative error {err:.2e} > {tol:.0e})")
