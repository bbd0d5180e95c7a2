"""FSDP2 at world size 2 against one process (gloo, CPU, the tiny model): the sharded actor must
compute the same loss, the same gradients and, after an AdamW step, the same parameters; the
sharded reference the same log-probs; a model that only rank 0 holds (the others on the meta
device) must end up with rank 0's weights; and the weight sync must hand the rollout engine
exactly the actor's full weights, one tensor at a time."""

from __future__ import annotations

import inspect

import dist_helpers as h
import pytest
import torch
import torch.distributed as tdist

from minirl.dist import spmd
from minirl.dist.launchers import spawn
from minirl.forward.packed import response_logprobs
from minirl.models import assembly
from minirl.models.loading import load_model_for_rank
from minirl.plugins import PluginManager

pytestmark = pytest.mark.distributed

CPU = torch.device("cpu")
PROMPT_LENS, RESPONSE_LENS = [5, 9, 3, 12], [7, 2, 11, 4]  # rank r owns sequences 2r, 2r+1


def _loss(model, idx, prompts, responses, adv_R, total_tokens):
    """-Σ logp·adv / (global token count) over the sequences idx (docs/algorithms.md §6 token-mean)."""
    logp_R, _ = response_logprobs(model, [prompts[i] for i in idx], [responses[i] for i in idx], 1.0, CPU)
    offsets = [0]
    for n in RESPONSE_LENS:
        offsets.append(offsets[-1] + n)
    adv = torch.cat([adv_R[offsets[i] : offsets[i + 1]] for i in idx])
    return -(logp_R * adv).sum() / total_tokens


def _train_step(plain, actor, pm, cfg, rank, results):
    prompts, responses = h.sequences(PROMPT_LENS, RESPONSE_LENS)
    adv_R = torch.linspace(-1.0, 1.5, sum(RESPONSE_LENS))
    total = float(sum(RESPONSE_LENS))
    opt_plain, _ = assembly.build_optimizer(pm, plain, cfg.actor.optim, 10)
    opt_actor, _ = assembly.build_optimizer(pm, actor, cfg.actor.optim, 10)
    loss_plain = _loss(plain, range(4), prompts, responses, adv_R, total)
    loss_local = _loss(actor, [2 * rank, 2 * rank + 1], prompts, responses, adv_R, total)
    loss_plain.backward()
    loss_local.backward()
    results["loss_err"] = h.max_err(h_sum(loss_local.detach()), loss_plain)
    results["grad_err"] = h.max_param_err(actor, plain, grads=True)
    norm_actor = torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
    norm_plain = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    results["grad_norm_err"] = abs(float(norm_actor) - float(norm_plain))
    opt_plain.step()
    opt_actor.step()
    results["param_err"] = h.max_param_err(actor, plain)
    results["params_moved"] = h.max_param_err(plain, h.tiny_model())


