"""LoRA under FSDP2 at world size 2 against one process (gloo, CPU, the tiny model): the sharded
LoRA actor computes the same adapter gradients and, after an AdamW step, the same adapters; the
frozen base gets no gradient; the weight sync hands the engine the merged weights of exactly
those adapters; and the reference (adapters disabled) gives the base model's log-probs."""

from __future__ import annotations

import copy

import dist_helpers as h
import pytest
import torch
import torch.distributed as tdist

from minirl.dist import spmd
from minirl.dist.launchers import spawn
from minirl.forward.packed import response_logprobs
from minirl.models import assembly, lora
from minirl.models.checksum import weights_checksum
from minirl.plugins import PluginManager

pytestmark = pytest.mark.distributed

CPU = torch.device("cpu")
PROMPT_LENS, RESPONSE_LENS = [5, 9, 3, 12], [7, 2, 11, 4]  # rank r owns sequences 2r, 2r+1


def _lora(model, cfg):
    model = lora.apply_lora(model, cfg.model, "tiny")
    with torch.no_grad():  # adapters an update could have reached (fresh B is zero)
        gen = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():
            if lora.is_adapter_param(name):
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _loss(model, idx, prompts, responses, adv_R):
    logp_R, _ = response_logprobs(model, [prompts[i] for i in idx], [responses[i] for i in idx], 1.0, CPU)
    offsets = [0]
    for n in RESPONSE_LENS:
        offsets.append(offsets[-1] + n)
    adv = torch.cat([adv_R[offsets[i] : offsets[i + 1]] for i in idx])
    return -(logp_R * adv).sum() / float(sum(RESPONSE_LENS))


def _max(x: float) -> float:
    out = torch.tensor(x)
    tdist.all_reduce(out, op=tdist.ReduceOp.MAX)
    return float(out)


def _worker(rank: int, out_path: str) -> None:
    from minirl.protocols import EngineContext
    from minirl_plugins.engines.native import build_native_engine

    cfg = h.config(
        "trainer.world_size=2",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
        "actor.optim.lr=0.01",
        "actor.optim.eps=1e-4",
        "model.lora_rank=4",
        "model.lora_alpha=8",
    )
    dist = spmd.init_from_env(cfg)
    pm = PluginManager(entry_points=False)
    plain = _lora(h.tiny_model(), cfg)
    base = h.tiny_model()
    actor = assembly.assemble_actor(pm, _lora(h.tiny_model(), cfg), cfg, dist)
    results = {"actor_is_sharded": all(hasattr(p, "full_tensor") for p in actor.parameters())}
    ctx = EngineContext(base.config, actor, CPU, torch.float32, (base.config.eos_token_id,), 0, {"max_model_len": 64})
    engine = build_native_engine(cfg.rollout, ctx)
    prompts, responses = h.sequences(PROMPT_LENS, RESPONSE_LENS)
    adv_R = torch.linspace(-1.0, 1.5, sum(RESPONSE_LENS))
    opt_plain, _ = assembly.build_optimizer(pm, plain, cfg.actor.optim, 10)
    opt_actor, _ = assembly.build_optimizer(pm, actor, cfg.actor.optim, 10)
    _loss(plain, range(4), prompts, responses, adv_R).backward()
    _loss(actor, [2 * rank, 2 * rank + 1], prompts, responses, adv_R).backward()
    trainable = [n for n, p in actor.named_parameters() if p.requires_grad]
    results["only_adapters_train"] = bool(trainable) and all(lora.is_adapter_param(n) for n in trainable)
    results["base_has_no_grad"] = all(p.grad is None for n, p in actor.named_parameters() if not p.requires_grad)
    grads = dict(plain.named_parameters())
    results["grad_err"] = max(h.max_err(p.grad, grads[n].grad) for n, p in actor.named_parameters() if p.requires_grad)
    opt_plain.step()
    opt_actor.step()
    results["param_err"] = h.max_param_err(actor, plain)
    engine.load_weights(assembly.full_weights(actor, adapted_only=True))
    want = weights_checksum(assembly.full_weights(actor), torch.float32)
    results["engine_holds_merged_adapters"] = engine.checksum(torch.float32) == want
    merged_plain = dict(lora.merged_weights(plain))
    results["merged_err"] = max(h.max_err(t, merged_plain[n]) for n, t in assembly.full_weights(actor))
    mine = [2 * rank, 2 * rank + 1]
    with torch.no_grad(), lora.adapters_disabled(actor):
        got, _ = response_logprobs(actor, [prompts[i] for i in mine], [responses[i] for i in mine], 1.0, CPU)
    with torch.no_grad():
        ref, _ = response_logprobs(
            copy.deepcopy(base), [prompts[i] for i in mine], [responses[i] for i in mine], 1.0, CPU
        )
    results["ref_logprob_err"] = _max(h.max_err(got, ref))
    h.write_results(out_path, rank, results)
    spmd.shutdown()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_fsdp2") / "results.json"
    assert spawn.spawn(_worker, 2, (str(out),)) == 0, "a worker failed: see its traceback above"
    return h.read_results(out)


def test_sharded_lora_actor_trains_only_its_adapters(results):
    assert results["actor_is_sharded"]
    assert results["only_adapters_train"] and results["base_has_no_grad"]


def test_sharded_lora_gradients_and_step_match_one_process(results):
    assert results["grad_err"] < 1e-6
    assert results["param_err"] < 1e-6


def test_sharded_lora_sync_and_reference(results):
    """The engine gets W + B A * alpha / r of the updated adapters, gathered from the shards; the
    reference with the adapters off is the base model."""
    assert results["engine_holds_merged_adapters"]
    assert results["merged_err"] < 1e-6
    assert results["ref_logprob_err"] < 1e-6
