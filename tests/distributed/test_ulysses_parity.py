"""Ulysses sequence parallelism at sp = 2 against sp = 1 (gloo, CPU, the tiny model): the same
log-probs and entropies, the same gradients and update (composed with FSDP2 as in training),
also when a slice predicts no response token, when key/value heads must be repeated, and for
plain forwards that carry no sequence-parallel split (generate)."""

from __future__ import annotations

import dist_helpers as h
import pytest
import torch
import torch.distributed as tdist

from minirl.batch import MicroBatching, RolloutBatch, response_mask, split_micro
from minirl.dist import spmd
from minirl.dist.launchers import spawn
from minirl.errors import UserError
from minirl.forward.packed import response_logprobs
from minirl.models import assembly
from minirl.models.presets import preset_config
from minirl.plugins import PluginManager
from minirl_plugins.parallel import ulysses

pytestmark = pytest.mark.distributed

CPU = torch.device("cpu")
SP_CFG = (
    "trainer.world_size=2",
    "actor.ulysses_sequence_parallel_size=2",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "actor.optim.lr=0.01",
    "actor.optim.eps=1e-4",
)


def _loss(model, prompts, responses):
    """A token-mean policy-gradient-like loss with an entropy term (both gathered outputs)."""
    logp, ent = response_logprobs(model, prompts, responses, 0.7, CPU, with_entropy=True)
    adv = torch.linspace(-1.0, 1.0, logp.numel())
    return (-(logp * adv) - 0.01 * ent).sum() / logp.numel(), logp.detach(), ent.detach()


def _compare_training(plain, actor, pm, cfg, prompts, responses, results, tag):
    opt_plain, _ = assembly.build_optimizer(pm, plain, cfg.actor.optim, 10)
    opt_actor, _ = assembly.build_optimizer(pm, actor, cfg.actor.optim, 10)
    loss_p, logp_p, ent_p = _loss(plain, prompts, responses)
    loss_a, logp_a, ent_a = _loss(actor, prompts, responses)
    loss_p.backward()
    loss_a.backward()
    results[f"{tag}_logprob_err"] = h.max_err(logp_a, logp_p)
    results[f"{tag}_entropy_err"] = h.max_err(ent_a, ent_p)
    results[f"{tag}_grad_err"] = h.max_param_err(actor, plain, grads=True)
    opt_plain.step()
    opt_actor.step()
    results[f"{tag}_param_err"] = h.max_param_err(actor, plain)


def _kv_repeat(dist, results):
    """One key/value head, sp = 2: each head is repeated to 2 before the all-to-all."""
    plain, sp_model = h.tiny_model(num_key_value_heads=1), h.tiny_model(num_key_value_heads=1)
    cfg = h.config(*SP_CFG)
    ulysses.minirl_apply_sequence_parallel(model=sp_model, cfg=cfg.actor, mesh=dist.mesh)
    prompts, responses = h.sequences([5, 17, 3], [7, 2, 11], seed=4)
    _, logp_p, _ = _loss(plain, prompts, responses)
    loss, logp_s, _ = _loss(sp_model, prompts, responses)
    loss.backward()
    _loss(plain, prompts, responses)[0].backward()
    for p in sp_model.parameters():  # no FSDP here: sum the sp ranks' gradients by hand
        tdist.all_reduce(p.grad)
    results["kv_repeat_logprob_err"] = h.max_err(logp_s, logp_p)
    results["kv_repeat_grad_err"] = h.max_param_err(sp_model, plain, grads=True)


def _plain_forward(plain, actor, results):
    """A forward without the packed split (generate, padded batches) is attention unchanged."""
    ids = torch.tensor(h.sequences([9, 9], [0, 0], seed=5)[0])
    with torch.no_grad():
        results["plain_forward_err"] = h.max_err(actor(input_ids=ids).logits, plain(input_ids=ids).logits)


