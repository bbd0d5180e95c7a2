"""minirl: reinforcement-learning post-training of LLMs in plain PyTorch.

Write a plugin with ``minirl.hookimpl``; run a job with ``python -m minirl --config FILE``.
"""

from minirl.hookspecs import hookimpl

__all__ = ["hookimpl"]
__version__ = "0.1.0"
