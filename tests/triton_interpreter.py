"""Triton's CPU interpreter, for the kernel tests on machines without a GPU (CI among them).

tests/conftest.py switches the interpreter on before anything imports triton; a kernel test
module calls require_interpreter() before it imports its kernels, and runs them inside
interpreter_fixes(), which works around two bugs of triton 3.6's interpreter.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch


def require_interpreter() -> None:
    """Fail (not skip: a skip would hide every kernel test) when triton was imported before
    TRITON_INTERPRET=1 could be set; else set it, for Triton reads it when it defines kernels."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 could be set (see tests/conftest.py)")
    os.environ["TRITON_INTERPRET"] = "1"


@contextlib.contextmanager
def interpreter_fixes():
    """While open: a loaded scalar (a 1-element array) serves as a loop bound, which triton 3.6
    does with int(array) and numpy >= 2.3 refuses; and a float rounds to fp8 to nearest even as
    the GPU rounds, where the interpreter truncates into the exponent (1.95 becomes 1.0 in e4m3,
    not 2.0), converted through torch, so kernels are checked against what they compute on
    hardware."""
    from triton.runtime import interpreter

    patch_tensor, convert_float = interpreter._patch_lang_tensor, interpreter._convert_float

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    fp8 = {3: torch.float8_e4m3fn, 2: torch.float8_e5m2}
    sources = {(32, 23): torch.float32, (16, 7): torch.bfloat16, (16, 10): torch.float16}

    def convert(input, input_dtype, output_dtype, rounding_mode):
        source = sources.get((input_dtype.primitive_bitwidth, input_dtype.fp_mantissa_width))
        if output_dtype.primitive_bitwidth != 8 or source is None:
            return convert_float(input, input_dtype, output_dtype, rounding_mode)
        values = torch.frombuffer(bytearray(input.tobytes()), dtype=source)
        return values.to(fp8[output_dtype.fp_mantissa_width]).view(torch.uint8).numpy().reshape(input.shape)

    interpreter._patch_lang_tensor, interpreter._convert_float = patched, convert
    try:
        yield
    finally:
        interpreter._patch_lang_tensor, interpreter._convert_float = patch_tensor, convert_float
