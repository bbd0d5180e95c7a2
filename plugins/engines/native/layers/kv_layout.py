"""Where a token's keys and values lie in a layer's KV cache.

Keys are always token-major, [slots, Hk, D] (slot = page · page_size + offset). Values are too,
except under the e4m3 decode kernel (paged_attention._decode_kernel_e4m3), which reads them
page-transposed, [pages, Hk, D, page_size]: within a page each (head, dim) holds its page_size
tokens side by side, so the kernel loads V^T tiles 16 bytes wide and feeds them to fp8 tensor
cores without a transpose. A page is the same contiguous bytes in both layouts, so copying whole
pages (prefix sharing) needs no change. The ops take a 3-D value cache as token-major and a 4-D
one as page-transposed; these helpers read and write either.
"""

from __future__ import annotations

import torch


def layer_values(kv_cache: torch.Tensor, layer: int, page_size: int, transposed: bool) -> torch.Tensor:
    """Layer `layer`'s value cache out of the runner's [2, L, slots, Hk, D] tensor, as the ops read it."""
    v = kv_cache[1, layer]
    if not transposed:
        return v
    slots, hk, d = v.shape
    return v.view(slots // page_size, hk, d, page_size)


def read_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cached [..., Hk, D] vectors at `slots` (any shape), from either layout."""
    if cache.dim() == 3:
        return cache[slots]
    page = cache.shape[-1]
    return cache[slots // page, :, :, slots % page]


def write_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache at `slots` [N] = x [N, Hk, D], in either layout."""
    if cache.dim() == 3:
        cache[slots] = x
    else:
        page = cache.shape[-1]
        cache[slots // page, :, :, slots % page] = x


def transposed_pages(v_cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """A token-major value cache [slots, Hk, D] copied into the page-transposed layout."""
    slots, hk, d = v_cache.shape
    return v_cache.view(slots // page_size, page_size, hk, d).permute(0, 2, 3, 1).contiguous()
