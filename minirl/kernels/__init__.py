"""Triton kernels of the trainer side (fused log-prob/entropy head, the SiLU·mul gate/up GEMM),
and the one self-check every kernel runs before it is trusted. Imports torch and triton only."""
