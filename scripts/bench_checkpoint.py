"""Time a full checkpoint of the actor with its AdamW state: the training stall of a save with
trainer.async_save off and on, the background write against the disk's own speed, the CRC-32C's
cost, the load and the Hugging Face export.

    python scripts/bench_checkpoint.py --out /tmp/ckpt_bench                  # qwen2-1.5b, CUDA
    python scripts/bench_checkpoint.py --preset tiny --device cpu --out /tmp/c   # smoke test
    python scripts/bench_checkpoint.py --preset tiny --device cpu --out /tmp/c \\
        --shape hidden_size=1024,intermediate_size=2816,num_hidden_layers=8     # 1.1 GB on CPU

The actor is built exactly as the trainer builds it (bench.toml's model section, the assembly
hooks: FSDP2 on CUDA, fp32 master weights; `--shape` overrides the preset's config) and one
optimizer step with zero gradients fills the AdamW state (exp_avg, exp_avg_sq: two fp32 tensors
per parameter). Then, through the code the trainer calls (minirl.checkpoint.writer):

- a blocking save (async_save = false): the stall is the whole save;
- background saves (async_save = true): the stall is the copy into host memory, the first save
  allocating the buffers (pinned on CUDA) and the later ones reusing them; a first save after
  `prepare` (as the trainer calls it after the first step: the buffers made, then pinned in the
  background while training goes on, timed up to the end of the pinning); the background write
  (DCP shards + RNG + trainer state + manifest, fsynced, renamed) is timed from the end of the
  stall to its end, with nothing else running, and set against the disk's sequential write
  (dd, O_DIRECT, one stream);
- the CRC-32C's cost: background writes with the CRC switched off and on, alternating,
  `--repeats` pairs, the fastest of each kept (page-cache and disk noise only ever add time);
  the CRC alone over the state's bytes in memory; the verification at resume (re-read + CRC);
- the load into a fresh optimizer state, and the Hugging Face export.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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
from minirl.checkpoint.writer import CheckpointWriter
from minirl.config.load import load_config, to_toml
from minirl.dist import spmd
from minirl.models import assembly, presets
from minirl.models.loading import load_model_for_rank
from minirl.plugins import PluginManager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER_STATE = {"step": 1, "data": {}, "schedulers": {}, "kl_coef": None, "seed": 1, "world_size": 1}


def build(preset: str, device: str, shape: dict):
    cfg = load_config(os.path.join(ROOT, "bench.toml"), [f"model.preset={preset}", f"trainer.device={device}"])
    pm = PluginManager(cfg.plugins.modules)
    dist = spmd.single_process(cfg)
    base = presets.PRESETS[preset]
    shaped = presets.Preset(functools.partial(base.config, **shape), base.tokenizer)
    with mock.patch.dict(presets.PRESETS, {preset: shaped}):
        model, tokenizer = load_model_for_rank(cfg.model, dist, torch.float32)
    actor = assembly.assemble_actor(pm, model, cfg, dist)
    optimizer, _ = assembly.build_optimizer(pm, actor, cfg.actor.optim, 10)
    for p in actor.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # allocates exp_avg / exp_avg_sq
    optimizer.zero_grad(set_to_none=True)
    return cfg, dist, actor, optimizer, tokenizer


def parse_shape(text: str) -> dict:
    """'hidden_size=1024,num_hidden_layers=8' -> {'hidden_size': 1024, 'num_hidden_layers': 8}"""
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    return {key: int(value) if value.isdigit() else value for key, value in pairs}


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def disk_write_rate(out: str, gib: int) -> float:
    """Sequential write GB/s of the output disk (O_DIRECT, so the page cache is bypassed)."""
    probe = os.path.join(out, "dd_probe")
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={probe}", "bs=16M", f"count={64 * gib}", "oflag=direct", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - t0
    os.remove(probe)
    return gib * 2**30 / seconds / 1e9


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


def crc_switched(on: bool):
    """The CRC-32C as the trainer runs it (on), or switched off with its hand-off to a thread."""
    off = contextlib.ExitStack()
    if not on:
        off.enter_context(mock.patch.object(checksum.Crc, "update", _count_only))
        off.enter_context(mock.patch.object(checksum, "_OVERLAP_BYTES", float("inf")))
    return off


class Saves:
    """Saves of one actor into fresh run directories under `out`, each deleted afterwards."""

    def __init__(self, out: str, parts, cfg, dist) -> None:
        self.out, self.parts, self.config, self.dist = out, parts, to_toml(cfg), dist
        self.background = CheckpointWriter(dist, True, 600, lambda step, path: None)

    def _run_dir(self, name: str) -> str:
        run_dir = os.path.join(self.out, name)
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        return run_dir

    def blocking(self) -> float:
        """Seconds of one save with async_save = false: all of it stalls training."""
        run_dir = self._run_dir("blocking")
        args = (run_dir, 1, self.parts, TRAINER_STATE, self.config, self.dist, 0)
        seconds = timed(lambda: ckpt_state.save(*args), self.dist.device)
        shutil.rmtree(run_dir)
        return seconds

    def in_background(self, crc: bool = True) -> tuple[float, float]:
        """(stall, background write) seconds of one save with async_save = true."""
        run_dir = self._run_dir("background")
        with crc_switched(crc):
            stall = timed(
                lambda: self.background.save(run_dir, 1, self.parts, TRAINER_STATE, self.config, 0), self.dist.device
            )
            t0 = time.perf_counter()
            self.background.wait()
            write = time.perf_counter() - t0
        shutil.rmtree(run_dir)
        return stall, write

    def prepared_first(self) -> tuple[float, float, float]:
        """(prepare's stall, its background pinning, the first save's stall) seconds of a fresh
        writer prepared as the trainer prepares it after the first step; its buffers freed after."""
        writer, run_dir = CheckpointWriter(self.dist, True, 600, lambda step, path: None), self._run_dir("prepared")
        prepare = timed(lambda: writer.prepare(self.parts, save_freq=1), self.dist.device)
        t0 = time.perf_counter()
        writer.staging.join()
        pinning = time.perf_counter() - t0 + prepare
        stall = timed(lambda: writer.save(run_dir, 1, self.parts, TRAINER_STATE, self.config, 0), self.dist.device)
        writer.close()
        shutil.rmtree(run_dir)
        return prepare, pinning, stall


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


def secs(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 0.1 else f"{x:.2f} s"


def fastest(xs: list[float]) -> str:
    return f"fastest of {len(xs)}: {', '.join(secs(x) for x in xs)}"


def save_rows(saves: Saves, size: int, disk: float, repeats: int) -> list[tuple[str, str, str]]:
    blocking = [saves.blocking() for _ in range(repeats)]
    prepare, pinning, prepared_stall = saves.prepared_first()  # before the next: one set of buffers at a time
    first_stall, _ = saves.in_background()  # allocates the host buffers
    plain, hashed = [], []
    for _ in range(repeats):  # alternating, so that drift in the disk's speed hits both alike
        plain.append(saves.in_background(crc=False))
        hashed.append(saves.in_background(crc=True))
    stalls, writes = [s for s, _ in hashed], [w for _, w in hashed]
    stall, write, p = min(stalls), min(writes), min(w for _, w in plain)
    rate = size / write / 1e9
    return [
        ("save, async_save = false", secs(min(blocking)), f"training blocked; {fastest(blocking)}"),
        ("save, async: first stall", secs(first_stall), "training blocked: host buffers allocated + copy"),
        ("save, async: prepare", secs(prepare), "training blocked: the state tree, empty host buffers"),
        ("  its pinning", secs(pinning), "from prepare to its end, in the background (training goes on)"),
        ("save, async: first stall, prepared", secs(prepared_stall), "training blocked: copy into prepared buffers"),
        ("save, async: stall", secs(stall), f"training blocked: copy into the reused buffers, {fastest(stalls)}"),
        (
            "background write",
            secs(write),
            f"{rate:.2f} GB/s = {100 * rate / disk:.0f} % of the disk's; {fastest(writes)}",
        ),
        ("background write, CRC off", secs(p), fastest([w for _, w in plain])),
        ("checksum cost (A/B)", f"{100 * (write - p) / p:+.1f} %", "of the background write (goal: under 5 %)"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2-1.5b")
    ap.add_argument("--shape", type=parse_shape, default={}, help="the preset's config keys to override: k=v,k=v")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=2, help="saves of each kind (CRC off/on: pairs)")
    ap.add_argument("--dd-gib", type=int, default=4, help="GiB the disk's sequential write is measured over")
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    cfg, dist, actor, optimizer, tokenizer = build(args.preset, args.device, args.shape)
    n_params = sum(p.numel() for p in actor.parameters())
    parts = ckpt_state.Checkpointable(actor, optimizer)
    path = os.path.join(args.out, "ckpt_1")
    ckpt_state.save(args.out, 1, parts, TRAINER_STATE, to_toml(cfg), dist, 0)
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
    shutil.rmtree(path)  # room for the timed saves
    shutil.rmtree(hf_dir)
    disk = disk_write_rate(args.out, args.dd_gib)
    crc_s, nbytes = crc_in_memory_seconds(parts)
    rows = [
        ("parameters", f"{n_params / 1e9:.3f} B" if n_params >= 1e8 else f"{n_params / 1e6:.2f} M", ""),
        ("full checkpoint size", ckpt_state._gb(size), "params + exp_avg + exp_avg_sq, fp32, + RNG/state"),
        ("disk sequential write", f"{disk:.2f} GB/s", f"dd {args.dd_gib} GiB, O_DIRECT, one stream"),
        *save_rows(Saves(args.out, parts, cfg, dist), size, disk, args.repeats),
        (
            "CRC alone, in memory",
            secs(crc_s),
            f"{nbytes / crc_s / 1e9:.1f} GB/s on {ckpt_state.WRITE_THREADS} threads",
        ),
        ("load", secs(load_s), f"{size / load_s / 1e9:.2f} GB/s, verify + DCP read into shards"),
        ("verify at resume", secs(verify_s), "re-read + CRC of every file (rank 0, 4 threads)"),
        ("HF export (safetensors)", secs(hf_s), f"{hf_size / 1e9:.2f} GB, {hf_size / hf_s / 1e9:.2f} GB/s"),
    ]
    where = torch.cuda.get_device_name() if dist.device.type == "cuda" else "cpu"
    shape = f" ({', '.join(f'{k}={v}' for k, v in args.shape.items())})" if args.shape else ""
    print(f"\ncheckpoint benchmark: preset {args.preset}{shape} on {where}, {ckpt_state.WRITE_THREADS} write thread(s)")
    for name, value, note in rows:
        print(f"{name:36s} {value:>12s}  {note}")
    spmd.shutdown()


if __name__ == "__main__":
    main()