def h_sum(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    tdist.all_reduce(out)
    return out


def _weight_sync(actor, plain, engine, results):
    """The sync path of the trainer: engine.load_weights(assembly.full_weights(actor))."""
    from minirl_plugins.engines.native.weights import weights_checksum

    stale = engine.checksum(torch.float32)
    weights = assembly.full_weights(actor)
    results["sync_is_lazy"] = inspect.isgenerator(weights)
    engine.load_weights(weights)
    actor_sum = weights_checksum(assembly.full_weights(actor), torch.float32)
    results["engine_checksum_matches"] = engine.checksum(torch.float32) == actor_sum
    results["engine_checksum_changed"] = engine.checksum(torch.float32) != stale
    names = [name for name, _ in assembly.full_weights(actor)]
    results["sync_names_are_hf"] = names == [name for name, _ in plain.named_parameters()]


def _reference(pm, cfg, dist, rank, results):
    plain = h.tiny_model().eval().requires_grad_(False)
    ref = assembly.assemble_reference(pm, h.tiny_model().eval().requires_grad_(False), cfg.ref, dist)
    prompts, responses = h.sequences(PROMPT_LENS, RESPONSE_LENS, seed=1)
    mine = [2 * rank, 2 * rank + 1]
    with torch.no_grad():
        want, _ = response_logprobs(plain, [prompts[i] for i in mine], [responses[i] for i in mine], 0.7, CPU)
        got, _ = response_logprobs(ref, [prompts[i] for i in mine], [responses[i] for i in mine], 0.7, CPU)
    results["ref_logprob_err"] = float(h_max(torch.tensor(h.max_err(got, want))))
    # stored in the compute dtype (plugins/parallel/fsdp2.py freeze): sharded in bf16, equal to the actor
    # that computes in bf16 from float32 master weights
    bf16 = h.config(
        "trainer.world_size=2", "actor.fsdp_config.param_dtype=bfloat16", "ref.fsdp_config.param_dtype=bfloat16"
    )
    ref16 = assembly.assemble_reference(pm, h.tiny_model().eval().requires_grad_(False), bf16.ref, dist)
    actor16 = assembly.assemble_actor(pm, h.tiny_model(), bf16, dist)
    results["bf16_ref_is_sharded_bf16"] = all(
        hasattr(p, "to_local") and p.to_local().dtype == torch.bfloat16 for p in ref16.parameters()
    )
    with torch.no_grad():
        want, _ = response_logprobs(actor16, [prompts[i] for i in mine], [responses[i] for i in mine], 0.7, CPU)
        got, _ = response_logprobs(ref16, [prompts[i] for i in mine], [responses[i] for i in mine], 0.7, CPU)
    results["bf16_ref_logprob_err"] = float(h_max(torch.tensor(h.max_err(got, want))))


def h_max(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    tdist.all_reduce(out, op=tdist.ReduceOp.MAX)
    return out


def _rank0_loading(pm, cfg, dist, rank, ckpt_dir, results):
    """A checkpoint directory is read by rank 0 only; rank 1 builds the model on the meta device
    (load_model_for_rank) and FSDP2 fills its shards from rank 0's weights."""
    from minirl.config.schema import ModelConfig
    from minirl.models.tokenizers import byte_tokenizer
    from minirl_plugins.engines.native.weights import weights_checksum

    want = h.tiny_model(seed=7)
    if rank == 0:
        want.save_pretrained(ckpt_dir)
        byte_tokenizer().save_pretrained(ckpt_dir)
    tdist.barrier()
    model, _ = load_model_for_rank(ModelConfig(path=ckpt_dir), dist, torch.float32)
    results["rank1_model_was_meta"] = bool(
        h_max(torch.tensor(float(all(p.is_meta for p in model.parameters()) if rank == 1 else 0.0))).item()
    )
    sharded = assembly.assemble_actor(pm, model, cfg, dist)
    mismatch = weights_checksum(assembly.full_weights(sharded), torch.float32) != weights_checksum(
        want.named_parameters(), torch.float32
    )
    results["rank0_load_checksum_matches"] = not bool(h_max(torch.tensor(float(mismatch))).item())
    prompts, responses = h.sequences([6, 4], [5, 3], seed=2)
    with torch.no_grad():
        err = h.max_err(
            response_logprobs(sharded, prompts, responses, 1.0, CPU)[0],
            response_logprobs(want, prompts, responses, 1.0, CPU)[0],
        )
    results["rank0_load_logprob_err"] = float(h_max(torch.tensor(err)))  # RoPE buffers came along too


def _worker(rank: int, out_path: str, ckpt_dir: str) -> None:
    from minirl.protocols import EngineContext
    from minirl_plugins.engines.native import build_native_engine

    # Adam's first step is lr·g/(|g| + eps): near-zero gradients turn float noise into large
    # relative differences; a larger eps keeps the comparison about sharding, not about that
    cfg = h.config(
        "trainer.world_size=2",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
        "actor.optim.lr=0.01",
        "actor.optim.eps=1e-4",
    )
    dist = spmd.init_from_env(cfg)
    pm = PluginManager(entry_points=False)
    results = {}
    plain = h.tiny_model()
    actor = assembly.assemble_actor(pm, h.tiny_model(), cfg, dist)
    results["actor_is_sharded"] = all(hasattr(p, "full_tensor") for p in actor.parameters())
    ctx = EngineContext(
        plain.config, actor, CPU, torch.float32, (plain.config.eos_token_id,), 0, extra={"max_model_len": 64}
    )
    engine = build_native_engine(cfg.rollout, ctx)
    _train_step(plain, actor, pm, cfg, rank, results)
    _weight_sync(actor, plain, engine, results)
    _reference(pm, cfg, dist, rank, results)
    _rank0_loading(pm, cfg, dist, rank, ckpt_dir, results)
    h.write_results(out_path, rank, results)
    spmd.shutdown()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2") / "results.json"
    ckpt_dir = tmp_path_factory.mktemp("fsdp2_checkpoint")
    assert spawn.spawn(_worker, 2, (str(out), str(ckpt_dir))) == 0, "a worker failed: see its traceback above"
    return h.read_results(out)


def test_actor_parameters_are_sharded(results):
    """Every actor parameter is a DTensor shard after assembly (the plugin acted at world 2)."""
    assert results["actor_is_sharded"]


def test_same_loss_as_one_process(results):
    """Each rank's loss is its part of the global token-mean; their sum is the whole loss."""
    assert results["loss_err"] < 1e-6


def test_same_gradients_as_one_process(results):
    """Gradients are summed, not averaged, over ranks: exactly the one-process gradient."""
    assert results["grad_err"] < 1e-6
    assert results["grad_norm_err"] < 1e-5


def test_same_parameters_after_an_optimizer_step(results):
    """AdamW on the shards gives the one-process update (and the update is not a no-op)."""
    assert results["params_moved"] > 1e-3
    assert results["param_err"] < 1e-6


def test_sharded_reference_gives_the_same_logprobs(results):
    """The reference model is sharded too and computes the same log-probs."""
    assert results["ref_logprob_err"] < 1e-6


def test_a_bf16_reference_is_stored_sharded_in_bf16_and_equals_the_bf16_actor(results):
    """With param_dtype bfloat16 the reference's shards are bf16 (no float32 master copy), and its
    log-probs equal those of the actor computing in bf16 at the same weights, exactly."""
    assert results["bf16_ref_is_sharded_bf16"]
    assert results["bf16_ref_logprob_err"] == 0.0


def test_checkpoint_read_by_rank0_only_loads_into_every_shard(results):
    """A checkpoint is materialised on rank 0 only (rank 1 holds a meta model); the shards of
    the others come from it, buffers included."""
    assert results["rank1_model_was_meta"]
    assert results["rank0_load_checksum_matches"]
    assert results["rank0_load_logprob_err"] < 1e-6


def test_weight_sync_gives_the_engine_the_actor_weights(results):
    """After the step, the engine's checksum equals the actor's full weights', name for name;
    full_weights is a generator (one gathered tensor at a time)."""
    assert results["sync_is_lazy"] and results["sync_names_are_hf"]
    assert results["engine_checksum_changed"] and results["engine_checksum_matches"]


# ---------------------------------------------------------------------------------------------
# no processes needed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device, param_dtype, model_dtype, want",
    [
        ("cuda", "auto", torch.float32, (torch.bfloat16, torch.float32)),  # bf16 compute, fp32 reduce
        ("cpu", "auto", torch.float32, (None, None)),  # CPU: the model's own dtype, no cast at all
        ("cpu", "auto", torch.bfloat16, (None, torch.float32)),  # bf16 weights still reduce in fp32
        ("cpu", "float16", torch.float32, (torch.float16, torch.float32)),
    ],
)
def test_mixed_precision_policy(device, param_dtype, model_dtype, want):
    from minirl.config.schema import FSDPConfig
    from minirl_plugins.parallel import fsdp2

    model = torch.nn.Linear(2, 2).to(model_dtype)
    mp = fsdp2.mixed_precision(FSDPConfig(param_dtype=param_dtype), device, model)
    assert (mp.param_dtype, mp.reduce_dtype) == want


def test_unknown_fsdp_dtype_is_refused_up_front():
    """The plugin takes fsdp_config's dtypes as given: validation refuses an unknown one."""
    from minirl.config.load import load_config
    from minirl.validate.values import CHOICES, choice_problems

    cfg = load_config(None, ["actor.fsdp_config.param_dtype=fp8", "ref.fsdp_config.reduce_dtype=fp8"])
    keys = [p.key for p in choice_problems(cfg, CHOICES)]
    assert keys == ["actor.fsdp_config.param_dtype", "ref.fsdp_config.reduce_dtype"]


@pytest.fixture
def one_rank_mesh(tmp_path):
    """A 1-process gloo group and its CPU mesh, as a one-GPU run has (there on CUDA)."""
    from torch.distributed.device_mesh import init_device_mesh

    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        tdist.destroy_process_group()


def test_one_process_keeps_a_frozen_reference_plain_in_its_compute_dtype(one_rank_mesh):
    """At world 1 the reference is not wrapped (nothing to shard): it is stored in the compute
    dtype, its RoPE buffer stays float32, and it gives exactly the log-probs of the FSDP2 actor
    that computes in that dtype from float32 master weights (KL 0 at identical weights)."""
    from torch.distributed.fsdp import FSDPModule

    from minirl_plugins.parallel import fsdp2

    cfg = h.config("actor.fsdp_config.param_dtype=bfloat16", "ref.fsdp_config.param_dtype=bfloat16")
    ref = h.tiny_model().eval().requires_grad_(False)
    assert fsdp2.minirl_apply_data_parallel(model=ref, cfg=cfg.ref, mesh=one_rank_mesh) is ref
    actor = fsdp2.minirl_apply_data_parallel(model=h.tiny_model(), cfg=cfg.actor, mesh=one_rank_mesh)
    assert isinstance(actor, FSDPModule) and not isinstance(ref, FSDPModule)
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in ref.buffers()} == {torch.float32}
    prompts, responses = h.sequences([5, 8], [6, 3], seed=4)
    with torch.no_grad():
        want, _ = response_logprobs(actor, prompts, responses, 0.7, CPU)
        got, _ = response_logprobs(ref, prompts, responses, 0.7, CPU)
    assert want.dtype == got.dtype and torch.equal(got, want)


