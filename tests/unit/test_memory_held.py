"""What holds the memory (minirl/observe/memory.py): each storage counted once, under the first
holder that names it, on the training device only; a LoRA actor's account against the sizes its
parameters have by count, and what a CPU run logs."""

from __future__ import annotations

import copy

import pytest
import torch

from minirl.config.load import load_config
from minirl.models import lora
from minirl.models.loading import random_model
from minirl.models.presets import preset_config
from minirl.observe.memory import GIB, StorageCounter, _same_device, held_memory, memory_line
from minirl_plugins.algorithms.optim import build_adamw

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_a_storage_counts_once_whatever_views_of_it_are_named():
    counter = StorageCounter(torch.device("cpu"))
    fused = torch.zeros(10, 4)
    assert counter.count([fused[:6], fused[6:], None]) == 10 * 4 * 4  # the whole storage, once
    assert counter.count([fused]) == 0  # already counted (under another holder)
    other = torch.zeros(3, dtype=torch.bfloat16)
    assert counter.count([other, other.view(3, 1)]) == 3 * 2
    assert StorageCounter(torch.device("meta")).count([torch.zeros(5)]) == 0  # not on that device
    # an engine built on "cuda" holds tensors on cuda:0: the same device; cuda:1 is not
    cuda, cuda0, cuda1 = torch.device("cuda"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert _same_device(cuda0, cuda) and _same_device(cuda, cuda0) and not _same_device(cuda0, cuda1)
    assert not _same_device(torch.device("cpu"), cuda)


def _lora_actor():
    cfg = load_config(None, ["model.lora_rank=4", "model.lora_alpha=8"]).model
    return lora.apply_lora(random_model(preset_config("tiny"), "cpu", torch.float32, 0), cfg, "tiny")


def test_a_lora_actor_holds_its_adapters_their_adamw_state_and_the_frozen_base():
    """By count: trained = the adapters, frozen = everything else (a tied lm_head once), the
    gradients as large as the adapters, AdamW two moments per adapter (and a step count each);
    a reference that is the actor (LoRA's) adds nothing, a model of its own its parameters."""
    actor = _lora_actor()
    optimizer, _ = build_adamw(actor, load_config(None, []).actor.optim, total_steps=2)
    adapters = [p for n, p in actor.named_parameters() if lora.is_adapter_param(n)]
    trained = sum(p.numel() * 4 for p in adapters)
    frozen = sum(p.numel() * 4 for n, p in actor.named_parameters() if not lora.is_adapter_param(n))
    before = held_memory("cpu", actor, optimizer, reference=actor)
    assert before == {
        "memory_gib/held/actor.trained": trained / GIB,
        "memory_gib/held/actor.frozen": frozen / GIB,
        "memory_gib/held/actor.gradients": trained / GIB,
        "memory_gib/held/actor.optimizer": 0.0,  # AdamW makes its state at the first step
    }
    sum(p.sum() for p in adapters).backward()
    optimizer.step()
    state = held_memory("cpu", actor, optimizer)["memory_gib/held/actor.optimizer"] * GIB
    assert 2 * trained <= state <= 2 * trained + 8 * len(adapters)  # exp_avg, exp_avg_sq, step
    reference = copy.deepcopy(actor)
    assert held_memory("cpu", actor, optimizer, reference)["memory_gib/held/reference"] == (trained + frozen) / GIB


def test_the_memory_line_reads_a_steps_metrics():
    metrics = {
        "memory_gib/held/actor.frozen": 2.93,
        "memory_gib/held/actor.trained": 0.01,  # under 0.05: left out
        "memory_gib/held/engine.kv_cache": 40.0,
        "memory_gib/gen": 50.2,
        "memory_gib/update_actor": 61.0,
        "memory_gib/step": 61.0,
    }
    line = memory_line(metrics)
    assert line.startswith("memory (GiB): held: actor.frozen 2.9, engine.kv_cache 40.0; phase peaks: update_actor 61.0")
    assert "actor.trained" not in line and "step 61" not in line
    assert memory_line({"memory_gib/held/actor.frozen": 1.0}) is None  # no phase peaks: not CUDA
