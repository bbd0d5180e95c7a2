"""On CUDA: how far compiled decoder layers (model.compile_layers) move the log-probs.

The Qwen2-1.5B shape with random weights in bf16 (what FSDP2's bf16 compute copy runs), one
packed batch of 8 sequences x 1,024 tokens. Per variant (eager; compiled with and without
inductor's emulate_precision_casts) the response log-probs in no-grad mode (a log-prob pass:
inference graph) and in grad mode (the update: training graph), each against the float32 eager
model (the "truth") and against each other. A low-variance-KL column shows what a reference
pass vs an update forward at identical weights would report as kl_loss.

    python3 dev/check_compile_drift.py
"""

from __future__ import annotations

import copy

import torch

from minirl.forward.packed import response_logprobs
from minirl.models import compile as mc
from minirl.models.loading import random_model
from minirl.models.presets import preset_config

DEV = torch.device("cuda")


def logprobs(model, prompts, responses, grad: bool) -> torch.Tensor:
    with torch.set_grad_enabled(grad):
        out, _ = response_logprobs(model, prompts, responses, 0.6, DEV)
    return out.detach().float()


def low_var_kl(a: torch.Tensor, b: torch.Tensor) -> float:
    r = b - a
    return float((torch.exp(r) - r - 1).mean())


def main() -> None:
    base = random_model(preset_config("qwen2-1.5b"), DEV, torch.float32, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 151_000, (128,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(0, 151_000, (896,), generator=g).tolist() for _ in range(8)]
    truth = logprobs(base, prompts, responses, grad=False)  # float32 eager (autocast runs the GEMMs in bf16)
    base = base.to(torch.bfloat16)
    rows = []
    for name, options in (("eager", None), ("compiled", {}), ("compiled+emulate", {"emulate_precision_casts": True})):
        model = copy.deepcopy(base)
        if options is not None:
            mc.INDUCTOR_OPTIONS = options
            mc.compile_layers(model, True)
        nograd = logprobs(model, prompts, responses, grad=False)
        grad = logprobs(model, prompts, responses, grad=True)
        rows.append(
            (
                name,
                float((nograd - truth).abs().mean()),
                float((grad - truth).abs().mean()),
                float((grad - nograd).abs().max()),
                low_var_kl(grad, nograd),
            )
        )
        del model
        torch.cuda.empty_cache()
    print(
        "| variant | mean abs err no-grad vs fp32 | mean abs err grad vs fp32 "
        "| max abs grad vs no-grad | low_var_kl grad vs no-grad |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, a, b, c, d in rows:
        print(f"| {name} | {a:.3g} | {b:.3g} | {c:.3g} | {d:.3g} |")


if __name__ == "__main__":
    main()