@pytest.mark.parametrize("keys", [("ref.offload=true",), ("ref.fsdp_config.param_offload=true",)])
def test_freeze_asks_for_cpu_offload_of_an_offloaded_reference_on_cuda(one_rank_mesh, keys):
    """ref.offload (or ref.fsdp_config.param_offload): `freeze` returns an FSDP config with CPU
    offload for the one-process reference on CUDA (parallelize then shards it, as the actor's
    offload tests show); on CPU there is nothing to offload and it stays plain."""
    from minirl_plugins.parallel import fsdp2

    cfg = h.config(*keys)
    assert fsdp2.freeze(h.tiny_model(), cfg.ref, "cuda").param_offload
    assert fsdp2.freeze(h.tiny_model(), cfg.ref, "cpu") is None
    model = h.tiny_model()
    fsdp2.freeze(model, cfg.ref, "cuda")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # "auto" on CUDA


def test_optimizer_offload_hooks_the_built_optimizer():
    """optimizer_offload: the optimizer the optim plugin builds gets step hooks that keep its
    state on the CPU between steps (FSDP2 marks the actor; here the mark is set by hand)."""
    from minirl_plugins.parallel import fsdp2

    model = torch.nn.Linear(4, 4)
    setattr(model, fsdp2._OPTIMIZER_OFFLOAD, True)
    cfg = h.config()
    optimizer, _ = assembly.build_optimizer(PluginManager(entry_points=False), model, cfg.actor.optim, 10)
    assert len(optimizer._optimizer_step_pre_hooks) == 1 and len(optimizer._optimizer_step_post_hooks) == 1
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    assert all(v.device.type == "cpu" for s in optimizer.state.values() for v in s.values())


