"""FSDP2 (`fully_shard`) data parallelism of the actor, the reference and the critic: the assembly
step after activation checkpointing, active whenever there is a mesh (world size > 1, or CUDA).

In torchtitan's order, every decoder layer is its own FSDP unit, then the root takes what is left
(embeddings, final norm, lm_head), so a forward holds one gathered layer at a time. What the rest
of minirl relies on (docs/architecture.md, "The mesh and who owns what", has the reasons):
1. gradients are SUMMED over ranks, never averaged (`sum_gradients`); with Ulysses the FSDP
   group is the whole world (dp x sp);
2. the packed forward calls the decoder and the lm_head, not model.forward, so it runs inside
   the root's FSDP hooks through the PackedForward hook (`install_packed_forward`);
3. on CUDA bf16 compute copies over fp32 masters and fp32 gradient reduction; on CPU the model's
   own dtype, so one process and many give the same numbers;
4. fsdp_config.param_offload keeps shards, gradients and optimizer state on the CPU;
   optimizer_offload alone moves only the optimizer state there between steps;
5. a frozen model (the reference) is stored in its compute dtype, unwrapped at world 1 (`freeze`);
6. at world 1 the frozen parameters of a model that trains only some (LoRA's base) stay out of
   FSDP2 too, stored in the dtype it would gather them in (`frozen_outside`).
"""

from __future__ import annotations

import dataclasses
import types
import warnings

import torch
import torch.distributed as tdist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from minirl import hookimpl
from minirl.forward.packed import param_dtype
from minirl.protocols import PACKED_FORWARD

_OPTIMIZER_OFFLOAD = "_minirl_optimizer_offload"  # marks an actor whose optimizer state lives on the CPU


@hookimpl
def minirl_apply_data_parallel(model, cfg, mesh):
    if mesh is None:
        return None
    fsdp_cfg = cfg.fsdp_config
    if not any(p.requires_grad for p in model.parameters()):
        fsdp_cfg = freeze(model, cfg, mesh.device_type)
        if fsdp_cfg is None:
            return model
    parallelize(model, world_mesh(mesh), fsdp_cfg)
    return model


def freeze(model: torch.nn.Module, cfg, device_type: str):
    """Store a frozen model (the reference) in its compute dtype, as verl does: it has no optimizer
    to keep fp32 masters for, and its values are the actor's at the same weights (the same cast),
    so the KL at step 1 stays exactly 0. Floating buffers (RoPE's inv_freq) keep their dtype.

    Returns the FSDP config to shard it with (`ref.offload` counts as fsdp_config.param_offload),
    or None when one process has nothing to shard or offload: the model then stays plain, with no
    all-gather copies and no hooks around each layer."""
    fsdp_cfg = cfg.fsdp_config
    offload = fsdp_cfg.param_offload or getattr(cfg, "offload", False)
    store_in(model.parameters(), param_dtype(fsdp_cfg, device_type))
    if tdist.get_world_size() == 1 and not (offload and device_type == "cuda"):
        return None
    return dataclasses.replace(fsdp_cfg, param_offload=offload)


def parallelize(model: torch.nn.Module, mesh: DeviceMesh, fsdp_cfg) -> None:
    """Shard `model` in place over the 1-D `mesh`; weights of a meta-device model come from rank 0."""
    from_rank0 = _needs_rank0_weights(model, mesh)
    full_state = model.state_dict() if from_rank0 and mesh.get_rank() == 0 else {}
    mp = mixed_precision(fsdp_cfg, mesh.device_type, model)
    ignored = frozen_outside(model, mesh, fsdp_cfg, mp.param_dtype)
    apply_fsdp(model, mesh, mp, offload_policy(fsdp_cfg, mesh.device_type), fsdp_cfg.reshard_after_forward, ignored)
    sum_gradients(model)
    install_packed_forward(model)
    if from_rank0:
        load_from_rank0(model, full_state, mesh)
    if fsdp_cfg.optimizer_offload and not fsdp_cfg.param_offload:  # param_offload moves it already
        if mesh.device_type != "cuda":
            warnings.warn("fsdp_config.optimizer_offload = true has no effect on CPU: the state is already there")
        setattr(model, _OPTIMIZER_OFFLOAD, mesh.device_type == "cuda")


