"""Triton kernels of the trainer side (fused log-prob/entropy head, the SiLU·mul gate/up GEMM),
imported only when they run, and `selfcheck`: the one check every kernel passes before it is
trusted (the native engine's kernels use it too). Imports torch and triton only."""