def _trained_lora(cfg):
    """The tiny model with LoRA adapters an update could have reached (fresh B is zero)."""
    from minirl.models import lora

    model = lora.apply_lora(h.tiny_model(), cfg.model, "tiny")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora.is_adapter_param(name):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    return model


def test_one_process_weight_sync_reads_the_shards_as_they_lie(one_rank_mesh, monkeypatch):
    """At world 1 a sharded parameter's shard is the whole tensor: full_tensor hands over the
    shard's own storage without going through DTensor's redistribution (its host time, per
    parameter of every sync), with the values DTensor's full_tensor gives; the merged LoRA weights
    of the sync equal those of the model before it was sharded."""
    from torch.distributed.tensor import DTensor

    from minirl.models import assembly
    from minirl.models.names import full_tensor
    from minirl_plugins.parallel import fsdp2

    cfg = h.config("model.lora_rank=4", "model.lora_alpha=8")
    model = _trained_lora(cfg)
    plain = {assembly.hf_name(n): t.clone() for n, t in assembly.full_weights(model)}
    actor = fsdp2.minirl_apply_data_parallel(model=model, cfg=cfg.actor, mesh=one_rank_mesh)
    params = [p for p in actor.parameters() if p.requires_grad]  # the frozen base is not sharded
    assert params and all(hasattr(p, "full_tensor") for p in params)
    gathered = {id(p): p.full_tensor() for p in params}
    calls = []
    original = DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor", lambda self, **kw: calls.append(1) or original(self, **kw))
    for p in params:
        got = full_tensor(p)
        assert got.untyped_storage().data_ptr() == p.to_local().untyped_storage().data_ptr()
        assert torch.equal(got, gathered[id(p)])
    synced = dict(assembly.full_weights(actor))
    assert calls == []
    assert synced.keys() == plain.keys()
    assert all(torch.equal(synced[name], plain[name]) for name in plain)


