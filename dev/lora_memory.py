"""What a LoRA run holds on the GPU, by count (no GPU needed): the model is built on the meta device
and held as the trainer holds it on CUDA (float32 masters, the frozen Linears and input embedding
in bf16: minirl.models.lora.hold_frozen_in), beside full fine-tuning of the same model.

    python3 dev/lora_memory.py [--preset qwen2-7b] [--rank 64] [--rows 128] [--max-model-len 2048]

Rows: the actor's frozen weights, its adapters, their gradients and AdamW state, the rollout
engine's bf16 weights (the adapted matrices, merged: the embedding, head and norms are the
actor's own tensors, EngineContext.shared), and the native engine's bf16 KV cache: `rows`
(prompts x n of one generate) at max_model_len (data.max_prompt_length +
data.max_response_length) plus a page each, when rollout.gpu_memory_utilization of the free
memory is larger (useful_pages in
plugins/engines/native/engine/model_runner.py). The defaults are `lora7b` of
scripts/gpu_workload.sh: 16 prompts x 8 samples, 1,024 + 1,024 tokens. A run logs the same holders as
memory_gib/held/<holder> and each phase's peak as memory_gib/<phase> (minirl.observe.memory);
the difference is activations and workspace.
"""

from __future__ import annotations

import argparse

import torch

from minirl.config.load import load_config
from minirl.models import lora
from minirl.models.loading import meta_model
from minirl.models.presets import preset_config

GIB = 2**30


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in params}.values())


def lora_holders(preset: str, rank: int) -> dict[str, float]:
    cfg = load_config(None, [f"model.lora_rank={rank}", f"model.lora_alpha={rank}"]).model
    model = lora.apply_lora(meta_model(preset_config(preset), torch.float32, "sdpa"), cfg, preset)
    lora.hold_frozen_in(model, torch.bfloat16, embedding=torch.bfloat16)  # FSDP2 gathers in bf16 on CUDA
    params = list({id(p): p for p in model.parameters()}.values())
    adapters = nbytes(p for p in params if p.requires_grad)
    # the engine's own: the adapted matrices, merged; the rest it shares with the actor (EngineContext.shared)
    adapted_numel = sum(layer.base_layer.weight.numel() for layer in lora.lora_layers(model).values())
    embed = model.get_input_embeddings().weight
    return {
        "frozen Linears (bf16)": nbytes(p for p in params if not p.requires_grad and p.dim() == 2 and p is not embed),
        "frozen input embedding (bf16)": nbytes([embed]),
        "frozen norms and biases": nbytes(p for p in params if not p.requires_grad and p.dim() == 1),
        "adapters (float32)": adapters,
        "adapter gradients": adapters,
        "AdamW state": 2 * adapters,
        "engine weights (bf16, the adapted matrices)": 2 * adapted_numel,
    }


def full_holders(preset: str) -> dict[str, float]:
    model = meta_model(preset_config(preset), torch.float32, "sdpa")
    weights = nbytes(model.parameters())
    return {
        "weights (float32 masters)": weights,
        "gradients": weights,
        "AdamW state": 2 * weights,
        "rollout engine weights (bf16)": weights // 2,
    }


def kv_bytes(preset: str, rows: int, max_model_len: int, page: int = 16) -> int:
    c = preset_config(preset)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    tokens = (rows * (-(-max_model_len // page) + 1) + 1) * page
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2 * tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2-7b")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--rows", type=int, default=128, help="prompts x n of one generate (16 x 8)")
    ap.add_argument("--max-model-len", type=int, default=2048, help="max prompt + max response tokens")
    args = ap.parse_args()
    kv = kv_bytes(args.preset, args.rows, args.max_model_len)
    held = lora_holders(args.preset, args.rank)
    print(f"{args.preset}, LoRA r{args.rank} all-linear (GiB, by count)")
    for name, value in [*held.items(), (f"bf16 KV cache, {args.rows} rows x {args.max_model_len} tokens", kv)]:
        print(f"  {name:48s} {value / GIB:8.2f}")
    print(f"  {'total':48s} {(sum(held.values()) + kv) / GIB:8.2f}")
    print(f"{args.preset}, full fine-tuning (GiB, by count)")
    full = full_holders(args.preset)
    for name, value in full.items():
        print(f"  {name:48s} {value / GIB:8.2f}")
    print(f"  {'total, before the KV cache and activations':48s} {sum(full.values()) / GIB:8.2f}")


if __name__ == "__main__":
    main()
