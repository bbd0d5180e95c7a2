"""Build the policy model and its tokenizer from the `model` config section.

`load_model(model_cfg, device, dtype)` loads a local Hugging Face directory (model.path) or builds
a preset with random weights seeded by model.seed. The config's files and values were checked up
front (minirl.validate); what only the load shows (a checkpoint that does not load, a tokenizer
larger than the vocabulary) is checked here. Random presets are built on the meta device and
initialised once on the target device: seconds for a 1.5B model on a GPU, not minutes on the CPU.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from minirl.dist.context import DistContext
from minirl.errors import UserError, reraise_if_debug, wrapped
from minirl.models.attention import ATTN_NAME, register_attention
from minirl.models.presets import preset_config, preset_tokenizer


def load_model(model_cfg, device: torch.device | str, dtype: torch.dtype | str):
    """Return (model, tokenizer): the causal LM on `device` in `dtype` (or its name), in eval mode.

    model_cfg is the `model` section; attn_implementation defaults to "minirl" (packed varlen).
    Gradient checkpointing and sharding are applied later by plugins.
    """
    register_attention()
    device = torch.device(device)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype  # model.dtype: validated up front
    attn = _check_attn_implementation(model_cfg.attn_implementation or ATTN_NAME)
    if model_cfg.path:
        if model_cfg.seed:
            warnings.warn(f"model.seed = {model_cfg.seed} has no effect: model.path loads trained weights")
        model = pretrained_model(model_cfg.path, device, dtype, attn)
    else:
        model = random_model(preset_config(model_cfg.preset), device, dtype, model_cfg.seed, attn)
    tokenizer = load_tokenizer(model_cfg)
    check_vocab(model.config, tokenizer, model_cfg)
    return model.eval(), tokenizer


def check_vocab(config: PretrainedConfig, tokenizer, model_cfg) -> None:
    """Every token id the tokenizer can produce must have an embedding row (an id past the end
    fails deep inside the first forward as an index error)."""
    n_tok, n_model = len(tokenizer), config.vocab_size
    if n_tok > n_model:
        key = "model.tokenizer" if model_cfg.tokenizer else ("model.path" if model_cfg.path else "model.preset")
        where = model_cfg.tokenizer or model_cfg.path or model_cfg.preset
        raise UserError(
            f"{key} = {where!r}: the tokenizer has {n_tok} tokens but the model's vocabulary has "
            f"{n_model} (config.json vocab_size); use the model's own tokenizer (model.tokenizer = '')"
        )


def random_model(
    config: PretrainedConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int = 0,
    attn_implementation: str = ATTN_NAME,
) -> PreTrainedModel:
    """A causal LM with transformers' own init (normal(0, initializer_range), unit norms,
    recomputed RoPE buffers), drawn from `seed` without touching the global RNG state."""
    device = torch.device(device)
    model = meta_model(config, dtype, attn_implementation)
    model.to_empty(device=device)  # storage only: the values come from the seeded init below
    with seeded(device, seed):
        model.initialize_weights()
    model.tie_weights()
    return model


def meta_model(config: PretrainedConfig, dtype: torch.dtype, attn_implementation: str) -> PreTrainedModel:
    """The model's structure on the meta device: no memory, no initialisation."""
    register_attention()
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)


@contextlib.contextmanager
def seeded(device: torch.device, seed: int):
    """Seed the generator that draws on `device` (CPU and CUDA draw different numbers from one
    seed), restoring it afterwards, so building a model never shifts the run's random stream."""
    if device.type != "cuda":
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed)
            yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.random.fork_rng(devices=[index]), torch.cuda.device(index):
        torch.cuda.manual_seed(seed)
        yield


def pretrained_model(path: str, device: torch.device, dtype: torch.dtype, attn_implementation: str):
    """A local Hugging Face checkpoint; never touches the network."""
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(Path(path).expanduser()), local_files_only=True, dtype=dtype, attn_implementation=attn_implementation
        )
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # a corrupt or mismatched checkpoint: name the directory, keep the cause
        reraise_if_debug()
        raise wrapped(
            f"model.path = {path!r}: loading the checkpoint", exc, "check config.json and the weights"
        ) from exc
    return model.to(device)


def _check_attn_implementation(name: str) -> str:
    from transformers import AttentionInterface

    known = ["eager", *AttentionInterface().valid_keys()]
    if name not in known:
        raise UserError(
            f"model.attn_implementation = {name!r} is unknown; choose "
            f"{ATTN_NAME!r} (packed varlen), 'sdpa' or 'eager' (or one of {sorted(known)})"
        )
    return name


def load_tokenizer(model_cfg):
    """model.tokenizer if set, else the tokenizer in model.path, else the preset's built-in one."""
    if model_cfg.tokenizer:
        return tokenizer_from_dir(model_cfg.tokenizer, "model.tokenizer")
    if model_cfg.path:
        return tokenizer_from_dir(model_cfg.path, "model.path")
    return preset_tokenizer(model_cfg.preset)


def tokenizer_from_dir(path: str, key: str):
    """A local Hugging Face tokenizer directory; an error names `key`, the config key that pointed here."""
    try:
        return AutoTokenizer.from_pretrained(str(Path(path).expanduser()), local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(f"{key} = {path!r}: the tokenizer there does not load ({err})") from err


def load_model_for_rank(model_cfg, dist: DistContext, dtype: torch.dtype):
    """(model, tokenizer) as this rank should hold them before sharding.

    A checkpoint (model.path) is read by rank 0 alone; the other ranks build the model on the
    meta device (no memory, no disk reads) and the FSDP2 plugin fills their shards from rank 0's
    weights (broadcast_from_rank0). Random presets are drawn on every rank: seeded, and cheaper
    than a broadcast.
    """
    if dist.world_size == 1 or dist.rank == 0 or not model_cfg.path:
        return load_model(model_cfg, dist.device, dtype)
    config = AutoConfig.from_pretrained(model_cfg.path, local_files_only=True)
    model = meta_model(config, dtype, model_cfg.attn_implementation or ATTN_NAME)
    return model.eval(), load_tokenizer(model_cfg)
