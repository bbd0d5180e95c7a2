"""The native rollout engine: the RolloutEngine protocol over scheduler, block manager and runner.

generate() runs a pipelined loop: it queues step t+1 on the device before reading step t's
tokens back, so the host's bookkeeping overlaps the device's work. A sequence that stopped at
step t has then already been given step t+1; that token is dropped.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch

from minirl.protocols import Completion, EngineContext, SamplingParams
from minirl_plugins.engines.native.config import EngineConfig
from minirl_plugins.engines.native.engine.block_manager import BlockManager
from minirl_plugins.engines.native.engine.model_runner import ModelRunner, StepResult
from minirl_plugins.engines.native.engine.scheduler import OutOfPages, PrefillBatch, Scheduler
from minirl_plugins.engines.native.engine.sequence import Group, Sequence, Status
from minirl_plugins.engines.native.layers.meta import StepMeta
from minirl_plugins.engines.native.layers.ops import select_ops
from minirl_plugins.engines.native.layers.sampling import SamplerState
from minirl_plugins.engines.native.models.decoder import DecoderLM
from minirl_plugins.engines.native.models.spec import ModelSpec
from minirl_plugins.engines.native.weights import init_random, iter_checkpoint, load_weights, weights_checksum


class NativeEngine:
    def __init__(self, cfg: EngineConfig, ctx: EngineContext):
        self.cfg, self.device, self.dtype = cfg, torch.device(ctx.device), ctx.dtype
        self.eos_ids = frozenset(ctx.eos_token_ids or ())
        self.spec = ModelSpec.from_hf_config(ctx.model_config)
        self.ops = select_ops(self.device, self.dtype, cfg.use_triton, cfg.kv_cache_dtype)
        with torch.device(self.device):
            self.model = DecoderLM(self.spec, self.ops, self.dtype).eval()
        self._init_weights(ctx)
        self.runner = ModelRunner(self.model, cfg, self.ops, self.device, self.dtype)
        self.runner.allocate_kv()
        self.last_stats: dict = {}  # of the last generate (and the release after it)
        self._resume_s = 0.0

    def _init_weights(self, ctx: EngineContext) -> None:
        if ctx.actor is not None:
            self.load_weights(ctx.actor.named_parameters())
        elif ctx.extra.get("path"):
            self.load_weights(iter_checkpoint(ctx.extra["path"], self.device))
        else:
            init_random(self.model, self.spec.initializer_range, int(ctx.extra.get("seed", 0)))

    # ---------------------------------------------------------------------------- protocol

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """params.n samples per prompt, prompt-major; log-probs of the sampled tokens."""
        self._validate(prompts, params)
        self.resume_memory()
        captures = dict(self.runner.capture_stats)
        blocks = BlockManager(self.runner.num_pages, self.cfg.page_size, self.cfg.max_num_seqs)
        scheduler = Scheduler(blocks, self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens, self.cfg.decode_steps)
        seqs = self._add_requests(scheduler, prompts, params)
        # without a seed, follow torch's global RNG (torch.manual_seed makes runs repeatable)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 1 << 31, ()).item())
        sampler = self.runner.new_sampler(params, seed)
        self._run(scheduler, sampler)
        self.last_stats = {
            "preemptions": scheduler.num_preemptions,
            "host_wait_s": self._host_wait,
            "kv_resume_s": self._resume_s,
            **{k: v - captures[k] for k, v in self.runner.capture_stats.items()},
        }
        self._resume_s = 0.0
        return [seq.to_completion() for seq in seqs]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy weights in place by Hugging Face name; captured graphs stay valid."""
        load_weights(self.model, weights)
        if self.device.type == "cuda":  # the copies are done when the caller times them
            torch.cuda.synchronize(self.device)

    def release_memory(self) -> None:
        start = time.perf_counter()
        self.runner.release()
        self.last_stats["kv_release_s"] = time.perf_counter() - start

    def resume_memory(self) -> None:
        """Allocate the KV cache if it was released; its seconds go to the next generate's
        last_stats (kv_resume_s), with the seconds spent re-capturing CUDA graphs into it."""
        if self.runner.kv is not None:
            return
        start = time.perf_counter()
        self.runner.allocate_kv()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._resume_s += time.perf_counter() - start

    # ---------------------------------------------------------------------------- extras

    def checksum(self, dtype: torch.dtype | None = None) -> int:
        """weights_checksum of the engine's weights; compare with the same over the actor's."""
        return weights_checksum(self.model.named_parameters(), dtype or self.dtype)

    @torch.inference_mode()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        """logits_TV of every position of one token sequence (for tests and re-scoring), through
        the prefill path over a scratch KV cache: the engine's own cache and state are untouched."""
        n = len(tokens)
        pos = torch.arange(n, device=self.device)
        cu = torch.tensor([0, n], dtype=torch.int32, device=self.device)
        meta = StepMeta(True, pos, self.runner.new_kv(n), cu_seqlens_S1=cu, max_seqlen=n)
        h = self.model(torch.tensor(tokens, device=self.device), pos, meta, self.runner.rope)
        return self.model.compute_logits(h)

    # ---------------------------------------------------------------------------- internals

    def _validate(self, prompts, params: SamplingParams) -> None:
        if params.n < 1 or params.max_new_tokens < 1:
            raise ValueError(f"SamplingParams n={params.n}, max_new_tokens={params.max_new_tokens}: both must be >= 1")
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise ValueError(
                f"SamplingParams temperature={params.temperature} must be >= 0 and top_p={params.top_p} in (0, 1]"
            )
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if len(prompt) + params.max_new_tokens > self.cfg.max_model_len:
                raise ValueError(
                    f"prompt {i}: {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} exceed "
                    f"max_model_len {self.cfg.max_model_len}; raise ctx.extra['max_model_len']"
                )
            if max(prompt) >= self.spec.vocab_size or min(prompt) < 0:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.spec.vocab_size})")

    def _add_requests(self, scheduler: Scheduler, prompts, params: SamplingParams) -> list[Sequence]:
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        seqs = []
        for prompt in prompts:
            group = [Sequence(list(prompt), params.max_new_tokens, stop) for _ in range(params.n)]
            seqs += group
            # a group larger than the batch limit is prefilled in parts
            for start in range(0, len(group), self.cfg.max_num_seqs):
                scheduler.add(Group(group[start : start + self.cfg.max_num_seqs]))
        return seqs

    def _run(self, scheduler: Scheduler, sampler: SamplerState) -> None:
        pending: StepResult | None = None
        self._host_wait = 0.0
        while not scheduler.is_done() or pending is not None:
            try:
                batch = scheduler.schedule()
            except OutOfPages:
                if pending is None:
                    scheduler.preempt_newest()
                else:
                    self._postprocess(scheduler, pending)
                    pending = None
                continue
            if batch is None and pending is None:
                scheduler.check_progress()
                raise RuntimeError("native engine: nothing to schedule and nothing in flight")
            result = None
            if batch is not None:
                run = self.runner.prefill if isinstance(batch, PrefillBatch) else self.runner.decode
                result = run(batch, sampler)
            if pending is not None:
                self._postprocess(scheduler, pending)
            pending = result

    def _postprocess(self, scheduler: Scheduler, result: StepResult) -> None:
        start = time.perf_counter()
        tokens, logprobs = result.fetch()
        self._host_wait += time.perf_counter() - start  # time the host had nothing to do
        for seq, seq_tokens, seq_logprobs in zip(result.seqs, tokens, logprobs):
            if seq.status is not Status.RUNNING:
                continue  # stopped in an earlier batch; these tokens were sampled past its end
            seq.extend(seq_tokens, seq_logprobs)
            if seq.status is Status.FINISHED:
                scheduler.finish(seq)
