"""`python -m minirl export`: a training checkpoint (ckpt_<step>, sharded, written by any number of
ranks) as a Hugging Face directory that transformers' AutoModelForCausalLM.from_pretrained,
`model.path` and every rollout engine load: config.json, model.safetensors and the tokenizer
files. verl's model merger does this job for verl's checkpoints.

The model is rebuilt on one process from the checkpoint's own config.toml (model.path or
model.preset, and the LoRA keys), then the checkpoint's weights are read into it (DCP reshards
them to one process). A LoRA checkpoint holds only the adapters: they are merged into the base
weights (W + B A * alpha / r, the weights the rollout engines computed with), so the directory is
a plain model; --keep-adapter also writes the peft adapter directory to DIR/adapter.
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch

from minirl.checkpoint import state as ckpt_state
from minirl.checkpoint import store
from minirl.checkpoint.hf import save_hf_checkpoint
from minirl.config.load import Config, load_config
from minirl.dist.context import DistContext, resolve_device
from minirl.errors import UserError
from minirl.models import lora
from minirl.models.loading import load_model

HELP = "turn a training checkpoint (ckpt_<step>) into a Hugging Face directory; LoRA adapters are merged"


def export_command(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m minirl export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--checkpoint", required=True, metavar="CKPT", help=CHECKPOINT_HELP)
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write (new, or empty)")
    p.add_argument("--keep-adapter", action="store_true", help="LoRA: also write the peft adapter to DIR/adapter")
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    args = p.parse_args(argv)
    out = _fresh_dir(args.out)
    ckpt = find_checkpoint(args.checkpoint, "--checkpoint")
    model, tokenizer, cfg = load_checkpoint_model(ckpt, torch.device("cpu"), args.overrides)
    if args.keep_adapter and not lora.has_adapters(model):
        raise UserError(f"--keep-adapter: {ckpt} is not a LoRA checkpoint (model.lora_rank = 0); leave the flag out")
    tmp = f"{out}.tmp-{os.getpid()}"  # a half-written directory never sits under the name asked for
    save_hf_checkpoint(model, tokenizer, tmp, DistContext(device=torch.device("cpu")))
    if args.keep_adapter:
        lora.save_adapter(model, os.path.join(tmp, "adapter"))
        tokenizer.save_pretrained(os.path.join(tmp, "adapter"))
    if os.path.isdir(out):
        os.rmdir(out)  # empty: checked above
    os.replace(tmp, out)
    merged = ", LoRA adapters merged" if lora.has_adapters(model) else ""
    print(f"wrote {out}: a Hugging Face directory of {ckpt}{merged} (model.path = {out!r} loads it)")
    return 0


CHECKPOINT_HELP = "a ckpt_<step> directory, or a run directory (its newest complete checkpoint)"
OVERRIDES_HELP = (
    "section.key=value over the checkpoint's config.toml, e.g. model.path=/new/place when the base model has moved"
)


def find_checkpoint(path: str, flag: str) -> str:
    """`path` itself when it is a checkpoint, else the newest complete one of the run directory."""
    if not os.path.isdir(path):
        raise UserError(f"{flag} {path}: no such directory; give a ckpt_<step> directory or a run directory")
    if os.path.isfile(os.path.join(path, store.MANIFEST)):
        return path
    found = store.complete_checkpoints(path)
    if not found:
        raise UserError(
            f"{flag} {path}: no complete checkpoint there (no {store.MANIFEST}, no ckpt_<step>/{store.MANIFEST}); "
            "give a checkpoint a run wrote with trainer.save_freq > 0"
        )
    return found[-1][1]


def load_checkpoint_model(ckpt: str, device: torch.device, overrides: list[str] = ()):
    """(model, tokenizer, cfg): the actor of checkpoint `ckpt` on one process, in eval mode, its
    weights the checkpoint's (a LoRA model keeps its adapters: lora.unload merges them)."""
    damaged = store.damaged_files(ckpt)
    if damaged:
        raise UserError(f"checkpoint {ckpt} is damaged ({damaged[0]}); use an older ckpt_<step> of the run")
    cfg = checkpoint_config(ckpt, overrides)
    model, tokenizer = load_model(cfg.model, _base_device(cfg, device), cfg.model.dtype)
    if lora.enabled(cfg.model):
        lora.apply_lora(model, cfg.model, cfg.model.path or cfg.model.preset)
    ckpt_state.load_model_weights(ckpt, model, trainable_only=lora.enabled(cfg.model))
    return model.to(device).eval().requires_grad_(False), tokenizer, cfg


def _base_device(cfg: Config, device: torch.device) -> torch.device:
    """Where to build the model: a LoRA checkpoint of a random preset holds only the adapters, and
    its frozen base must be drawn where the run drew it (CPU and CUDA draw different numbers from
    one seed)."""
    if cfg.model.path or not lora.enabled(cfg.model):
        return device
    return resolve_device(cfg.trainer.device)


def checkpoint_config(ckpt: str, overrides: list[str] = ()) -> Config:
    """The config a checkpoint was written with (its config.toml), with `overrides`; the base model
    it names must still be there."""
    cfg = load_config(os.path.join(ckpt, ckpt_state.CONFIG), list(overrides), strict=False)
    path = cfg.model.path
    if path and not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
        raise UserError(
            f"model.path = {path!r} ({ckpt}/config.toml): no Hugging Face model there any more, and the "
            "checkpoint's model is rebuilt from it; add model.path=DIR naming where the base model is now"
        )
    return cfg


def _fresh_dir(out: str) -> str:
    out = os.path.abspath(os.path.expanduser(out))
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise UserError(f"--out {out}: already exists and is not an empty directory; name a new directory")
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"--out {out}: cannot create {os.path.dirname(out)} ({exc.strerror}); choose another place"
        ) from None
    if not os.access(os.path.dirname(out), os.W_OK):
        raise UserError(f"--out {out}: cannot write in {os.path.dirname(out)} (read-only); choose another place")
    stale = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(stale, ignore_errors=True)
    return out