def test_lora_holds_its_frozen_embedding_in_the_gather_dtype_with_the_same_results(one_rank_mesh):
    """LoRA under FSDP2 gathering in bf16 (every CUDA run): the frozen input embedding held in bf16
    (lora.hold_frozen_in's `embedding`, what LoRAFineTuning does under a mesh) gives exactly the
    log-probs and adapter gradients of the float32 one that FSDP2 casts at every gather, with 2
    bytes an element freed; without a mesh the adapter leaves it alone."""
    import types

    from minirl.adapter.lora import LoRAFineTuning
    from minirl.forward.packed import param_dtype
    from minirl.models import lora
    from minirl_plugins.parallel import fsdp2

    cfg = h.config("model.lora_rank=4", "model.lora_alpha=8", "actor.fsdp_config.param_dtype=bfloat16")
    gathered = param_dtype(cfg.actor.fsdp_config, "cpu")
    assert gathered == torch.bfloat16
    prompts, responses = h.sequences([5, 8], [6, 3], seed=4)

    def run(embedding):
        model = _trained_lora(cfg)
        freed = lora.hold_frozen_in(model, torch.bfloat16, embedding=embedding)
        # the frozen base sharded, as across ranks (at world 1 it stays out of FSDP2: next test)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fsdp2, "frozen_outside", lambda *args: set())
            actor = fsdp2.minirl_apply_data_parallel(model=model, cfg=cfg.actor, mesh=one_rank_mesh)
        logp, _ = response_logprobs(actor, prompts, responses, 0.7, CPU)
        logp.float().sum().backward()
        grads = {n: p.grad.full_tensor() for n, p in actor.named_parameters() if p.requires_grad}
        return freed, logp.detach(), grads, actor.get_input_embeddings().weight.dtype

    (freed0, want, want_grads, dtype0), (freed, got, got_grads, dtype) = run(None), run(gathered)
    embed_numel = h.tiny_model().get_input_embeddings().weight.numel()
    assert (dtype0, dtype) == (torch.float32, torch.bfloat16) and freed - freed0 == 2 * embed_numel
    assert torch.equal(got, want)
    assert want_grads.keys() == got_grads.keys() and all(torch.equal(got_grads[n], g) for n, g in want_grads.items())
    # the adapter: under a mesh the embedding goes to the gather dtype, without one it stays
    pm = PluginManager(entry_points=False)
    for mesh, want_dtype in ((None, torch.float32), (one_rank_mesh, torch.bfloat16)):
        dist = types.SimpleNamespace(device=torch.device("cpu"), mesh=mesh)
        model = h.tiny_model()
        LoRAFineTuning.assemble(pm, model, cfg, dist, needs_reference=False)
        assert model.get_input_embeddings().weight.dtype == want_dtype


