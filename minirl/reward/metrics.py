"""The step's reward metrics, summed over data-parallel ranks: failure counts by kind, the
means of the extra keys of dict answers, and the overlong penalty."""

from __future__ import annotations

import torch

from minirl.reward.manager import FAILURES, METRIC, RewardResult


def reward_metrics(result: RewardResult, penalty_B: torch.Tensor | None, dist) -> dict[str, float]:
    """reward/errors|timeouts|crashes (counts), reward/extra/<key>/mean, and with the overlong
    buffer on: reward/overlong_penalty/mean and reward/overlong_penalty/frac (share penalised)."""
    dev = dist.device
    counts = dist.all_reduce(torch.tensor([float(result.count(k)) for k in FAILURES], device=dev))
    out = {METRIC[k]: float(c) for k, c in zip(FAILURES, counts.tolist())}
    keys = _all_keys(sorted(result.extras), dist)
    if keys:
        sums = [[sum(result.extras.get(k, [])), float(len(result.extras.get(k, [])))] for k in keys]
        t = dist.all_reduce(torch.tensor(sums, dtype=torch.float64, device=dev))
        out.update({f"reward/extra/{k}/mean": float(s / max(n, 1.0)) for k, (s, n) in zip(keys, t.tolist())})
    if penalty_B is not None:
        p = penalty_B.detach().double()
        n = torch.tensor(float(p.numel()), dtype=torch.float64, device=p.device)
        t = dist.all_reduce(torch.stack([p.sum(), (p < 0).double().sum(), n]))
        n = max(float(t[2]), 1.0)
        out.update({"reward/overlong_penalty/mean": float(t[0]) / n, "reward/overlong_penalty/frac": float(t[1]) / n})
    return out


def _all_keys(keys: list[str], dist) -> list[str]:
    """The union of the ranks' extra keys, so every rank reduces the same tensor."""
    return sorted({k for ks in dist.all_gather_objects(keys) for k in ks})


def merge_reward_metrics(per_batch: list[dict[str, float]]) -> dict[str, float]:
    """One value per key over the step's generation batches: a .../mean is averaged, a .../max or
    .../min kept as the extreme, anything else (counts such as reward/errors) summed."""
    out: dict[str, float] = {}
    for key in per_batch[0]:
        values = [m[key] for m in per_batch if key in m]
        if key.endswith("/mean"):
            out[key] = sum(values) / len(values)
        elif key.endswith(("/max", "/min")):
            out[key] = max(values) if key.endswith("/max") else min(values)
        else:
            out[key] = sum(values)
    return out
