"""pass@k: the probability that at least one of k samples drawn without replacement from a
prompt's n samples is correct, estimated without bias from all n (Chen et al. 2021, "Evaluating
Large Language Models Trained on Code", eq. 1):

    pass@k = 1 - C(n - c, k) / C(n, k)      c: correct samples of n; 1 when n - c < k

computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms the large binomials.
"""

from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate for one prompt with c correct of n samples (1 <= k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def ks_for(n: int) -> list[int]:
    """The k reported for n samples a prompt: 1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]
