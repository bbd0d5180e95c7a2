"""Time a full checkpoint write and load of the actor with its AdamW state, and the HF export.

    python scripts/bench_checkpoint.py --out /tmp/ckpt_bench                  # qwen2-1.5b, CUDA
    python scripts/bench_checkpoint.py --preset tiny --device cpu --out /tmp/c   # smoke test

The actor is built exactly as the trainer builds it (bench.toml's model section, the assembly
hooks: FSDP2 on CUDA, fp32 master weights) and one optimizer step with zero gradients fills the
AdamW state (exp_avg, exp_avg_sq: two fp32 tensors per parameter). Then, through the same code
the trainer calls: minirl.checkpoint.state.save (DCP shards + RNG + trainer state + manifest,
fsynced, renamed), state.load into a fresh optimizer state, and the Hugging Face export. Prints
seconds, bytes on disk and GB/s, next to the disk's own sequential write rate (dd, O_DIRECT).

The CRC-32C checksums (minirl.checkpoint.checksum) are measured three ways: the save as the
trainer runs it against the same save with the CRC switched off (alternating, `--repeats` pairs,
the fastest of each kept: page-cache and disk noise only ever add time); the CRC alone over the
state's bytes in memory, on the save's writer threads; and the resume-time verification
(re-read + CRC of every file).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import torch

from minirl.checkpoint import checksum, store
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


def _count_only(self, data) -> None:
    """Crc.update without the CRC: the save with checksums switched off."""
    self.size += memoryview(data).nbytes


def save_seconds(out: str, parts, trainer_state, cfg, dist, crc: bool) -> float:
    """One full save (as the trainer does it) into a fresh directory, deleted afterwards."""
    run_dir = os.path.join(out, "crc" if crc else "plain")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    off = contextlib.ExitStack()
    if not crc:  # no CRC, and no hand-off to a hashing thread
        off.enter_context(mock.patch.object(checksum.Crc, "update", _count_only))
        off.enter_context(mock.patch.object(checksum, "_OVERLAP_BYTES", float("inf")))
    with off:
        seconds = timed(lambda: ckpt_state.save(run_dir, 1, parts, trainer_state, to_toml(cfg), dist, 0), dist.device)
    shutil.rmtree(run_dir)
    return seconds


def crc_in_memory_seconds(parts) -> tuple[float, int]:
    """The CRC alone over every tensor of the saved state (CPU copies made first, untimed), on
    as many threads as the save writes with."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in ckpt_state._tensors(parts.state_dicts())]
    tensors = [t.detach().cpu().contiguous() for t in local]
    views = [t.view(torch.uint8).numpy() if t.dim() else t.reshape(1).view(torch.uint8).numpy() for t in tensors]

    def crc(view) -> None:
        checksum.Crc().update(view)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(ckpt_state.WRITE_THREADS) as pool:
        list(pool.map(crc, views))
    return time.perf_counter() - t0, sum(v.nbytes for v in views)


def checksum_rows(args, parts, trainer_state, cfg, dist, verify_s: float) -> list[tuple[str, str, str]]:
    plain, hashed = [], []
    for _ in range(args.repeats):
        plain.append(save_seconds(args.out, parts, trainer_state, cfg, dist, crc=False))
        hashed.append(save_seconds(args.out, parts, trainer_state, cfg, dist, crc=True))
    p, h = min(plain), min(hashed)
    crc_s, nbytes = crc_in_memory_seconds(parts)
    return [
        ("write, CRC off", f"{p:.2f} s", f"fastest of {args.repeats}: {', '.join(f'{x:.2f}' for x in plain)}"),
        ("write, CRC on", f"{h:.2f} s", f"fastest of {args.repeats}: {', '.join(f'{x:.2f}' for x in hashed)}"),
        ("checksum cost (A/B)", f"{100 * (h - p) / p:+.1f} %", "of the write time (goal: under 5 %)"),
        (
            "CRC alone, in memory",
            f"{crc_s:.2f} s",
            f"{nbytes / crc_s / 1e9:.1f} GB/s on {ckpt_state.WRITE_THREADS} threads = "
            f"{100 * crc_s / p:.1f} % of the write if it did not overlap the I/O",
        ),
        ("verify at resume", f"{verify_s:.2f} s", "re-read + CRC of every file (rank 0, 4 threads)"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2-1.5b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=2, help="pairs of saves with the CRC off and on")
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
    t0 = time.perf_counter()
    assert store.damaged_files(path) == [], "a checkpoint just written must verify"
    verify_s = time.perf_counter() - t0
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
    shutil.rmtree(path)  # room for the A/B saves
    shutil.rmtree(hf_dir)
    rows += checksum_rows(args, parts, trainer_state, cfg, dist, verify_s)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\ncheckpoint benchmark: preset {args.preset} on {where}, {ckpt_state.WRITE_THREADS} write thread(s)")
    for name, value, note in rows:
        print(f"{name:26s} {value:>12s}  {note}")
    spmd.shutdown()


if __name__ == "__main__":
    main()
