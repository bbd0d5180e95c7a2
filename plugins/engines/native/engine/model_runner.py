"""Runs prefill and decode steps on the device: the KV cache, device-side row state, CUDA graphs.

Decode reads each row's state on the device (its length `seq_lens`, last token `last_tok`, its
page-table row): the host sends only row ids and new page-table entries, so a decode batch runs k
steps back to back and the engine reads its tokens while the next batch runs. The decode step
(forward, logits, the fused sampler's draw) is captured in a CUDA graph per batch bucket on first
use (padded rows point at a scratch row whose page is page 0), and again after release().

Shape legend: B decode rows, N packed prefill tokens, S prefilled sequences, V vocabulary.
"""

from __future__ import annotations

import bisect
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from minirl_plugins.engines.native.config import EngineConfig
from minirl_plugins.engines.native.engine.block_manager import cdiv
from minirl_plugins.engines.native.engine.scheduler import DecodeBatch, PrefillBatch
from minirl_plugins.engines.native.layers.meta import StepMeta
from minirl_plugins.engines.native.layers.ops import Ops
from minirl_plugins.engines.native.layers.paged_attention import num_splits
from minirl_plugins.engines.native.layers.rotary import cos_sin_cache, inv_frequencies
from minirl_plugins.engines.native.layers.sampling import SamplerState
from minirl_plugins.engines.native.models.decoder import DecoderLM


@dataclass
class StepResult:
    """Sampled tokens and log-probs [rows, steps] of one step, on their way to the host."""

    seqs: list
    tokens: torch.Tensor
    logprobs: torch.Tensor
    event: torch.cuda.Event | None = None
    version: int = 0  # the engine's weight_version when the step ran

    @classmethod
    def copy_to_host(cls, seqs, tokens, logprobs) -> "StepResult":
        """Start the copies without waiting (into pinned memory from CUDA); a copy even on the
        CPU, since the next batch reuses the output buffers."""
        host = [x.to("cpu", non_blocking=True, copy=True) for x in (tokens, logprobs)]
        event = torch.cuda.Event() if tokens.is_cuda else None
        if event is not None:
            event.record()
        return cls(seqs, *host, event)

    def fetch(self) -> tuple[list[list[int]], list[list[float]]]:
        if self.event is not None:
            self.event.synchronize()
        return self.tokens.tolist(), self.logprobs.tolist()


def graph_buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, max(max_bs, 1) + 1, 32))
    return sorted({min(s, max_bs) for s in sizes})


