"""Rollout engine `sglang`: SGLang's in-process Engine, one per rank, colocated with the actor.

Select it with `rollout.name = "sglang"` (`pip install 'minirl[sglang]'`); sglang is imported only
when the engine is built. Its keys and what each version (0.4.10 to 0.5.23, found by api.detect,
checked by scripts/check_sglang_api.py) gets: docs/plugins.md. Tested on fakes (tests/fakes/sglang).
"""

from __future__ import annotations

import importlib.util

from minirl import hookimpl
from minirl.errors import UserError
from minirl.protocols import EngineContext


def build_sglang_engine(rollout_cfg, ctx: EngineContext):
    """factory(rollout_cfg, ctx) -> SGLangEngine."""
    from minirl_plugins.engines.sglang.api import detect
    from minirl_plugins.engines.sglang.engine import SGLangEngine

    api = detect()
    if getattr(rollout_cfg, "free_cache_engine", True) and importlib.util.find_spec("torch_memory_saver") is None:
        raise UserError(
            "rollout.free_cache_engine = true: SGLang's memory saver needs the torch_memory_saver package; "
            "pip install torch_memory_saver, or set rollout.free_cache_engine = false (the KV cache then stays)"
        )
    return SGLangEngine(rollout_cfg, ctx, api)


@hookimpl
def minirl_rollout_engines():
    return {"sglang": build_sglang_engine}
