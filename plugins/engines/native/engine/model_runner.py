"""Runs prefill and decode steps on the device: KV cache, device-side sequence state, CUDA graphs.

Decode reads everything per-row from device state indexed by the sequence's row: its length
(`seq_lens`), its last sampled token (`last_tok`) and its page-table row. The host only sends the
batch's row ids and the few new page-table entries, so no step waits for a token to be read
back: a decode batch runs k steps back to back (pages for all k allocated up front), and the
engine reads each batch's tokens while the next one runs. The decode step - forward, logits and,
with the fused sampler, sampling - is captured in a CUDA graph per batch bucket on first use
(padded rows point at a scratch row whose page is page 0), and re-captured after
release_memory().

Shape legend: B decode rows, N packed prefill tokens, S prefilled sequences, V vocabulary.
"""

from __future__ import annotations

import bisect
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from minirl_plugins.engines.native.config import EngineConfig
from minirl_plugins.engines.native.engine.block_manager import cdiv
from minirl_plugins.engines.native.engine.sampler import SamplerState
from minirl_plugins.engines.native.engine.scheduler import DecodeBatch, PrefillBatch
from minirl_plugins.engines.native.layers.meta import StepMeta, multiprocessors
from minirl_plugins.engines.native.layers.ops import Ops
from minirl_plugins.engines.native.layers.rotary import cos_sin_cache, inv_frequencies
from minirl_plugins.engines.native.models.decoder import DecoderLM


@dataclass
class StepResult:
    """Sampled tokens of one step, on their way to the host."""

    seqs: list
    tokens: torch.Tensor
    logprobs: torch.Tensor
    event: torch.cuda.Event | None = None

    def fetch(self) -> tuple[list[list[int]], list[list[float]]]:
        if self.event is not None:
            self.event.synchronize()
        return self.tokens.tolist(), self.logprobs.tolist()


@dataclass
class StepRecord:
    """For the benchmark: what a step read, and device events around it."""

    kind: str
    rows: int
    kv_tokens: int  # summed over the steps: tokens whose K and V the steps read
    steps: int = 1
    start: object = None
    end: object = None


@dataclass
class Profile:
    records: list[StepRecord] = field(default_factory=list)
    enabled: bool = False


def graph_buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, max(max_bs, 1) + 1, 32))
    return sorted({min(s, max_bs) for s in sizes})


