"""The value cache's two layouts (kv_layout): token-major, and page-transposed for the e4m3 decode
kernel. Reads and writes through either land on the same vectors, and a whole page is the same
bytes in both, so page copies need no change."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl_plugins.engines.native.layers import kv_layout


@settings(max_examples=60, deadline=None)
@given(
    pages=st.integers(1, 6),
    page=st.sampled_from([1, 4, 16]),
    hk=st.integers(1, 3),
    d=st.sampled_from([2, 8]),
    seed=st.integers(0, 2**31 - 1),
)
def test_both_layouts_read_and_write_the_same_vectors(pages, page, hk, d, seed):
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(pages * page, hk, d, generator=gen)
    paged = kv_layout.transposed_pages(flat, page)
    assert paged.shape == (pages, hk, d, page)
    slots = torch.randint(0, pages * page, (2, 5), generator=gen)
    assert torch.equal(kv_layout.read_rows(paged, slots), flat[slots])
    new = torch.randperm(pages * page, generator=gen)[: min(7, pages * page)]
    x = torch.randn(len(new), hk, d, generator=gen)
    kv_layout.write_rows(paged, new, x)
    kv_layout.write_rows(flat, new, x)
    assert torch.equal(paged, kv_layout.transposed_pages(flat, page))
    # the runner copies whole pages of the raw cache (prefix sharing): in the page-transposed
    # view the copied page then holds the source page's vectors
    src, dst = (int(x) for x in torch.randint(0, pages, (2,), generator=gen))
    raw = paged.reshape(pages, -1)
    want = kv_layout.read_rows(paged, src * page + torch.arange(page))
    raw[dst] = raw[src].clone()
    assert torch.equal(kv_layout.read_rows(paged, dst * page + torch.arange(page)), want)


def test_layer_values_views_the_runner_cache_without_a_copy():
    kv = torch.arange(2 * 3 * 32 * 2 * 4, dtype=torch.float32).view(2, 3, 32, 2, 4)
    v = kv_layout.layer_values(kv, 1, 16, transposed=True)
    assert v.shape == (2, 2, 4, 16) and v.data_ptr() == kv[1, 1].data_ptr()
    assert kv_layout.layer_values(kv, 1, 16, transposed=False).shape == (32, 2, 4)