def world_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D FSDP mesh: every rank of the (dp, sp) mesh (sp ranks shard the weights too)."""
    if mesh.ndim == 1:
        return mesh
    if mesh.size() != tdist.get_world_size():
        raise RuntimeError(f"the FSDP2 plugin expects the mesh to cover the world; mesh {mesh}")
    return DeviceMesh.from_group(tdist.group.WORLD, mesh.device_type, mesh_dim_names=("fsdp",))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(
            f"the FSDP2 plugin shards `model.get_decoder().layers`, which {type(model).__name__} does not have"
        )
    return list(layers)


def frozen_outside(model: torch.nn.Module, mesh: DeviceMesh, fsdp_cfg, gathered: torch.dtype | None) -> set:
    """The parameters FSDP2 leaves alone (`ignored_params`): at world 1 without param_offload, the
    frozen ones of a model that trains others (LoRA's base), each stored in `gathered` (the
    dtype FSDP2 would gather it in, so every pass computes the same values).

    One rank has nothing to shard, and a frozen parameter nothing to reduce: FSDP2 would only
    copy it into its all-gather buffer and out again, before the forward and again before the
    backward of every micro-batch (with LoRA on Qwen2-1.5B, 3 GB twice and 24 copies a
    layer per micro-batch, one per frozen tensor and unshard, for nothing). Across ranks the frozen base stays sharded:
    a replica per rank would cost its memory on every GPU."""
    if mesh.size() > 1 or fsdp_cfg.param_offload:
        return set()
    params = list(model.parameters())
    if all(p.requires_grad for p in params) or not any(p.requires_grad for p in params):
        return set()
    frozen = {p for p in params if not p.requires_grad}
    store_in(frozen, gathered)
    return frozen


def store_in(params, dtype: torch.dtype | None) -> None:
    """Hold each floating parameter in `dtype`, the one every pass computes with (None: as they are)."""
    for param in params:
        if dtype is not None and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def apply_fsdp(
    model, mesh, mp: MixedPrecisionPolicy, offload: OffloadPolicy, reshard: bool, ignored: set | None = None
) -> None:
    """fully_shard per decoder layer, then the root, none of them managing `ignored`. A trained
    model's last layer is not resharded after forward: backward starts with it and would gather
    it again at once."""
    layers = decoder_layers(model)
    trained = any(p.requires_grad for p in model.parameters())
    for i, layer in enumerate(layers):
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mp,
            offload_policy=offload,
            reshard_after_forward=reshard and (i < len(layers) - 1 or not trained),
            ignored_params=ignored or None,
        )
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=mp,
        offload_policy=offload,
        reshard_after_forward=reshard,
        ignored_params=ignored or None,
    )


def mixed_precision(fsdp_cfg, device_type: str, model) -> MixedPrecisionPolicy:
    """bf16 compute on CUDA by default; on CPU the model's own dtype (no cast)."""
    gathered = param_dtype(fsdp_cfg, device_type)  # fsdp_config.param_dtype, resolved
    reduce_dtype = getattr(torch, fsdp_cfg.reduce_dtype)
    if gathered is None and reduce_dtype == next(model.parameters()).dtype:
        return MixedPrecisionPolicy()  # nothing to cast
    return MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=reduce_dtype)


def offload_policy(fsdp_cfg, device_type: str) -> OffloadPolicy:
    if not fsdp_cfg.param_offload:
        return OffloadPolicy()
    if device_type != "cuda":
        warnings.warn("fsdp_config.param_offload = true has no effect on CPU: the parameters are already there")
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=True)


def sum_gradients(model: torch.nn.Module) -> None:
    """Reduce-scatter gradients as a SUM over ranks: minirl divides every loss by counts of the
    whole global mini-batch (docs/algorithms.md §6), so the gradient it wants is the sum of the
    ranks'. Divide factor 1 with plain SUM reductions, which every backend (gloo too) has.

    Parameters without a gradient on one rank join the reduce-scatter with zeros: a Ulysses
    slice that predicts no response token never calls the lm_head, and a reduce-scatter
    without it would not match the other ranks' (a collective mismatch).
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    if hasattr(model, "set_reduce_scatter_unused_params"):  # torch >= 2.12; 2.11 lacks it
        model.set_reduce_scatter_unused_params(True)


def install_packed_forward(model: torch.nn.Module) -> None:
    """The PackedForward hook (minirl.protocols): fn(model, *args) between the root's all-gather
    and its post-backward reduce-scatter. The root stays gathered after it, as after any FSDP
    root forward; minirl.forward.packed reshards it after a gradient-free pass."""
    setattr(model, PACKED_FORWARD, types.MethodType(_call_packed, model))
    register_fsdp_forward_method(model, PACKED_FORWARD)


def _call_packed(model, fn, *args, **kwargs):
    return fn(model, *args, **kwargs)


# ---------------------------------------------------------------------------------------------
# loading a full checkpoint without materialising it on every rank
# ---------------------------------------------------------------------------------------------


def _needs_rank0_weights(model, mesh: DeviceMesh) -> bool:
    """True when some rank holds the model on the meta device (built without weights)."""
    meta = any(p.is_meta for p in model.parameters())
    flags = torch.tensor([float(meta)], device=_comm_device(mesh))
    tdist.all_reduce(flags, op=tdist.ReduceOp.MAX)
    if meta and mesh.get_rank() == 0:
        raise ValueError("rank 0 must hold the real weights: the other ranks' shards are copied from it")
    return bool(flags.item())


def load_from_rank0(model, full_state: dict, mesh: DeviceMesh) -> None:
    """Fill every rank's shards from rank 0's full state dict, one tensor at a time
    (broadcast_from_rank0), then copy the buffers, which FSDP does not shard and which are not
    all in the state dict (RoPE's inv_freq is non-persistent)."""
    device = _comm_device(mesh)
    if mesh.get_rank() != 0:
        model.to_empty(device=device)
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buf in model.buffers():
        tdist.broadcast(buf, src=0)


def _comm_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


# ---------------------------------------------------------------------------------------------
# optimizer-state offload (fsdp_config.optimizer_offload without param_offload)
# ---------------------------------------------------------------------------------------------


@hookimpl(wrapper=True)
def minirl_build_optimizer(model, cfg, total_steps):
    result = yield
    if result is not None and getattr(model, _OPTIMIZER_OFFLOAD, False):
        offload_optimizer_state(result[0])
    return result


def offload_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Keep the optimizer state on the CPU except during `step()` (verl's optimizer_offload)."""

    def to_device(opt, args, kwargs):
        _move_state(opt, lambda p: p.device)

    def to_cpu(opt, args, kwargs):
        _move_state(opt, lambda p: torch.device("cpu"))

    optimizer.register_step_pre_hook(to_device)
    optimizer.register_step_post_hook(to_cpu)


def _move_state(optimizer: torch.optim.Optimizer, where) -> None:
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                state[key] = value.to(where(param), non_blocking=True)
