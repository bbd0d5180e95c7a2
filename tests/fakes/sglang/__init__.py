"""A fake of the `sglang` package for minirl's tests: never installed, put on sys.path by tests.

It mirrors the parts of SGLang 0.4.10, 0.5.14 and 0.5.23 that minirl's plugin uses: the offline
Engine's signatures, return shapes and refusals (srt/entrypoints/engine.py), ServerArgs, the
serializer and its unpickling rules, FlattenedTensorBucket, the memory-occupation tags. Its
"scheduler" runs a tiny transformers model in this process (srt/managers/scheduler.py), so
outputs are real tokens and log-probs. The version comes from MINIRL_FAKE_SGLANG (_profile.py).
"""

from sglang._profile import VERSION as __version__  # noqa: N811

__all__ = ["__version__", "Engine"]


def __getattr__(name):
    if name == "Engine":  # lazy, as in the real package
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)
