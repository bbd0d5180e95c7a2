"""SGLangEngine: the RolloutEngine protocol over one in-process sglang Engine per rank.

Built on the rank's own GPU, tensor parallel 1, token ids in and out, dummy weights that the
actor's replace (docs/plugins.md). Its model directory holds only config.json, without
eos_token_id: stopping is then entirely the stop_token_ids each request sends (sampling.py).
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Iterable

import torch

from minirl.dist.spmd import free_port
from minirl.protocols import Completion, EngineContext, SamplingParams
from minirl_plugins.engines.sglang.api import SGLangAPI, unsupported
from minirl_plugins.engines.sglang.sampling import repeat_prompts, sampling_dict, to_completion
from minirl_plugins.engines.sglang.weights import WeightSync


class SGLangEngine:
    def __init__(self, rollout_cfg, ctx: EngineContext, api: SGLangAPI):
        self.api, self.eos_ids = api, tuple(ctx.eos_token_ids or ())
        self.memory_saver = bool(getattr(rollout_cfg, "free_cache_engine", True))
        self.released: tuple[str, ...] = ()
        self.model_dir = write_model_dir(ctx.model_config)
        api.patch_reductions()  # CUDA tensors pickle by GPU UUID, whatever each side's visible devices
        try:
            self.engine = api.engine_cls(**server_kwargs(rollout_cfg, ctx, api, self.model_dir, self.memory_saver))
        except BaseException:
            shutil.rmtree(self.model_dir, ignore_errors=True)
            raise
        bucket_mb = int(getattr(rollout_cfg, "update_weights_bucket_megabytes", 512))
        self.sync = WeightSync(api, self.engine, ctx.dtype, bucket_mb)
        if ctx.actor is not None:
            self.load_weights(ctx.actor.named_parameters())

    # ---------------------------------------------------------------------------- protocol

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """params.n samples per prompt, prompt-major; log-probs at the sampling temperature."""
        if not prompts:
            return []
        if params.n < 1 or params.max_new_tokens < 1:
            raise ValueError(f"SamplingParams n={params.n}, max_new_tokens={params.max_new_tokens}: both must be >= 1")
        if self.released:
            raise RuntimeError(f"sglang engine: generate() while {list(self.released)} are released; resume first")
        outputs = self.engine.generate(
            input_ids=repeat_prompts(prompts, params.n),
            sampling_params=sampling_dict(params, self.eos_ids),
            return_logprob=True,
        )
        return [to_completion(out, i) for i, out in enumerate(outputs)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Bucketed update_weights_from_tensor by Hugging Face name, then one cache flush."""
        self.sync(weights)

    def release_memory(self) -> None:
        """Free the KV cache (and CUDA graphs where the version can); the weights stay."""
        if self.memory_saver and not self.released:
            self.engine.release_memory_occupation(tags=list(self.api.memory_tags))
            self.released = self.api.memory_tags

    def resume_memory(self) -> None:
        """Re-acquire exactly what release_memory freed (0.5.x raises on any other tag)."""
        if self.released:
            self.engine.resume_memory_occupation(tags=list(self.released))
            self.released = ()

    # ---------------------------------------------------------------------------- extras

    def shutdown(self) -> None:
        """Stop SGLang's processes. Its shutdown kills every child of this process (SGLang's
        kill_process_tree), so call it only when no other child process of the rank matters."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()
        shutil.rmtree(self.model_dir, ignore_errors=True)


def server_kwargs(rollout_cfg, ctx: EngineContext, api: SGLangAPI, model_dir: str, memory_saver: bool) -> dict:
    """Engine(**kwargs): every key is checked against the installed ServerArgs' fields."""
    device = torch.device(ctx.device)
    kwargs = {
        "model_path": model_dir,
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "dtype": str(ctx.dtype).removeprefix("torch."),  # rollout.dtype: checked up front (minirl.validate)
        "mem_fraction_static": float(getattr(rollout_cfg, "gpu_memory_utilization", 0.5)),
        "enable_memory_saver": memory_saver,
        "tp_size": 1,
        "base_gpu_id": device.index or 0,  # in the rank's CUDA_VISIBLE_DEVICES numbering
        "random_seed": int(ctx.extra.get("seed", 0)),
        "port": free_port(),  # each rank's engine needs its own: fixed ports collide
        "nccl_port": free_port(),
        "log_level": "error",
        "disable_cuda_graph": bool(getattr(rollout_cfg, "enforce_eager", False)),
        "context_length": int(ctx.extra.get("max_model_len", ctx.model_config.max_position_embeddings)),
        "max_running_requests": int(getattr(rollout_cfg, "max_num_seqs", 1024)),
    }
    kv = getattr(rollout_cfg, "kv_cache_dtype", "auto")
    if kv != "auto":  # SGLang's names: fp8_e4m3, fp8_e5m2
        kwargs["kv_cache_dtype"] = "fp8_e4m3" if kv == "fp8" else kv
    unknown = sorted(set(kwargs) - api.server_args)
    if unknown:
        unsupported(f"SGLang {api.version}'s ServerArgs has no {unknown}")
    return kwargs


def write_model_dir(model_config) -> str:
    """A temporary directory with config.json only (dummy weights, no tokenizer)."""
    config = model_config.__class__.from_dict(model_config.to_dict())
    config.eos_token_id = None
    if not getattr(config, "architectures", None):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    path = tempfile.mkdtemp(prefix="minirl-sglang-")
    config.save_pretrained(path)
    return path
