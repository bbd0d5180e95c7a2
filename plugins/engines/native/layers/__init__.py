"""The native engine's ops, one module per op family, each its torch reference beside its Triton
kernel and the check that compares them: norm (RMSNorm, with the residual add), activation
(SiLU·mul), rotary (RoPE and the KV cache write), attention (prefill), paged_attention (decode),
sampling. ops picks an implementation per op; meta is what a step tells them; jit lets the
modules import where triton does not."""
