"""The native engine's ops, one module per op family, each its torch reference beside its Triton
kernel and their check: norm, activation (SiLU·mul), rotary (RoPE and the KV cache write),
attention (prefill), paged_attention (decode), sampling. ops picks one per op; meta is what a step
tells them; jit lets them import where triton does not."""
