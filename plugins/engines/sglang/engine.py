"""SGLangEngine: the RolloutEngine protocol over one in-process sglang Engine per rank.

Built on the rank's own GPU, tensor parallel 1, token ids in and out, dummy weights that the
actor's replace (docs/plugins.md). Its model directory holds only config.json, without
eos_token_id: stopping is then entirely the stop_token_ids each request sends (sampling.py).

Request level: submit() queues turns (request_table.py); step() sends every queued turn in one
Engine.generate(input_ids=[...]) call and returns them all finished, so between steps nothing
runs inside SGLang. That is why abort, pause and continue need no SGLang call (its offline Engine
has none in 0.4.10 to 0.5.23; only its async TokenizerManager does): abort drops a queued turn,
pause refuses step() until continue. Agent loops get concurrency by calling step() often with
whatever is queued. A continuation sends its whole context; SGLang's radix cache finds the KV
of the earlier turns by prefix, as long as neither memory pressure, release_memory nor the
flush after a weight sync has dropped it (then it is prefilled again: slower, never wrong).
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Iterable

import torch

from minirl.dist.spmd import free_ports
from minirl.models.assembly import full_weights
from minirl.protocols import Completion, EngineContext, SamplingParams, TurnOutput, generate_batch
from minirl_plugins.engines.sglang.api import SGLangAPI, unsupported
from minirl_plugins.engines.sglang.request_table import Pending, RequestTable
from minirl_plugins.engines.sglang.sampling import aborted_turn, sampling_dict, shared_or_list, to_turn
from minirl_plugins.engines.sglang.weights import WeightSync


class SGLangEngine:
    def __init__(self, rollout_cfg, ctx: EngineContext, api: SGLangAPI):
        self.api, self.eos_ids = api, tuple(ctx.eos_token_ids or ())
        self.memory_saver = bool(getattr(rollout_cfg, "free_cache_engine", True))
        self.released: tuple[str, ...] = ()
        self.requests, self.paused = RequestTable(), False
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
            self.load_weights(full_weights(ctx.actor))  # merged, when the actor has LoRA adapters

    # ---------------------------------------------------------------------------- protocol

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue params.n samples (sample_ids), or continue a held one; see RolloutEngine.submit."""
        self.requests.submit(request_id, prompt_ids, params, sampling_dict(params, self.eos_ids))

    def step(self) -> list[TurnOutput]:
        """Run every queued turn to its end in one Engine.generate call; returns them in submit order."""
        if self.paused:
            raise RuntimeError("sglang engine: step() while generation is paused; call continue_generation() first")
        if self.released:
            raise RuntimeError(
                f"sglang engine: step() while {list(self.released)} are released; call resume_memory() first"
            )
        batch = self.requests.take()
        live = [p for p in batch if not p.aborted]
        turns = dict(zip((p.sample_id for p in live), self._generate(live)))
        for pending in batch:
            if pending.aborted:  # held with its prompt alone: no token was sampled
                turns[pending.sample_id] = aborted_turn(pending.sample_id)
            self.requests.finish(pending, turns[pending.sample_id].token_ids)
        return [turns[p.sample_id] for p in batch]

    def _generate(self, live: list[Pending]) -> list[TurnOutput]:
        if not live:
            return []
        outputs = self.engine.generate(
            input_ids=[p.prompt_ids for p in live],
            sampling_params=shared_or_list([p.sampling for p in live]),
            return_logprob=True,
        )
        return [to_turn(out, p.sample_id, p.held_len) for out, p in zip(outputs, live, strict=True)]

    def has_work(self) -> bool:
        return bool(self.requests.queued)

    def abort(self, request_id: str) -> None:
        """A queued turn comes back from the next step() with finish_reason "abort" and no tokens."""
        self.requests.abort(request_id)

    def release(self, request_id: str) -> None:
        """Forget a held context (SGLang's radix cache evicts its KV when it needs the room)."""
        self.requests.release(request_id)

    def pause_generation(self) -> None:
        """Nothing runs between steps, so pausing only makes step() refuse until continue."""
        self.paused = True

    def continue_generation(self) -> None:
        self.paused = False

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """params.n samples per prompt, prompt-major; log-probs at the sampling temperature."""
        if self.requests.queued:  # generate_batch would step them and drop their turns
            raise RuntimeError(
                f"sglang engine: generate() while {len(self.requests.queued)} submitted requests wait for step(); "
                f"step them first"
            )
        try:
            return generate_batch(self, prompts, params)
        except BaseException:  # a refused batch leaves nothing queued, as before the request level
            self.requests.take()
            raise

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
    port, nccl_port = free_ports(2)  # each rank's engine needs its own: fixed ports collide
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
        "port": port,
        "nccl_port": nccl_port,
        "log_level": "error",
        "disable_cuda_graph": bool(getattr(rollout_cfg, "enforce_eager", False)),
        "context_length": int(ctx.extra.get("max_model_len", ctx.model_config.max_position_embeddings)),
        "max_running_requests": int(getattr(rollout_cfg, "max_num_seqs", 1024)),
    }
    kv = getattr(rollout_cfg, "kv_cache_dtype", "auto")
    if kv != "auto":  # SGLang's names: fp8_e4m3, fp8_e5m2
        kwargs["kv_cache_dtype"] = "fp8_e4m3" if kv == "fp8" else kv
    if getattr(rollout_cfg, "quantization", "none") != "none":  # SGLang quantizes bf16 weights itself ("fp8")
        kwargs["quantization"] = rollout_cfg.quantization
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
