"""Time a full checkpoint write and load of the actor with its AdamW state, and the HF export.

    python scripts/bench_checkpoint.py --out /tmp/ckpt_bench                  # qwen2-1.5b, CUDA
    python scripts/bench_checkpoint.py --preset tiny --device cpu --out /tmp/c   # smoke test

The actor is built exactly as the trainer builds it (bench.toml's model section, the assembly
hooks: FSDP2 on CUDA, fp32 master weights) and one optimizer step with zero gradients fills the
AdamW state (exp_avg, exp_avg_sq: two fp32 tensors per parameter). Then, through the same code
the trainer calls: minirl.checkpoint.state.save (DCP shards + RNG + trainer state + manifest,
fsynced, renamed), state.load into a fresh optimizer state, and the Hugging Face export. Prints
seconds, bytes on disk and GB/s, next to the disk's own sequential write rate (dd, O_DIRECT).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time

import torch

from minirl.checkpoint import state as ckpt_state
from minirl.checkpoint.hf import save_hf_checkpoint
from minirl.config.load import load_config, to_toml
from minirl.dist import spmd
from minirl.models import assembly
from minirl.models.loading import load_model_for_rank
from minirl.plugins import PluginManager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(preset: str, device: str):
    cfg = load_config(os.path.join(ROOT, "bench.toml"), [f"model.preset={preset}", f"trainer.device={device}"])
    pm = PluginManager(cfg.plugins.modules)
    dist = spmd.single_process(cfg)
    model, tokenizer = load_model_for_rank(cfg.model, dist, torch.float32)
    actor = assembly.assemble_actor(pm, model, cfg, dist)
    optimizer, _ = assembly.build_optimizer(pm, actor, cfg.actor.optim, 10)
    for p in actor.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # allocates exp_avg / exp_avg_sq
    optimizer.zero_grad(set_to_none=True)
    return cfg, dist, actor, optimizer, tokenizer


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def disk_write_rate(out: str) -> float:
    """Sequential write GB/s of the output disk (4 GiB, O_DIRECT, so the page cache is bypassed)."""
    probe = os.path.join(out, "dd_probe")
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={probe}", "bs=16M", "count=256", "oflag=direct", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - t0
    os.remove(probe)
    return 4 * 2**30 / seconds / 1e9


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2-1.5b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    cfg, dist, actor, optimizer, tokenizer = build(args.preset, args.device)
    n_params = sum(p.numel() for p in actor.parameters())
    parts = ckpt_state.Checkpointable(actor, optimizer)
    trainer_state = {"step": 1, "data": {}, "schedulers": {}, "kl_coef": None, "seed": 1, "world_size": 1}
    path = os.path.join(args.out, "ckpt_1")
    save_s = timed(lambda: ckpt_state.save(args.out, 1, parts, trainer_state, to_toml(cfg), dist, 0), dist.device)
    size = du(path)
    for state in optimizer.state.values():  # the load must really refill them
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0:
                v.zero_()
    load_s = timed(lambda: ckpt_state.load(path, parts, dist), dist.device)
    hf_dir = os.path.join(args.out, "hf")
    hf_s = timed(lambda: save_hf_checkpoint(actor, tokenizer, hf_dir, dist), dist.device)
    hf_size = du(hf_dir)
    disk = disk_write_rate(args.out)
    rows = [
        ("parameters", f"{n_params / 1e9:.3f} B", ""),
        ("full checkpoint size", f"{size / 1e9:.2f} GB", "params + exp_avg + exp_avg_sq, fp32, + RNG/state"),
        ("write (save)", f"{save_s:.1f} s", f"{size / save_s / 1e9:.2f} GB/s, fsync + rename included"),
        ("load", f"{load_s:.1f} s", f"{size / load_s / 1e9:.2f} GB/s, verify + DCP read into shards"),
        ("HF export (safetensors)", f"{hf_s:.1f} s", f"{hf_size / 1e9:.2f} GB, {hf_size / hf_s / 1e9:.2f} GB/s"),
        ("disk sequential write", f"{disk:.2f} GB/s", "dd 4 GiB, O_DIRECT, the ceiling of a write"),
    ]
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\ncheckpoint benchmark: preset {args.preset} on {where}, {ckpt_state.WRITE_THREADS} write thread(s)")
    for name, value, note in rows:
        print(f"{name:26s} {value:>12s}  {note}")
    spmd.shutdown()


if __name__ == "__main__":
    main()
