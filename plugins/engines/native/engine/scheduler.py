"""Continuous batching: finished sequences leave, waiting groups join between steps.

Each step is either a prefill (new groups, packed varlen) or a decode (one token for every
running sequence). Prefill goes first whenever a waiting group fits, as in nano-vllm. When the
KV cache runs out of pages during decode, the newest sequence is preempted: its pages are freed
and it is later recomputed from prompt + output, which gives the same tokens.

A sequence whose turn ended is parked: its row is free, its pages (its KV) stay, so that the
request's next turn prefills only its new tokens. Parked pages are evicted, oldest first, as soon
as a waiting group or a decode step needs them: holding them never changes what is admitted
or preempted, only what a continuation has to recompute.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, field

from minirl_plugins.engines.native.engine.block_manager import BlockManager, cdiv
from minirl_plugins.engines.native.engine.sequence import Group, Sequence, Status


@dataclass
class PrefillBatch:
    groups: list[Group]
    copies: list[tuple[int, int]]  # (src page, dst page) tail copies for the forks
    starts: list[int] = field(default_factory=list)  # per group: positions already cached (continuations)

    @property
    def extends(self) -> bool:
        """Some group continues a cached sequence: its new tokens attend to the KV cache."""
        return any(self.starts)

    @property
    def seqs(self) -> list[Sequence]:
        return [s for g in self.groups for s in g.seqs]


@dataclass
class DecodeBatch:
    seqs: list[Sequence]
    page_updates: list[tuple[int, int, int]] = field(default_factory=list)  # (row, col, page)
    num_steps: int = 1  # decode steps run back to back on the device before the host looks


class OutOfPages(Exception):
    """Decode needs a page and none is free: drain the pipeline, then preempt."""


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, decode_steps: int = 1):
        self.blocks = blocks
        self.decode_steps = decode_steps
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Group] = deque()
        self.running: list[Sequence] = []
        self.parked: dict[Sequence, None] = {}  # oldest first
        self.num_preemptions = 0
        self.num_evictions = 0

    def add(self, group: Group) -> None:
        self.waiting.append(group)

    def park(self, seq: Sequence) -> None:
        """seq's turn ended: free its row, keep its pages for its next turn."""
        self.running.remove(seq)
        self.blocks.free_row(seq)
        self.parked[seq] = None

    def unpark(self, seq: Sequence) -> None:
        self.parked.pop(seq, None)

    def drop(self, seq: Sequence) -> None:
        """Forget seq wherever it is: parked, waiting or running; its pages are freed."""
        self.parked.pop(seq, None)
        for group in self.waiting:
            if seq in group.seqs:
                group.seqs.remove(seq)
        self.waiting = deque(g for g in self.waiting if g.seqs)
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.free(seq)

    def _evict_until(self, enough, keep: Group | None = None) -> bool:
        """Free kept KV until enough() holds: parked sequences' oldest first, then that of
        continuations still waiting (newest first; they will prefill everything), never keep's.
        Returns enough()."""
        while not enough():
            if self.parked:
                seq = next(iter(self.parked))
                del self.parked[seq]
            else:
                waiting = [g.seqs[0] for g in reversed(self.waiting) if g is not keep and g.start]
                if not waiting:
                    break
                seq = waiting[0]
            self.blocks.free(seq)
            self.num_evictions += 1
        return enough()

    def is_done(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> PrefillBatch | DecodeBatch | None:
        """The next step, or None when every running sequence awaits its last token."""
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> PrefillBatch | None:
        groups, copies, starts, num_tokens = [], [], [], 0
        while self.waiting:
            group = self.waiting[0]
            n, length = len(group.seqs), len(group.tokens) - group.start
            if groups and num_tokens + length > self.max_num_batched_tokens:
                break
            # keep one free page per running sequence so that decode can go on after admission
            reserve = len(self.running) + n
            admit = functools.partial(self._can_admit, group, reserve)
            if len(self.running) + n > self.max_num_seqs or not self._evict_until(admit, keep=group):
                break
            self.waiting.popleft()
            starts.append(group.start)
            if group.start:
                self.blocks.allocate_continue(group.seqs[0])
            else:
                copies += self.blocks.allocate_group(group.seqs, length)
            for seq in group.seqs:
                seq.status = Status.RUNNING
                seq.num_scheduled += 1
                self.running.append(seq)
            groups.append(group)
            num_tokens += length
        return PrefillBatch(groups, copies, starts) if groups else None

    def _can_admit(self, group: Group, reserve: int) -> bool:
        if group.start:  # a continuing sequence keeps its pages
            need = self.blocks.pages_to_continue(group.seqs[0]) + reserve
            return need <= self.blocks.num_free_pages and bool(self.blocks.free_rows)
        return self.blocks.can_allocate(len(group.tokens), len(group.seqs), reserve)

    def _schedule_decode(self) -> DecodeBatch | None:
        """Every running sequence advances by k tokens, k <= decode_steps and <= what each may
        still generate. Several steps per host round trip cut the host's share of the work; a
        sequence that stops inside them wastes the rest (its tokens are dropped)."""
        seqs = [s for s in self.running if s.num_scheduled < s.max_new_tokens and s.status is Status.RUNNING]
        if not seqs:
            return None
        k = min(self.decode_steps, min(s.max_new_tokens - s.num_scheduled for s in seqs))
        need = self._pages_needed(seqs, k)
        if k > 1 and not self._evict_until(lambda: sum(need) <= self.blocks.num_free_pages):  # fall back to one step
            k, need = 1, self._pages_needed(seqs, 1)
        if not self._evict_until(lambda: sum(need) <= self.blocks.num_free_pages):
            raise OutOfPages
        updates = []
        for seq, n in zip(seqs, need):
            for _ in range(n):
                updates.append((seq.row, len(seq.pages), self.blocks.append_page(seq)))
            seq.num_cached += k
            seq.num_scheduled += k
        return DecodeBatch(seqs, updates, k)

    def _pages_needed(self, seqs: list[Sequence], k: int) -> list[int]:
        return [cdiv(s.num_cached + k, self.blocks.page_size) - len(s.pages) for s in seqs]

    def preempt_newest(self) -> None:
        """Free the newest running sequence's pages; it is recomputed from its tokens later, so
        call this only with no step in flight (the recompute needs every token read back)."""
        if not self.running:
            raise RuntimeError("the KV cache cannot hold a single sequence; raise gpu_memory_utilization")
        seq = self.running.pop()
        self.num_preemptions += 1
        self.blocks.free(seq)
        seq.status = Status.WAITING
        seq.num_scheduled = len(seq.output)
        self.waiting.appendleft(Group([seq]))

    def check_progress(self) -> None:
        """Raise for a waiting group that can never be admitted (nothing runs to free pages)."""
        if self.waiting and not self.running:
            group = self.waiting[0]
            n, length = len(group.seqs), len(group.tokens)
            raise ValueError(
                f"a prompt of {length} tokens with n={n} needs "
                f"{self.blocks.pages_for_group(length, n) + n} KV pages but the cache has "
                f"{self.blocks.num_pages - 1}; raise rollout.gpu_memory_utilization or shorten prompts"
            )
