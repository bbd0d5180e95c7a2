"""The KV cache's bookkeeping: pages of `page_size` token slots, and rows of device-side state.

The n samples of a prompt share the prompt's full pages (reference-counted); each gets its own
copy of the partly filled last page, so that their continuations never write into a shared page.
Page 0 is never handed out: padded rows of a CUDA-graph batch write their garbage there.
"""

from __future__ import annotations

from collections import deque

from minirl_plugins.engines.native.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, num_rows: int):
        if num_pages < 2:
            raise ValueError(f"the KV cache holds {num_pages} pages; at least 2 are needed")
        self.page_size = page_size
        self.num_pages = num_pages
        self.free_pages: deque[int] = deque(range(1, num_pages))
        self.refs = [0] * num_pages
        self.free_rows: deque[int] = deque(range(num_rows))

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def pages_for_group(self, num_tokens: int, num_seqs: int) -> int:
        """Pages a group prefill takes: the shared full pages plus one tail page per sequence."""
        full, tail = divmod(num_tokens, self.page_size)
        return full + (num_seqs if tail else 0)

    def can_allocate(self, num_tokens: int, num_seqs: int, reserve: int = 0) -> bool:
        pages = self.pages_for_group(num_tokens, num_seqs) + reserve
        return pages <= self.num_free_pages and num_seqs <= len(self.free_rows)

    def allocate_group(self, seqs: list[Sequence], num_tokens: int) -> list[tuple[int, int]]:
        """Give every sequence a row and pages for num_tokens; returns (src, dst) tail copies."""
        full, tail = divmod(num_tokens, self.page_size)
        shared = [self._take() for _ in range(full)]
        first_tail = self._take() if tail else None
        copies = []
        for i, seq in enumerate(seqs):
            seq.row = self.free_rows.popleft()
            for page in shared:
                self.refs[page] += i > 0
            seq.pages = list(shared)
            if tail:
                own = first_tail if i == 0 else self._take()
                seq.pages.append(own)
                if i > 0:
                    copies.append((first_tail, own))
            seq.num_cached = num_tokens
        return copies

    def pages_to_continue(self, seq: Sequence) -> int:
        """Pages a continuing sequence takes to hold all its tokens (its own pages kept)."""
        return max(0, cdiv(len(seq.tokens), self.page_size) - len(seq.pages))

    def allocate_continue(self, seq: Sequence) -> None:
        """A row, and pages up to all of seq.tokens, for a sequence whose first num_cached
        tokens' KV it holds already; its pages past the prompt's full pages are its own."""
        seq.row = self.free_rows.popleft()
        for _ in range(self.pages_to_continue(seq)):
            seq.pages.append(self._take())
        seq.num_cached = len(seq.tokens)

    def free_row(self, seq: Sequence) -> None:
        """Give back the row of a sequence whose turn ended; its pages (its KV) stay."""
        if seq.row >= 0:
            self.free_rows.append(seq.row)
        seq.row = -1

    def append_page(self, seq: Sequence) -> int:
        page = self._take()
        seq.pages.append(page)
        return page

    def free(self, seq: Sequence) -> None:
        for page in seq.pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free_pages.append(page)
        seq.pages = []
        self.free_row(seq)
        seq.num_cached = 0

    def _take(self) -> int:
        page = self.free_pages.popleft()
        self.refs[page] = 1
        return page