def _worker(rank: int, out_path: str) -> None:
    cfg = h.config(*SP_CFG)
    dist = spmd.init_from_env(cfg)
    pm = PluginManager(entry_points=False)
    results = {}
    plain = h.tiny_model()
    actor = assembly.assemble_actor(pm, h.tiny_model(), cfg, dist)
    results["sharded_and_sp"] = hasattr(actor, "minirl_sequence_parallel") and all(
        hasattr(p, "full_tensor") for p in actor.parameters()
    )
    prompts, responses = h.sequences([5, 9, 3, 12], [7, 2, 11, 4])  # 53 tokens: padded to 54
    _compare_training(plain, actor, pm, cfg, prompts, responses, results, "mixed")
    _plain_forward(plain, actor, results)
    # a long prompt: the first slice holds prompt tokens only and predicts nothing
    plain, actor = h.tiny_model(), assembly.assemble_actor(pm, h.tiny_model(), cfg, dist)
    prompts, responses = h.sequences([40], [3], seed=6)
    _compare_training(plain, actor, pm, cfg, prompts, responses, results, "empty_slice")
    ref = assembly.assemble_reference(pm, h.tiny_model().requires_grad_(False), cfg.ref, dist)
    with torch.no_grad():
        results["ref_logprob_err"] = h.max_err(
            response_logprobs(ref, prompts, responses, 1.0, CPU)[0],
            response_logprobs(h.tiny_model(), prompts, responses, 1.0, CPU)[0],
        )
    _kv_repeat(dist, results)
    h.write_results(out_path, rank, results)
    spmd.shutdown()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ulysses") / "results.json"
    assert spawn.spawn(_worker, 2, (str(out),)) == 0, "a worker failed: see its traceback above"
    return h.read_results(out)


def test_actor_is_sequence_parallel_and_sharded(results):
    assert results["sharded_and_sp"]


@pytest.mark.parametrize("tag", ["mixed", "empty_slice"])
def test_same_logprobs_gradients_and_update_as_sp1(results, tag):
    """sp = 2 (+ FSDP2 over both ranks) gives sp = 1's log-probs, entropies, gradients and
    AdamW update; "empty_slice": one slice predicts no token and must still run backward."""
    assert results[f"{tag}_logprob_err"] < 1e-5 and results[f"{tag}_entropy_err"] < 1e-5
    assert results[f"{tag}_grad_err"] < 1e-6
    assert results[f"{tag}_param_err"] < 1e-6


def test_repeats_kv_heads_when_sp_exceeds_them(results):
    assert results["kv_repeat_logprob_err"] < 1e-5 and results["kv_repeat_grad_err"] < 1e-6


def test_forward_without_split_is_unchanged(results):
    assert results["plain_forward_err"] < 1e-5


def test_reference_is_sequence_parallel_too(results):
    assert results["ref_logprob_err"] < 1e-5


# ---------------------------------------------------------------------------------------------
# no processes needed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "heads, kv, sp, match",
    [
        (4, 2, 3, r"4 attention heads do not divide over 3 ranks; use a divisor of 4"),
        (12, 3, 2, r"3 key/value heads neither divide over 2 ranks nor repeat evenly up to 2"),
    ],
)
def test_heads_that_do_not_split_are_a_user_error(heads, kv, sp, match):
    """The error names actor.ulysses_sequence_parallel_size, the heads and the fix."""
    cfg = preset_config("tiny")
    cfg.num_attention_heads, cfg.num_key_value_heads = heads, kv
    with pytest.raises(UserError, match=r"actor\.ulysses_sequence_parallel_size = " + str(sp) + ".*" + match):
        ulysses.check_heads(cfg, sp, "actor.ulysses_sequence_parallel_size")


def test_token_budget_per_micro_batch_scales_with_sp():
    """Each GPU holds 1/sp of a micro-batch's tokens, so sp = 2 fits twice the tokens."""
    prompts, responses = h.sequences([10] * 4, [10] * 4)
    batch = RolloutBatch(prompts, responses, torch.arange(4), response_mask(responses, CPU))
    assert len(split_micro(batch, MicroBatching(1, True, 40), sp_size=1)) == 2
    assert len(split_micro(batch, MicroBatching(1, True, 40), sp_size=2)) == 1
