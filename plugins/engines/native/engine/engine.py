"""The native rollout engine: the RolloutEngine protocol over scheduler, block manager and runner.

step() is one turn of a pipelined loop: it queues step t+1 on the device before reading step t's
tokens back, so the host's bookkeeping overlaps the device's work. A sequence that stopped at
step t has then already been given step t+1; that token is dropped. generate() submits every
prompt and steps until all finished (minirl.protocols.generate_batch).

A request's turn that ends keeps its KV pages (the scheduler parks it) until release(): its
next turn, submitted under the same id with the conversation so far plus new tokens, prefills
only the new tokens, attending to the cached ones (extend attention).
"""

from __future__ import annotations

import time
import warnings
from typing import Iterable

import torch

from minirl.models.assembly import full_weights
from minirl.observe.memory import GIB, StorageCounter
from minirl.protocols import Completion, EngineContext, SamplingParams, TurnOutput, generate_batch, sample_ids
from minirl_plugins.engines.native.config import EngineConfig
from minirl_plugins.engines.native.engine.block_manager import BlockManager
from minirl_plugins.engines.native.engine.model_runner import ModelRunner, StepResult
from minirl_plugins.engines.native.engine.scheduler import OutOfPages, PrefillBatch, Scheduler
from minirl_plugins.engines.native.engine.sequence import Group, Sequence, Status
from minirl_plugins.engines.native.layers.meta import StepMeta
from minirl_plugins.engines.native.layers.ops import select_ops
from minirl_plugins.engines.native.models.decoder import DecoderLM
from minirl_plugins.engines.native.models.spec import ModelSpec
from minirl_plugins.engines.native.weights import (
    init_random,
    iter_checkpoint,
    load_weights,
    share_weights,
    weights_checksum,
)


