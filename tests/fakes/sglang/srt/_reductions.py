"""The fake's monkey_patch_torch_reductions, re-exported where each version keeps it.

The real one makes CUDA tensors pickle by GPU UUID; CPU tensors need nothing. CALLS counts the
calls, so tests can see that the producer side made one before serializing."""

CALLS = [0]


def monkey_patch_torch_reductions():
    CALLS[0] += 1