class ModelRunner:
    def __init__(self, model: DecoderLM, cfg: EngineConfig, ops: Ops, device, dtype):
        self.model, self.cfg, self.ops, self.device, self.dtype = model, cfg, ops, device, dtype
        self.kv_dtype = cfg.kv_cache_dtype or dtype
        spec = model.spec
        self.spec = spec
        self.rope = cos_sin_cache(inv_frequencies(spec.rope, spec.head_dim), cfg.max_model_len, device)
        self.page = cfg.page_size
        self.dummy_row = cfg.max_num_seqs  # padded graph rows use it; its page is page 0
        rows, max_pages = cfg.max_num_seqs + 1, cdiv(cfg.max_model_len, cfg.page_size)
        self.page_table = torch.zeros(rows, max_pages, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.last_tok = torch.zeros(rows, dtype=torch.int64, device=device)
        self.row_ids = torch.zeros(max(cfg.max_num_seqs, cfg.max_graph_batch), dtype=torch.int64, device=device)
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
        self.profile = Profile()
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
        """Pages that the rows in flight can use at most: every row at max_model_len plus the one
        free page per running row that the scheduler keeps back when it admits a prompt, and the
        scratch page. Rows in flight are max_num_seqs, or fewer when one generate call never asks
        for more (max_batch_rows): a batch of 256 rows of 2,048 tokens fills 15 GB of a 1.5B
        model's cache, not the 60 GB that half of an H200 would give it. A larger call (validation
        over a big set) then runs in waves."""
        rows = min(self.cfg.max_num_seqs, self.cfg.max_batch_rows or self.cfg.max_num_seqs)
        return rows * (cdiv(self.cfg.max_model_len, self.page) + 1) + 1

    def allocate_kv(self) -> None:
        if self.kv is not None:
            return
        if not self.num_pages:
            self.num_pages = self.plan_num_pages()
        s = self.spec
        self.kv = torch.zeros(
            2,
            s.num_layers,
            self.num_pages * self.page,
            s.num_kv_heads,
            s.head_dim,
            dtype=self.kv_dtype,
            device=self.device,
        )

    @torch.inference_mode()
    def full_logits(self, tokens: list[int]) -> torch.Tensor:
        """logits_TV of every position of one sequence, through the prefill path (tests, scoring).

        Uses a scratch KV buffer, so the engine's cache and state are untouched.
        """
        s, n = self.spec, len(tokens)
        kv = torch.zeros(2, s.num_layers, n, s.num_kv_heads, s.head_dim, dtype=self.kv_dtype, device=self.device)
        pos = torch.arange(n, device=self.device)
        cu = torch.tensor([0, n], dtype=torch.int32, device=self.device)
        meta = StepMeta(True, pos, kv, cu_seqlens_S1=cu, max_seqlen=n)
        h = self.model(torch.tensor(tokens, device=self.device), pos, meta, self.rope)
        return self.model.compute_logits(h)

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
        dev = {k: self._upload(v) for k, v in host.items() if isinstance(v, np.ndarray)}
        rows = dev["rows"]
        self.page_table[rows, : host["table"].shape[1]] = dev["table"]
        record = self._start("prefill", len(host["ids"]))
        meta = StepMeta(True, dev["slots"], self.kv, cu_seqlens_S1=dev["cu"], max_seqlen=max(host["lens"]))
        h = self.model(dev["ids"], dev["positions"], meta, self.rope)
        logits = self.model.compute_logits(h[dev["last"]])
        if batch.copies:
            self._copy_pages(batch.copies)
        tokens, logprobs = sampler.sample(logits[dev["sample_rows"]])
        self.last_tok[rows] = tokens
        self.seq_lens[rows] = dev["seq_lens"]
        self._end(record)
        return self._result(batch.seqs, tokens[:, None], logprobs[:, None])

    def _prefill_inputs(self, batch: PrefillBatch) -> dict:
        ids, positions, slots, lens, rows, seq_lens, sample_rows, tables = [], [], [], [], [], [], [], []
        for g, group in enumerate(batch.groups):
            tokens = group.tokens
            pos = np.arange(len(tokens))
            pages = np.asarray(group.seqs[0].pages, dtype=np.int64)
            ids.append(np.asarray(tokens, dtype=np.int64))
            positions.append(pos)
            slots.append(pages[pos // self.page] * self.page + pos % self.page)
            lens.append(len(tokens))
            for seq in group.seqs:
                rows.append(seq.row)
                seq_lens.append(len(tokens))
                sample_rows.append(g)
                tables.append(seq.pages)
        width = max(len(t) for t in tables)
        table = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        return dict(
            ids=np.concatenate(ids),
            positions=np.concatenate(positions),
            slots=np.concatenate(slots),
            cu=cu,
            last=cu[1:].astype(np.int64) - 1,
            rows=np.asarray(rows, dtype=np.int64),
            seq_lens=np.asarray(seq_lens, dtype=np.int32),
            sample_rows=np.asarray(sample_rows, dtype=np.int64),
            table=table,
            lens=lens,
        )

    def _copy_pages(self, copies: list[tuple[int, int]]) -> None:
        s = self.spec
        pages = self.kv.view(2, s.num_layers, self.num_pages, self.page, s.num_kv_heads, s.head_dim)
        src, dst = (self._upload(np.asarray(c, dtype=np.int64)) for c in zip(*copies))
        pages[:, :, dst] = pages[:, :, src]

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch, sampler: SamplerState) -> StepResult:
        """batch.num_steps decode steps for the batch's rows; tokens come back as [rows, steps]."""
        n, k = len(batch.seqs), batch.num_steps
        if batch.page_updates:
            r, c, p = (self._upload(np.asarray(x, dtype=np.int64)) for x in zip(*batch.page_updates))
            self.page_table[r, c] = p.to(torch.int32)
        rows = np.fromiter((s.row for s in batch.seqs), dtype=np.int64, count=n)
        record = self._start("decode", n, batch.seqs, k)
        bucket = self._bucket(n)
        width = bucket or n
        if bucket:
            padded = np.full(bucket, self.dummy_row, dtype=np.int64)
            padded[:n] = rows
            rows = padded
        self._upload_into(self.row_ids[:width], rows)
        if sampler.fused is not None:
            self.out_step.zero_()
            for _ in range(k):
                self._run_step(width, bucket, fused=True)
            tokens = self.out_tok[: k * width].view(k, width)[:, :n].t()
            logprobs = self.out_lp[: k * width].view(k, width)[:, :n].t()
        else:
            steps = [self._sample_step(n, width, bucket, sampler) for _ in range(k)]
            tokens, logprobs = (torch.stack(x, dim=1) for x in zip(*steps))
        self._end(record)
        return self._result(batch.seqs, tokens, logprobs)

    def _sample_step(self, n, width, bucket, sampler):
        logits = self._run_step(width, bucket, fused=False)[:n]
        tokens, logprobs = sampler.sample(logits)
        self.last_tok[self.row_ids[:n]] = tokens
        return tokens, logprobs

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

    def _decode_forward(self, n: int, fused: bool) -> torch.Tensor | None:
        """One decode step for rows row_ids[:n], all inputs read from device state (graphable).

        Returns the logits; with the fused sampler it samples too, writes the tokens to
        last_tok and to out_tok/out_lp at step out_step, and returns None.
        """
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
            num_splits=self._num_splits(n),
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

    def _num_splits(self, n: int) -> int:
        """Split-K factor of decode attention: one program per row and KV head once those fill
        the GPU's multiprocessors (the fastest in the sweep), more for small batches."""
        if self.device.type != "cuda":
            return 1
        programs = n * self.spec.num_kv_heads
        sms = multiprocessors(self.device)
        if programs >= sms:
            return 1
        return min(16, 1 << (cdiv(2 * sms, programs) - 1).bit_length())

    # ---------------------------------------------------------------------------- graphs

    def _bucket(self, n: int) -> int | None:
        if not self.use_graphs or n > self.buckets[-1]:
            return None
        return self.buckets[bisect.bisect_left(self.buckets, n)]

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

    # ---------------------------------------------------------------------------- helpers

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _upload_into(self, dst: torch.Tensor, array: np.ndarray) -> None:
        t = torch.from_numpy(array)
        dst.copy_(t.pin_memory() if self.device.type == "cuda" else t, non_blocking=True)

    def _result(self, seqs, tokens, logprobs) -> StepResult:
        """tokens/logprobs [rows, steps] on their way to pinned host memory."""
        if self.device.type != "cuda":  # copies: the next batch reuses the output buffers
            return StepResult(seqs, tokens.clone(), logprobs.clone())
        tokens, logprobs = tokens.contiguous(), logprobs.contiguous()
        host_t = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host_l = torch.empty(logprobs.shape, dtype=torch.float32, pin_memory=True)
        host_t.copy_(tokens, non_blocking=True)
        host_l.copy_(logprobs, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return StepResult(seqs, host_t, host_l, event)

    def _start(self, kind: str, rows: int, seqs=None, steps: int = 1) -> StepRecord | None:
        if not self.profile.enabled:
            return None
        # seqs' num_cached already counts the k scheduled tokens: step j reads num_cached - k + j + 1
        kv = steps * sum(s.num_cached for s in seqs) - rows * steps * (steps - 1) // 2 if seqs else 0
        rec = StepRecord(kind, rows, kv, steps)
        if self.device.type == "cuda":
            rec.start, rec.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            rec.start.record()
        self.profile.records.append(rec)
        return rec

    def _end(self, rec: StepRecord | None) -> None:
        if rec is not None and rec.end is not None:
            rec.end.record()
