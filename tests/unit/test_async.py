"""Asynchronous training, the parts that need no job: the staleness bound of the admission rule,
weight buckets, the link's messages and its weight broadcast (3 gloo processes), per-token weight
versions through a partial rollout, and the off-policy loss at staleness 0."""

from __future__ import annotations

import datetime
import socket
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

import minirl.update.actor as actor_lib
from minirl.async_training.stamps import token_versions
from minirl.async_training.worker import batch_limit
from minirl.config.schema import ActorConfig
from minirl.dist.link import Link, buckets
from minirl.models.checksum import weights_checksum
from minirl_plugins.engines.native import build_native_engine
from tests.tiny_models import PROMPTS, engine_context, greedy, tiny_config, tiny_hf_model
from tests.unit.test_masked_math import MODES, POLICY_LOSSES, _actor_loss, holed


@given(
    version=st.integers(0, 50),
    staleness=st.integers(0, 4),
    trigger=st.integers(1, 4),
    index=st.integers(0, 400),
)
def test_admitted_batches_are_never_staler_than_the_threshold(version, staleness, trigger, index):
    """A batch admitted at `version` (index below the limit) is trained at version index // trigger
    (or later weights never exist before it: the trainer has trained index batches by then), so
    its lag is at most the threshold; and the limit admits the next batch the trainer needs."""
    if index < batch_limit(version, staleness, trigger):
        assert index // trigger - version <= staleness
    # the batch the trainer waits for at version v (the first of its window) is always admitted
    assert version * trigger < batch_limit(version, staleness, trigger)


def test_staleness_zero_admits_only_the_current_window():
    assert [b for b in range(10) if b < batch_limit(2, 0, 1)] == [0, 1, 2]
    assert [b for b in range(10) if b < batch_limit(2, 1, 2)] == list(range(8))


@given(st.lists(st.lists(st.integers(1, 9), min_size=0, max_size=3), min_size=1, max_size=12), st.integers(1, 64))
def test_buckets_cover_every_tensor_once_in_order(shapes, bucket_mb):
    meta = [(f"w{i}", tuple(s) or (1,)) for i, s in enumerate(shapes)]
    groups = buckets(meta, torch.float32, bucket_mb)
    assert [i for g in groups for i in g] == list(range(len(meta)))
    assert all(g for g in groups)


def test_buckets_respect_the_size_limit():
    meta = [("a", (256, 1024)), ("b", (256, 1024)), ("c", (1024, 1024)), ("d", (8,))]  # 1, 1, 4 MiB, tiny
    assert buckets(meta, torch.float32, 2) == [[0, 1], [2], [3]]


def test_token_versions_follow_the_turns():
    assert token_versions([1, 1, 0, 0, 1], [3, 4, 4]) == [3, 4, 4, 4, 4]
    assert token_versions([0, 1, 1], [2, 3]) == [2, 2, 3]
    assert token_versions([1, 1, 1], [5, 6]) == [5, 5, 5]  # a loop that dropped a token: the oldest for all


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _link_worker(member: int, members: int, port: int, out):
    import os

    os.environ["MASTER_ADDR"], os.environ["MINIRL_LINK_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    link = Link.connect(member, members - 1, torch.device("cpu"), 60)
    torch.manual_seed(0)
    weights = [("a.weight", torch.randn(300, 7)), ("b.bias", torch.randn(11)), ("c.weight", torch.randn(64, 64))]
    if member == 0:
        link.put("greeting", {"hello": 1})
        link.publish_version()
        sent = link.send_weights(weights, torch.bfloat16, 0, weights_checksum)  # 0 MiB: a bucket per tensor
        out.put(("sent", sent["checksum"], sent["bytes"]))
    else:
        link.store.wait(["greeting"], datetime.timedelta(seconds=30))
        got = [(n, t.clone()) for n, t in link.receive_weights(torch.bfloat16, 0)]
        same = all(torch.equal(g, w.to(torch.bfloat16)) for (_, g), (_, w) in zip(got, weights))
        out.put(("got", member, same, weights_checksum(got, torch.bfloat16), link.version()))


def test_link_broadcasts_weights_exactly_to_every_rollout_rank():
    """The trainer (member 0) and two rollout ranks over gloo: every receiver gets the tensors
    bit for bit in the engines' dtype, and their checksum equals the sender's."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_link_worker, args=(m, 3, port, out)) for m in range(3)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in range(3)]
    for p in procs:
        p.join(30)
    (sent,) = [r for r in results if r[0] == "sent"]
    got = [r for r in results if r[0] == "got"]
    assert len(got) == 2 and sent[2] == (300 * 7 + 11 + 64 * 64) * 2
    for _, _, same, checksum, version in got:
        assert same and checksum == sent[1] and version == 1


def test_native_engine_stamps_each_token_with_its_weight_version():
    """A partial rollout: a request paused mid-turn, new weights (here the same values) loaded
    with a new version, continued. Its tokens equal an uninterrupted run's (the KV was kept), and
    the versions say which weights sampled each: 0 before the pause, 1 after."""
    cfg = tiny_config("qwen2")
    hf = tiny_hf_model(cfg, seed=2, std=0.2)
    eng = build_native_engine(None, engine_context(cfg, actor=hf, page_size=4))
    eng.submit("a", PROMPTS[0], greedy(max_new=20))
    outs = eng.step() + eng.step() + eng.step()
    eng.pause_generation()
    eng.load_weights(hf.named_parameters())
    eng.weight_version = 1
    eng.continue_generation()
    while eng.has_work():
        outs += eng.step()
    [out] = outs
    [want] = build_native_engine(None, engine_context(cfg, actor=hf, page_size=4)).generate(
        [PROMPTS[0]], greedy(max_new=20)
    )
    assert out.token_ids == want.token_ids
    assert out.versions[0] == 0 and out.versions[-1] == 1
    assert out.versions == sorted(out.versions) and len(out.versions) == len(out.token_ids)


@settings(deadline=None, max_examples=20)
@given(holed(), st.sampled_from(MODES), st.floats(1.0, 10.0))
def test_at_staleness_zero_the_async_loss_is_the_synchronous_loss(twins, mode, cap):
    """At staleness 0 the behaviour policy (the rollout's log-probs) and the proximal policy (the
    trainer's old log-probs) coincide. The asynchronous actor loss, decoupled PPO with the
    truncated importance weight min(exp(lp_prox - lp_behaviour), cap), is then the synchronous
    PPO loss without any weight: the same loss, metrics and gradients, bit for bit. (Bypass mode
    takes old := behaviour and is the same computation.)"""
    h, _, masks = twins
    h.x["roll"] = h.x["old"].clone()  # staleness 0: behaviour == proximal
    lens = [len(m) for m in masks]
    base = replace(ActorConfig(loss_agg_mode=mode, entropy_coeff=0.01), clip_ratio_low=0.2, clip_ratio_high=0.2)
    out = []
    for tis in (cap, -1.0):
        losses = actor_lib.Losses(POLICY_LOSSES["vanilla"])
        job = actor_lib.ActorUpdate(
            SimpleNamespace(model=None), replace(base, tis_imp_ratio_cap=tis), losses, 1.0, False
        )
        out.append(_actor_loss(h, lens, job))
    (loss_a, metrics_a, grad_a, _), (loss_s, metrics_s, grad_s, _) = out
    assert loss_a == loss_s
    assert torch.equal(grad_a, grad_s)
    assert {k: v for k, v in metrics_a.items() if "tis" not in k} == metrics_s
    assert metrics_a["tis_weight_mean"] == pytest.approx(1.0)
