"""Rollout engine `sglang`: SGLang's in-process Engine, one per rank, colocated with the actor.

Select it with `rollout.name = "sglang"`; install SGLang with `pip install 'minirl[sglang]'`.
Nothing here imports sglang until the engine is built. Config keys it reads:
gpu_memory_utilization (SGLang's mem_fraction_static: a share of the GPU's *total* memory for its
weights and KV cache, so leave the actor room), free_cache_engine (SGLang's memory saver, which
needs the torch_memory_saver package), update_weights_bucket_megabytes, max_num_seqs
(max_running_requests), enforce_eager (disable_cuda_graph). ctx.extra: max_model_len, seed.

What each SGLang version gets (found by inspection, api.detect; checked against the newest
wheel by scripts/check_sglang_api.py):

| SGLang               | weight payload                          | weight session          | release tags         |
|----------------------|-----------------------------------------|-------------------------|----------------------|
| 0.4.10               | (name, tensor) lists                    | none                    | kv_cache             |
| 0.5.5 to before 0.5.14 | flattened buckets, one dtype per bucket | none                  | kv_cache, cuda_graph |
| 0.5.14 - 0.5.20      | flattened buckets, mixed dtypes         | none                    | kv_cache, cuda_graph |
| 0.5.21 - 0.5.23      | flattened buckets, mixed dtypes         | begin/end_weight_update | kv_cache, cuda_graph |

Rows 0.4.10, 0.5.14 and 0.5.23 are read from those wheels' source; the 0.5.5 row is from notes.
Tested against a fake of 0.4.10, 0.5.14 and 0.5.23 (tests/fakes/sglang); never against a real
SGLang on a GPU (docs/benchmarks.md says why).
"""

from __future__ import annotations

import importlib.util

from minirl import hookimpl
from minirl.errors import UserError
from minirl.protocols import EngineContext

__all__ = ["build_sglang_engine"]


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
