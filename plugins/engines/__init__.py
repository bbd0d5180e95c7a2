"""Built-in rollout engines: `native` (paged KV cache, Triton kernels), `hf` (transformers'
generate) and `sglang` (the SGLang engine, optional extra)."""
