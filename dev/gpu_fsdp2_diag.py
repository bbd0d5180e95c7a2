"""What tests/distributed/test_fsdp2_gpu.py measures, taken apart: each variant against float64.

On a CUDA machine (world = min(2, GPUs)): the test's one AdamW step (lr 0.01, eps 1e-4) on the
tiny model, by each variant the test compares, against a float64 CPU reference:
  plain_cuda   fp32 weights on CUDA, one process (the test's old "fp32" side; autocast bf16)
  plain_cpu32  fp32 on the CPU, no autocast
  fsdp_bf16    FSDP2, bf16 compute, fp32 reduce and master weights (the test's `base`)
  param_off    the same with fsdp_config.param_offload = true
  opt_off      the same with fsdp_config.optimizer_offload = true
For each: loss, gradient and update errors, sign flips, and whether the parameter error is what
Adam's first step lr * g / (|g| + eps) makes of the gradient error. Then param_off against
fsdp_bf16 bit by bit, the AdamW implementations on identical inputs, and whether the weight sync
(assembly.full_weights) of the offloaded actor returns its own shards.

    python3 dev/gpu_fsdp2_diag.py > diag.json
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "distributed"))
import dist_helpers as h  # noqa: E402
from test_fsdp2_gpu import EPS, LR, PROMPT_LENS, RESPONSE_LENS, _step  # noqa: E402  the test's own step

from minirl.dist import spmd  # noqa: E402
from minirl.dist.launchers import spawn  # noqa: E402
from minirl.models import assembly
from minirl.plugins import PluginManager  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of this script only


def base_cfg(world: int, *extra: str):
    return h.config(
        f"trainer.device='{DEV}'",
        "trainer.world_size=1",
        f"trainer.n_gpus_per_node={world}",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
        f"actor.optim.lr={LR}",
        f"actor.optim.eps={EPS}",
        *extra,
    )


def full(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):
        if t.device.type != t.device_mesh.device_type:
            t = t.to(t.device_mesh.device_type)
        t = t.full_tensor()
    return t.detach().to("cpu", torch.float64)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def snapshot(model) -> dict:
    out = {}
    for n, p in model.named_parameters():
        out[assembly.hf_name(n)] = (full(p), full(p.grad) if p.grad is not None else None)
    return out


def one_step(model, pm, cfg, prompts, responses, device):
    """The test's AdamW step; its loss in float64 on the CPU, beside the reference's."""
    loss, optimizer = _step(model, pm, cfg, prompts, responses, device)
    return loss.double().cpu(), optimizer


def flat(snap, which: int) -> torch.Tensor:
    return torch.cat([v[which].flatten() for _, v in sorted(snap.items())])


def compare(snap, ref, p0) -> dict:
    g, gr = flat(snap, 1), flat(ref, 1)
    p, pr, q0 = flat(snap, 0), flat(ref, 0), flat(p0, 0)
    err = (p - pr).abs()
    i = int(err.argmax())
    # Adam's first step, bias-corrected: p1 = p0 (1 - lr wd) - lr g / (|g| + eps)
    wd = 0.01
    pred = q0 * (1 - LR * wd) - LR * g / (g.abs() + EPS)
    pred_ref = q0 * (1 - LR * wd) - LR * gr / (gr.abs() + EPS)
    big = gr.abs() >= 100 * EPS
    return {
        "grad_rel_l2": float((g - gr).norm() / gr.norm()),
        "grad_max_abs": float((g - gr).abs().max()),
        "param_max_abs": float(err.max()),
        "update_rel_l2": float(((p - q0) - (pr - q0)).norm() / (pr - q0).norm()),
        "argmax": {"g_ref": float(gr[i]), "g": float(g[i]), "err": float(err[i])},
        "sign_flips": int(((g > 0) != (gr > 0)).sum()),
        "elements": g.numel(),
        "err_gt_lr_over_10": int((err > LR / 10).sum()),
        "param_max_abs_where_|g_ref|>=100eps": float(err[big].max()),
        "param_max_abs_where_|g_ref|<100eps": float(err[~big].max()),
        "adam_formula_explains_param_max_abs": float((pred - pred_ref - (p - pr)).abs().max()),
        "self_adam_formula_max_abs": float((pred - p).abs().max()),
    }


def bits_diff(a: dict, b: dict) -> dict:
    out = {"params_differing_tensors": [], "params_differing_elements": 0, "grads_bit_equal": True}
    for name in sorted(a):
        pa, ga = a[name]
        pb, gb = b[name]
        pa32, pb32 = pa.float(), pb.float()
        ndiff = int((pa32 != pb32).sum())
        if ndiff:
            ulp = (pa32.view(torch.int32).long() - pb32.view(torch.int32).long()).abs().max()
            out["params_differing_tensors"].append([name, ndiff, pa.numel(), float((pa - pb).abs().max()), int(ulp)])
            out["params_differing_elements"] += ndiff
        if ga is not None and not torch.equal(ga, gb):
            out["grads_bit_equal"] = False
    return out


def adamw_impls(p0: dict, grads: dict, targets: dict) -> dict:
    """One AdamW step on identical fp32 inputs by each implementation; equal bits to each target?"""
    impls = {
        "cuda_fused": ("cuda", {"fused": True}),
        "cuda_foreach": ("cuda", {"foreach": True}),
        "cuda_single": ("cuda", {"foreach": False}),
        "cpu_default": ("cpu", {}),
        "cpu_fused": ("cpu", {"fused": True}),
    }
    names = sorted(p0)
    results = {}
    for label, (device, kw) in impls.items():
        if device != DEV and device != "cpu":
            continue
        params = [torch.nn.Parameter(p0[n][0].float().to(device)) for n in names]
        for prm, n in zip(params, names):
            prm.grad = grads[n][1].float().to(device)
        opt = torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.01, betas=(0.9, 0.999), **kw)
        opt.step()
        res = {n: prm.detach().cpu() for n, prm in zip(names, params)}
        results[label] = res
    out = {}
    for label, res in results.items():
        for tname, snap in targets.items():
            diff = sum(int((res[n] != snap[n][0].float()).sum()) for n in names)
            out[f"{label} vs {tname}: differing elements"] = diff
    a, b = results.get("cuda_fused", results["cpu_fused"]), results["cpu_default"]
    out["cuda_fused vs cpu_default: max abs"] = max(float((a[n] - b[n]).abs().max()) for n in names)
    return out


def shard_check(model, rank: int, world: int) -> dict:
    """full_weights(model) gives, at this rank's rows, exactly this rank's local shard."""
    params = dict(model.named_parameters())
    bad = []
    for name, tensor in assembly.full_weights(model):
        key = next(k for k in params if assembly.hf_name(k) == name)
        shard = local(params[key]).detach().cpu()
        rows = tensor.detach().cpu().chunk(world, dim=0)
        mine = rows[rank] if rank < len(rows) else tensor[:0].cpu()
        if not torch.equal(mine, shard):
            bad.append(name)
    return {"full_weights_matches_own_shards": not bad, "mismatched": bad[:5]}


def worker(rank: int, out_path: str, world: int) -> None:
    from minirl_plugins.engines.native.weights import weights_checksum

    cfg = base_cfg(world)
    dist = spmd.init_from_env(cfg)
    pm = PluginManager(entry_points=False)
    prompts, responses = h.sequences(PROMPT_LENS, RESPONSE_LENS)
    cpu = torch.device("cpu")
    p0 = snapshot(h.tiny_model())
    ref_model = h.tiny_model().double()
    ref_loss, _ = one_step(ref_model, pm, cfg, prompts, responses, cpu)
    ref = snapshot(ref_model)
    snaps, losses = {}, {}
    model = h.tiny_model().to(dist.device)
    losses["plain_cuda"], _ = one_step(model, pm, cfg, prompts, responses, dist.device)
    snaps["plain_cuda"] = snapshot(model)
    model = h.tiny_model()
    losses["plain_cpu32"], _ = one_step(model, pm, cfg, prompts, responses, cpu)
    snaps["plain_cpu32"] = snapshot(model)
    per = len(prompts) // world
    mine = list(range(rank * per, (rank + 1) * per))
    actors = {}
    for label, extra in (
        ("fsdp_bf16", ()),
        ("param_off", ("actor.fsdp_config.param_offload=true",)),
        ("opt_off", ("actor.fsdp_config.optimizer_offload=true",)),
    ):
        vcfg = base_cfg(world, *extra)
        actor = assembly.assemble_actor(pm, h.tiny_model().to(dist.device), vcfg, dist)
        loss, _ = one_step(actor, pm, vcfg, [prompts[i] for i in mine], [responses[i] for i in mine], dist.device)
        loss = loss.to(dist.device)
        torch.distributed.all_reduce(loss)
        losses[label] = loss.cpu()
        snaps[label] = snapshot(actor)
        actors[label] = actor
    report = {"world": world, "ref_loss": float(ref_loss)}
    for label, snap in snaps.items():
        report[label] = {"loss_rel": float((losses[label] - ref_loss).abs() / ref_loss.abs()), **compare(snap, ref, p0)}
    report["old test's quantity: fsdp_bf16 vs plain_cuda"] = compare(snaps["fsdp_bf16"], snaps["plain_cuda"], p0)
    report["param_off vs fsdp_bf16 bits"] = bits_diff(snaps["param_off"], snaps["fsdp_bf16"])
    report["opt_off vs fsdp_bf16 bits"] = bits_diff(snaps["opt_off"], snaps["fsdp_bf16"])
    report["adamw on fsdp_bf16's grads"] = adamw_impls(
        p0, snaps["fsdp_bf16"], {k: snaps[k] for k in ("fsdp_bf16", "param_off", "opt_off")}
    )
    report["param_off shards"] = shard_check(actors["param_off"], rank, world)
    report["checksum fp32 param_off == fsdp_bf16"] = weights_checksum(
        assembly.full_weights(actors["param_off"]), torch.float32
    ) == weights_checksum(assembly.full_weights(actors["fsdp_bf16"]), torch.float32)
    report["checksum fp32 param_off == its own snapshot"] = weights_checksum(
        assembly.full_weights(actors["param_off"]), torch.float32
    ) == weights_checksum(((n, v[0].float()) for n, v in snaps["param_off"].items()), torch.float32)
    report["param_off param device"] = sorted({local(p).device.type for p in actors["param_off"].parameters()})
    report["param_off grad dtype/device"] = sorted(
        {f"{p.grad.dtype}/{local(p.grad).device.type}" for p in actors["param_off"].parameters()}
    )
    h.write_results(out_path, rank, report)
    spmd.shutdown()


def main() -> None:
    world = min(2, torch.cuda.device_count()) or 1
    out = os.environ.get("DIAG_OUT", "fsdp2_diag.json")
    assert spawn.spawn(worker, world, (out, world)) == 0
    with open(out) as f:
        print(json.dumps(json.load(f), indent=1))


if __name__ == "__main__":
    main()