def test_one_process_leaves_a_lora_base_out_of_fsdp2_with_the_same_results(one_rank_mesh):
    """At world 1 the frozen base of a LoRA actor stays out of FSDP2 (nothing to shard, nothing to
    reduce; FSDP2 would copy it in and out of its gather buffer twice per micro-batch): plain
    tensors held in the gather dtype, only the adapters sharded. Log-probs, adapter gradients and
    an optimizer step equal those of the actor whose base FSDP2 manages, bit for bit."""
    from torch.distributed.fsdp import FSDPModule

    from minirl.models import lora
    from minirl_plugins.parallel import fsdp2

    cfg = h.config("model.lora_rank=4", "model.lora_alpha=8", "actor.fsdp_config.param_dtype=bfloat16")
    prompts, responses = h.sequences([5, 8], [6, 3], seed=4)
    pm = PluginManager(entry_points=False)

    def run(outside: bool):
        model = _trained_lora(cfg)
        lora.hold_frozen_in(model, torch.bfloat16, embedding=torch.bfloat16)
        with pytest.MonkeyPatch.context() as mp:
            if not outside:
                mp.setattr(fsdp2, "frozen_outside", lambda *args: set())
            actor = fsdp2.minirl_apply_data_parallel(model=model, cfg=cfg.actor, mesh=one_rank_mesh)
        held = {n: (hasattr(p, "full_tensor"), p.requires_grad, p.dtype) for n, p in actor.named_parameters()}
        optimizer, _ = assembly.build_optimizer(pm, actor, cfg.actor.optim, 10)
        logp, _ = response_logprobs(actor, prompts, responses, 0.7, CPU)
        logp.float().sum().backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in actor.named_parameters() if p.requires_grad}
        optimizer.step()
        after, _ = response_logprobs(actor, prompts, responses, 0.7, CPU)
        return actor, held, logp.detach(), grads, after.detach()

    _, managed, want, want_grads, want_after = run(outside=False)
    actor, held, got, got_grads, got_after = run(outside=True)
    assert isinstance(actor, FSDPModule) and all(isinstance(layer, FSDPModule) for layer in fsdp2.decoder_layers(actor))
    for name, (sharded, trains, dtype) in held.items():
        assert sharded == lora.is_adapter_param(name) == trains, name
        assert sharded or dtype == torch.bfloat16, (name, dtype)  # the norms too, as FSDP2 gathers them
    assert all(sharded for sharded, _, _ in managed.values())
    assert torch.equal(got, want) and torch.equal(got_after, want_after) and not torch.equal(got_after, got)
    assert want_grads.keys() == got_grads.keys() and all(torch.equal(got_grads[n], g) for n, g in want_grads.items())
    # a fully trained model (full fine-tuning) and a fully frozen one keep FSDP2's own handling
    full = h.tiny_model()
    assert fsdp2.frozen_outside(full, one_rank_mesh, cfg.actor.fsdp_config, torch.bfloat16) == set()
    assert fsdp2.frozen_outside(full.requires_grad_(False), one_rank_mesh, cfg.actor.fsdp_config, None) == set()


def test_a_lora_checkpoint_round_trips_with_the_base_out_of_fsdp2(one_rank_mesh, tmp_path):
    """The LoRA checkpoint (the adapters and their AdamW state, `trainable_only`) of a world-1
    actor whose frozen base FSDP2 leaves alone: written by DCP, read back over a changed actor,
    the adapters and the optimizer state are the saved ones again, the frozen base untouched."""
    import torch.distributed.checkpoint as dcp

    from minirl.checkpoint.state import Checkpointable
    from minirl.models import lora
    from minirl.models.names import full_tensor
    from minirl_plugins.parallel import fsdp2

    cfg = h.config("model.lora_rank=4", "model.lora_alpha=8", "actor.fsdp_config.param_dtype=bfloat16")
    model = _trained_lora(cfg)
    lora.hold_frozen_in(model, torch.bfloat16, embedding=torch.bfloat16)
    actor = fsdp2.minirl_apply_data_parallel(model=model, cfg=cfg.actor, mesh=one_rank_mesh)
    optimizer, _ = assembly.build_optimizer(PluginManager(entry_points=False), actor, cfg.actor.optim, 10)
    prompts, responses = h.sequences([5, 8], [6, 3], seed=4)

    def step():
        response_logprobs(actor, prompts, responses, 0.7, CPU)[0].float().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def values():
        params = {n: full_tensor(p).clone() for n, p in actor.named_parameters()}
        moments = [full_tensor(v).clone() for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
        return params, moments

    step()
    parts = Checkpointable(actor, optimizer, trainable_only=True)
    dcp.save(parts.state_dicts(), checkpoint_id=str(tmp_path / "ckpt"))
    saved, saved_moments = values()
    step()  # the adapters and the moments move on
    moved, _ = values()
    assert any(not torch.equal(moved[n], saved[n]) for n in saved if lora.is_adapter_param(n))
    state = parts.state_dicts()
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    parts.load_state_dicts(state)
    restored, restored_moments = values()
    assert restored.keys() == saved.keys() and all(torch.equal(restored[n], saved[n]) for n in saved)
    assert len(restored_moments) == len(saved_moments) > 0
    assert all(torch.equal(a, b) for a, b in zip(restored_moments, saved_moments))