class NativeEngine:
    def __init__(self, cfg: EngineConfig, ctx: EngineContext):
        self.cfg, self.device, self.dtype = cfg, torch.device(ctx.device), ctx.dtype
        self.eos_ids = frozenset(ctx.eos_token_ids or ())
        self.spec = ModelSpec.from_hf_config(ctx.model_config)
        self.ops = select_ops(self.device, self.dtype, cfg.use_triton, cfg.kv_cache_dtype, cfg.quantization)
        with torch.device(self.device):
            self.model = DecoderLM(self.spec, self.ops, self.dtype).eval()
            self.fp8_matrices = self._quantize(cfg.quantization)
        self._init_weights(ctx)
        self.runner = ModelRunner(self.model, cfg, self.ops, self.device, self.dtype)
        self.runner.allocate_kv()
        self.last_stats: dict = {}  # of the last generate (and the release after it)
        self._resume_s = self._host_wait = 0.0
        self.requests: dict[str, Sequence] = {}  # sample id -> its sequence, until release()
        self.scheduler: Scheduler | None = None  # of the current busy period (and the held requests)
        self.sampler, self.sampler_setting = None, None
        self.pending: StepResult | None = None  # the step in flight
        self.finished: list[TurnOutput] = []  # turns ended since the last step() returned
        self.paused = False
        self.weight_version = 0  # stamped on every token sampled (asynchronous training sets it)

    def _init_weights(self, ctx: EngineContext) -> None:
        self.shared: frozenset[str] = frozenset()  # parameters that are the actor's own tensors
        if ctx.actor is not None:
            self.shared = share_weights(self.model, ctx.shared)  # first: nothing is copied into them
            if self.shared and self.device.type == "cuda":
                torch.cuda.empty_cache()  # the copies' memory goes to the KV cache, sized next
            self.load_weights(full_weights(ctx.actor))  # merged, when the actor has LoRA adapters
        elif ctx.extra.get("path"):
            self.load_weights(iter_checkpoint(ctx.extra["path"], self.device))
        else:
            init_random(self.model, self.spec.initializer_range, int(ctx.extra.get("seed", 0)))
            self.model.refresh_fp8()

    def _quantize(self, quantization: str) -> int:
        """rollout.quantization = "fp8": e4m3 copies of the layers' matrices; how many."""
        if quantization != "fp8":
            return 0
        why = self.model.fp8_unsupported()
        if why is None and self.device.type == "cuda" and "scaled_mm" not in self.ops.chosen:
            why = "this GPU has no fp8 GEMMs (they need compute capability 8.9 or later: H100, L40S, RTX 4090 ...)"
        if why is not None:
            warnings.warn(
                f"native engine: rollout.quantization = 'fp8' does not apply: {why}; the engine runs in "
                f"{self.dtype}. Set rollout.quantization = 'none' to silence this."
            )
            return 0
        return self.model.quantize_fp8()

    # ---------------------------------------------------------------------------- request level

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue params.n samples (sample_ids) sharing one prefill, or continue a held request."""
        self._validate([prompt_ids], params)
        held = self.requests.get(request_id)
        if held is not None:
            self._continue(held, prompt_ids, params)
            return
        ids = sample_ids(request_id, params.n)
        taken = [i for i in ids if i in self.requests]
        if taken:
            raise ValueError(f"native engine: request id {taken[0]!r} is held; release it or use a new id")
        self._start_sampler(params)
        stop = self._stop_ids(params)
        seqs = [Sequence(i, list(prompt_ids), params.max_new_tokens, stop) for i in ids]
        self.requests.update(zip(ids, seqs))
        if params.n == 1 and self._joins_last_group(seqs[0]):
            self.scheduler.waiting[-1].seqs.append(seqs[0])
            return
        # a group larger than the batch limit is prefilled in parts
        for start in range(0, len(seqs), self.cfg.max_num_seqs):
            self.scheduler.add(Group(seqs[start : start + self.cfg.max_num_seqs]))

    def step(self) -> list[TurnOutput]:
        """One iteration of the pipelined loop: schedule and launch a step, then read back the
        previous one (or drain the pipeline and preempt when pages run out)."""
        if self.paused:
            raise RuntimeError("native engine: step() while paused; call continue_generation() first")
        scheduler, pending = self.scheduler, self.pending
        try:
            batch = scheduler.schedule()
        except OutOfPages:
            if pending is None:
                scheduler.preempt_newest()
            else:
                self.pending = None
                self._postprocess(pending)
                if not self.has_work():
                    self._end_period()
            return self._take_finished()
        if batch is None and pending is None:
            scheduler.check_progress()
            raise RuntimeError("native engine: nothing to schedule and nothing in flight")
        result = None
        if batch is not None:
            run = self.runner.prefill if isinstance(batch, PrefillBatch) else self.runner.decode
            result = run(batch, self.sampler)
            result.version = self.weight_version
        self.pending = result
        if pending is not None:
            self._postprocess(pending)
        if not self.has_work():
            self._end_period()
        return self._take_finished()

    def has_work(self) -> bool:
        return self.scheduler is not None and (not self.scheduler.is_done() or self.pending is not None)

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is None or seq.status is Status.FINISHED:
            return
        self.scheduler.drop(seq)  # its KV goes: a continuation prefills it again
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        self.finished.append(seq.to_turn())

    def release(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None and self.scheduler is not None:
            self.scheduler.drop(seq)

    def pause_generation(self) -> None:
        """Read back the step in flight; until continue_generation nothing runs on the device."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._postprocess(pending)
        self.paused = True

    def continue_generation(self) -> None:
        self.paused = False

    # ---------------------------------------------------------------------------- batch level

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """params.n samples per prompt, prompt-major; log-probs of the sampled tokens."""
        self._validate(prompts, params)
        return generate_batch(self, prompts, params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy weights in place by Hugging Face name; captured graphs stay valid."""
        load_weights(self.model, weights, self.shared)
        self.model.refresh_fp8()  # the e4m3 copies, when rollout.quantization = "fp8"
        if self.device.type == "cuda":  # the copies are done when the caller times them
            torch.cuda.synchronize(self.device)

    def release_memory(self) -> None:
        """Free the KV cache; held requests keep their tokens (a continuation prefills again)."""
        if self.has_work():
            raise RuntimeError("native engine: release_memory() with requests in flight; finish or abort them first")
        start = time.perf_counter()
        for seq in list(self.requests.values()):
            self.scheduler.drop(seq)  # frees the pages' bookkeeping; the request stays held
        self.scheduler = None
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

    def _continue(self, seq: Sequence, prompt_ids: list[int], params: SamplingParams) -> None:
        if seq.status is not Status.FINISHED:
            raise ValueError(f"native engine: request {seq.request_id!r} is still running; wait for its turn to finish")
        if params.n != 1:
            raise ValueError(f"native engine: continuing request {seq.request_id!r} needs n = 1, got {params.n}")
        context = seq.tokens
        if prompt_ids[: len(context)] != context:
            raise ValueError(
                f"native engine: continuing request {seq.request_id!r}: prompt_ids must start with its "
                f"{len(context)} tokens so far (prompt and sampled tokens), token ids in and out"
            )
        self._start_sampler(params)
        self.scheduler.unpark(seq)
        seq.continue_with(prompt_ids, params.max_new_tokens, self._stop_ids(params))
        self.scheduler.add(Group([seq]))

    def _joins_last_group(self, seq: Sequence) -> bool:
        """A single sample "X/k" whose prompt is that of the newest waiting group of X's samples
        joins it, so that submitting X's samples one by one equals submitting X with n."""
        if not self.scheduler.waiting or "/" not in seq.request_id:
            return False
        group = self.scheduler.waiting[-1]
        first = group.seqs[0]
        return (
            len(group.seqs) < self.cfg.max_num_seqs
            and first.request_id.rsplit("/", 1)[0] == seq.request_id.rsplit("/", 1)[0]
            and first.num_cached == 0
            and not first.output
            and first.prompt == seq.prompt
        )

    def _start_sampler(self, params: SamplingParams) -> None:
        """A busy period's one sampler, from the first request; later ones must sample alike."""
        self._ensure_scheduler()
        if self.has_work():
            setting = (params.temperature, params.top_k, params.top_p)
            if setting != self.sampler_setting:
                raise ValueError(
                    f"native engine: requests in flight sample at (temperature, top_k, top_p) = "
                    f"{self.sampler_setting}, this one at {setting}; submit it once they finished"
                )
            return
        # without a seed, follow torch's global RNG (torch.manual_seed makes runs repeatable)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 1 << 31, ()).item())
        self.sampler = self.runner.new_sampler(params, seed)
        self.sampler_setting = (params.temperature, params.top_k, params.top_p)

    def _ensure_scheduler(self) -> None:
        """A fresh scheduler and page pool when nothing is held, as in a new engine."""
        self.resume_memory()
        if self.scheduler is None or not (self.has_work() or self.requests):
            blocks = BlockManager(self.runner.num_pages, self.cfg.page_size, self.cfg.max_num_seqs)
            self.scheduler = Scheduler(
                blocks, self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens, self.cfg.decode_steps
            )
        if not self.has_work():  # a busy period starts: last_stats will count it
            self._period = (
                dict(self.runner.capture_stats),
                self.scheduler.num_preemptions,
                self.scheduler.num_evictions,
            )
            self._host_wait = 0.0

    def _end_period(self) -> None:
        """last_stats: the busy period that just ended (a generate, or an agent rollout)."""
        captures, preemptions, evictions = self._period
        self.last_stats = {
            "preemptions": self.scheduler.num_preemptions - preemptions,
            "kv_evictions": self.scheduler.num_evictions - evictions,
            "host_wait_s": self._host_wait,
            "kv_resume_s": self._resume_s,
            **{k: v - captures[k] for k, v in self.runner.capture_stats.items()},
            **self.memory_gib(),
        }
        self._resume_s = 0.0

    def memory_gib(self) -> dict[str, float]:
        """What the engine holds on its device (minirl.observe.memory): its weights (not those it
        shares with the actor, which the actor's count holds; with their e4m3 copies when
        rollout.quantization = "fp8"), and its KV cache while allocated;
        the CUDA graphs' pools come on top."""
        counter = StorageCounter(self.device)
        own = [p for name, p in self.model.named_parameters() if name not in self.shared]  # the rest: the actor's
        out = {"weights_gib": counter.count(own + list(self.model.buffers())) / GIB}  # buffers: e4m3 copies
        if self.runner.kv is not None:
            out["kv_cache_gib"] = counter.count([self.runner.kv]) / GIB
        return out

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)

    def _take_finished(self) -> list[TurnOutput]:
        out, self.finished = self.finished, []
        return out

    def _postprocess(self, result: StepResult) -> None:
        start = time.perf_counter()
        tokens, logprobs = result.fetch()
        self._host_wait += time.perf_counter() - start  # time the host had nothing to do
        for seq, seq_tokens, seq_logprobs in zip(result.seqs, tokens, logprobs):
            if seq.status is not Status.RUNNING:
                continue  # stopped in an earlier batch; these tokens were sampled past its end
            seq.extend(seq_tokens, seq_logprobs, result.version)
            if seq.status is Status.FINISHED:
                self.scheduler.park(seq)
                self.finished.append(seq.to_turn())
