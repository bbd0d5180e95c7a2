"""minirl.dist.transfer: host-to-device copies through pinned memory arrive intact."""

import pytest
import torch

from minirl.dist.transfer import tensor_to, to_device


def test_cpu_targets_and_none_are_plain_copies():
    t = torch.arange(5)
    assert to_device(t, None) is t
    assert torch.equal(to_device(t, "cpu"), t)
    got = tensor_to([3, 1, 2], torch.int32, torch.device("cpu"))
    assert got.dtype == torch.int32 and got.tolist() == [3, 1, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_copies_do_not_wait_for_the_device_and_arrive_intact():
    """Many copies whose host tensors die at once, queued behind a long matmul, under torch's
    sync debug mode (a copy that waited for the device would raise): none reads a staging buffer
    that another copy has reused (torch's pinned cache holds it until its copy ran)."""
    a = torch.randn(8192, 8192, device="cuda")
    _ = a @ a @ a  # keeps the stream busy while the copies are queued
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [tensor_to(list(range(i, i + 1000)), torch.long, "cuda") for i in range(200)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for i, g in enumerate(got):
        assert g.device.type == "cuda" and torch.equal(g.cpu(), torch.arange(i, i + 1000))