class ModelRunner:
    def __init__(self, model: DecoderLM, cfg: EngineConfig, ops: Ops, device, dtype):
        self.model, self.cfg, self.ops, self.device = model, cfg, ops, device
        self.spec = spec = model.spec
        self.kv_dtype = cfg.kv_cache_dtype or dtype
        self.rope = cos_sin_cache(inv_frequencies(spec.rope, spec.head_dim), cfg.max_model_len, device)
        self.page = cfg.page_size
        self.dummy_row = cfg.max_num_seqs  # padded graph rows use it; its page is page 0
        rows, max_pages = cfg.max_num_seqs + 1, cdiv(cfg.max_model_len, cfg.page_size)
        self.page_table = torch.zeros(rows, max_pages, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.last_tok = torch.zeros(rows, dtype=torch.int64, device=device)
        self.row_ids = torch.zeros(max(cfg.max_num_seqs, cfg.max_graph_batch), dtype=torch.int64, device=device)
        # decode attention's split-K programs count themselves done per row (StepMeta.split_counts)
        self.split_counts = torch.zeros(self.row_ids.numel(), dtype=torch.int32, device=device)
        self.kv: torch.Tensor | None = None
        self.num_pages = 0
        self.use_graphs = device.type == "cuda" and not cfg.enforce_eager and ops.graphable
        self.buckets = graph_buckets(min(cfg.max_graph_batch, cfg.max_num_seqs))
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        # fused sampler state, read inside the graphs: (1/temperature, sample?), (seed, step)
        self.sample_params = torch.zeros(2, dtype=torch.float32, device=device)
        self.sample_seed = torch.zeros(2, dtype=torch.int64, device=device)
        width = cfg.decode_steps * self.row_ids.numel()
        self.out_tok = torch.zeros(width, dtype=torch.int64, device=device)  # [steps, rows] of a batch
        self.out_lp = torch.zeros(width, dtype=torch.float32, device=device)
        self.out_step = torch.zeros((), dtype=torch.int64, device=device)
        self.arange = torch.arange(self.row_ids.numel(), device=device)
        self.pool = None
        self.capture_stats = {"graph_captures": 0, "graph_capture_s": 0.0}  # cumulative

    # ---------------------------------------------------------------------------- memory

    @property
    def kv_bytes_per_token(self) -> int:
        s = self.spec
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim * self.kv_dtype.itemsize

    def plan_num_pages(self) -> int:
        if self.cfg.num_kv_pages:
            return self.cfg.num_kv_pages
        if self.device.type == "cuda":
            budget = torch.cuda.mem_get_info(self.device)[0] * self.cfg.gpu_memory_utilization
        else:
            budget = self.cfg.cpu_kv_cache_bytes
        return max(2, min(int(budget) // (self.kv_bytes_per_token * self.page), self.useful_pages()))

    def useful_pages(self) -> int:
        """Pages the rows in flight can use at most: each row at max_model_len, the free page per
        running row the scheduler keeps back, the scratch page. Rows are max_batch_rows when one
        call asks for no more (docs/architecture.md: 15 GB used of a 60 GB budget otherwise)."""
        rows = min(self.cfg.max_num_seqs, self.cfg.max_batch_rows or self.cfg.max_num_seqs)
        return rows * (cdiv(self.cfg.max_model_len, self.page) + 1) + 1

    def new_kv(self, num_slots: int) -> torch.Tensor:
        """A zeroed KV cache [2, layers, num_slots, KV heads, head dim]."""
        s = self.spec
        shape = (2, s.num_layers, num_slots, s.num_kv_heads, s.head_dim)
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def allocate_kv(self) -> None:
        if self.kv is None:
            self.num_pages = self.num_pages or self.plan_num_pages()
            self.kv = self.new_kv(self.num_pages * self.page)

    def release(self) -> None:
        """Drop the KV cache and the graphs (they point into it) and return the memory."""
        self.graphs.clear()
        self.pool = None
        self.kv = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def new_sampler(self, params, seed: int) -> SamplerState:
        return SamplerState(params, seed, self.device, self.ops.fast_sample, (self.sample_params, self.sample_seed))

    # ---------------------------------------------------------------------------- steps

    @torch.inference_mode()
    def prefill(self, batch: PrefillBatch, sampler: SamplerState) -> StepResult:
        host = self._prefill_inputs(batch)
        dev = {k: self._upload(v) for k, v in host.items()}
        rows, max_seqlen = dev["rows"], int(np.diff(host["cu"]).max())
        self.page_table[rows, : dev["table"].shape[1]] = dev["table"]
        meta = StepMeta(
            True, dev["slots"], self.kv, cu_seqlens_S1=dev["cu"], max_seqlen=max_seqlen, page_size=self.page
        )
        if batch.extends:
            meta.ctx_slots_M, meta.cu_ctx_S1 = dev["ctx_slots"], dev["cu_ctx"]
            meta.max_ctx_len = int(np.diff(host["cu_ctx"]).max())
        h = self.model(dev["ids"], dev["positions"], meta, self.rope)
        logits = self.model.compute_logits(h[dev["last"]])
        if batch.copies:
            self._copy_pages(batch.copies)
        tokens, logprobs = sampler.sample(logits[dev["sample_rows"]])
        self.last_tok[rows] = tokens
        self.seq_lens[rows] = dev["seq_lens"]
        return StepResult.copy_to_host(batch.seqs, tokens[:, None], logprobs[:, None])

    def _prefill_inputs(self, batch: PrefillBatch) -> dict[str, np.ndarray]:
        """Packed ids, positions and KV slots of the groups' new tokens (from each group's start);
        per sequence its row, length, page-table row and the group whose last logits it samples
        from; for an extend, the KV slots of every sequence's whole context."""
        groups, seqs = batch.groups, batch.seqs
        starts = np.asarray(batch.starts or [0] * len(groups), dtype=np.int64)
        lens = np.array([len(g.tokens) for g in groups], dtype=np.int64)
        per_group = [len(g.seqs) for g in groups]
        group_pages = [np.asarray(g.seqs[0].pages, dtype=np.int64) for g in groups]  # the others copy the tail
        ctx_slots = [
            p[np.arange(n) // self.page] * self.page + np.arange(n) % self.page for p, n in zip(group_pages, lens)
        ]
        width = max(len(s.pages) for s in seqs)
        cu = np.concatenate([[0], np.cumsum(lens - starts)]).astype(np.int32)
        out = dict(
            ids=np.concatenate([np.asarray(g.tokens[a:], dtype=np.int64) for g, a in zip(groups, starts)]),
            positions=np.concatenate([np.arange(a, n) for a, n in zip(starts, lens)]),
            slots=np.concatenate([slots[a:] for slots, a in zip(ctx_slots, starts)]),
            cu=cu,
            last=cu[1:].astype(np.int64) - 1,
            rows=np.array([s.row for s in seqs], dtype=np.int64),
            seq_lens=np.repeat(lens.astype(np.int32), per_group),
            sample_rows=np.repeat(np.arange(len(groups)), per_group),
            table=np.array([s.pages + [0] * (width - len(s.pages)) for s in seqs], dtype=np.int32),
        )
        if batch.extends:
            out["ctx_slots"] = np.concatenate(ctx_slots)
            out["cu_ctx"] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        return out

    def _copy_pages(self, copies: list[tuple[int, int]]) -> None:
        pages = self.kv.unflatten(2, (self.num_pages, self.page))
        src, dst = self._upload(np.asarray(copies, dtype=np.int64).T)  # one upload for both
        pages[:, :, dst] = pages[:, :, src]

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch, sampler: SamplerState) -> StepResult:
        """batch.num_steps decode steps for the batch's rows; tokens come back as [rows, steps]."""
        n, k = len(batch.seqs), batch.num_steps
        if batch.page_updates:
            r, c, p = self._upload(np.asarray(batch.page_updates, dtype=np.int64).T)  # one upload, not three
            self.page_table[r, c] = p.to(torch.int32)
        bucket = self._bucket(n)
        width = bucket or n
        rows = np.full(width, self.dummy_row, dtype=np.int64)
        rows[:n] = [s.row for s in batch.seqs]
        self.row_ids[:width].copy_(self._host(rows), non_blocking=True)
        if sampler.fused is not None:
            self.out_step.zero_()
            for _ in range(k):
                self._run_step(width, bucket, fused=True)
            tokens = self.out_tok[: k * width].view(k, width)[:, :n].t()
            logprobs = self.out_lp[: k * width].view(k, width)[:, :n].t()
        else:
            steps = [self._sample_step(n, width, bucket, sampler) for _ in range(k)]
            tokens, logprobs = (torch.stack(x, dim=1) for x in zip(*steps))
        return StepResult.copy_to_host(batch.seqs, tokens, logprobs)

    def _sample_step(self, n, width, bucket, sampler):
        logits = self._run_step(width, bucket, fused=False)[:n]
        tokens, logprobs = sampler.sample(logits)
        self.last_tok[self.row_ids[:n]] = tokens
        return tokens, logprobs

    def _decode_forward(self, n: int, fused: bool) -> torch.Tensor | None:
        """One decode step for rows row_ids[:n], every input read from device state (graphable):
        the logits, or with the fused sampler None, its tokens in last_tok and out_tok/out_lp."""
        rows = self.row_ids[:n]
        pos = self.seq_lens[rows].long()
        ctx = (pos + 1).to(torch.int32)
        slots = self.page_table[rows, pos // self.page].long() * self.page + pos % self.page
        meta = StepMeta(
            False,
            slots,
            self.kv,
            rows_B=rows,
            ctx_lens_B=ctx,
            page_table=self.page_table,
            page_size=self.page,
            num_splits=num_splits(n, self.spec.num_kv_heads, self.device),
            split_counts=self.split_counts,
        )
        h = self.model(self.last_tok[rows], pos, meta, self.rope)
        self.seq_lens[rows] = ctx
        self.seq_lens[self.dummy_row :].zero_()
        logits = self.model.compute_logits(h)
        if not fused:
            return logits
        tokens, logprobs = self.ops.fast_sample(logits, self.sample_params, self.sample_seed)
        self.last_tok[rows] = tokens
        at = self.out_step * n + self.arange[:n]
        self.out_tok[at] = tokens
        self.out_lp[at] = logprobs
        self.out_step += 1
        return None

    # ---------------------------------------------------------------------------- graphs

    def _bucket(self, n: int) -> int | None:
        if not self.use_graphs or n > self.buckets[-1]:
            return None
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def _run_step(self, width: int, bucket: int | None, fused: bool):
        if bucket is None:
            return self._decode_forward(width, fused)
        key = (bucket, fused)
        if key not in self.graphs:
            try:
                self._capture(key)
            except Exception as exc:  # a capture failure costs speed, not the rollout
                warnings.warn(f"native engine: CUDA graph capture failed ({exc}); decoding eagerly")
                self.use_graphs = False
                return self._decode_forward(width, fused)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits

    def _capture(self, key: tuple[int, bool]) -> None:
        bucket, fused = key
        state = (self.row_ids, self.sample_seed, self.out_step)
        saved = [t.clone() for t in state]
        start = time.perf_counter()
        try:
            self.row_ids[:bucket].fill_(self.dummy_row)  # warm-up and capture write only the scratch row
            self._decode_forward(bucket, fused)  # compiles kernels, sets up cuBLAS
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self._decode_forward(bucket, fused)
            self.pool = graph.pool() if self.pool is None else self.pool
            self.graphs[key] = (graph, logits)
            self.capture_stats["graph_captures"] += 1
        finally:
            for t, old in zip(state, saved):
                t.copy_(old)
            self.capture_stats["graph_capture_s"] += time.perf_counter() - start

    # ---------------------------------------------------------------------------- host to device

    def _host(self, array: np.ndarray) -> torch.Tensor:
        """array as a tensor, pinned when bound for CUDA, so that the copy does not wait."""
        t = torch.from_numpy(np.ascontiguousarray(array))
        return t.pin_memory() if self.device.type == "cuda" else t

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        return self._host(array).to(self.device, non_blocking=True)
