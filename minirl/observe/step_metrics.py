"""Per-step data statistics and performance figures, reduced over all data-parallel ranks.

Names follow verl's (score/mean, response_length/clip_ratio, perf/throughput, …); the
definitions are docs/algorithms.md §7's. A response's length is its model tokens (the sum of
its mask): a multi-turn response's tool and user tokens are counted apart
(response_length/with_tool_tokens/mean, response/model_token_share), so response_length keeps
its single-turn meaning. Forward-pass throughputs count every token, tool tokens included,
since the forward runs over them.
"""

from __future__ import annotations

import torch

from minirl.batch import RolloutBatch
from minirl.critic.value_loss import explained_variance
from minirl.dist.context import DistContext
from minirl.observe.metrics import flops_params, peak_flops, train_flops


def reduced_stats(prefix: str, x: torch.Tensor, dist: DistContext) -> dict[str, float]:
    """mean/max/min of the values of x on all ranks (exact: sums and counts are reduced)."""
    x = x.detach().double().flatten()
    mean = global_mean(x, dist)
    big = torch.tensor(float("inf"), dtype=torch.float64, device=x.device)
    hi = dist.all_reduce(x.max() if x.numel() else -big, "max")
    lo = dist.all_reduce(x.min() if x.numel() else big, "min")
    return {f"{prefix}/mean": mean, f"{prefix}/max": float(hi), f"{prefix}/min": float(lo)}


def global_mean(x: torch.Tensor, dist: DistContext) -> float:
    """The mean of the values of x on all ranks (0 without any), from one reduced sum and count."""
    x = x.double()
    count = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
    sums = dist.all_reduce(torch.stack([x.sum(), count]))
    return float(sums[0] / sums[1].clamp(min=1))


def data_metrics(batch: RolloutBatch, dist: DistContext) -> dict[str, float]:
    """score, reward, advantages and returns (over model tokens), response_length (model tokens
    per response, EOS included: the mask's sum), prompt_length, the clip ratio and the share of
    groups of equal scores; then the tool-token counts of `response_token_metrics`."""
    dev = dist.device
    mask = batch.mask_BT.bool()
    resp_len = batch.mask_BT.sum(-1)
    prompt_len = torch.tensor([float(len(p)) for p in batch.prompts], device=dev)
    out = {}
    out.update(reduced_stats("score", batch.scores_B, dist))
    out.update(reduced_stats("reward", batch.rewards_BT.sum(-1), dist))
    out.update(reduced_stats("advantages", batch.advantages_BT[mask], dist))
    out.update(reduced_stats("returns", batch.returns_BT[mask], dist))
    out.update(reduced_stats("response_length", resp_len, dist))
    out.update(reduced_stats("prompt_length", prompt_len, dist))
    truncated = torch.tensor([r == "length" for r in batch.finish_reasons], device=dev)
    out["response_length/clip_ratio"] = global_mean(truncated, dist)
    out["batch/solve_none_or_all_share"] = global_mean(equal_score_groups(batch), dist)
    out.update(response_token_metrics(batch, dist))
    return out


def response_token_metrics(batch: RolloutBatch, dist: DistContext) -> dict[str, float]:
    """response/model_token_share: model tokens / all response tokens (1.0 single-turn; 0 with
    no response token), and response_length/with_tool_tokens/mean: response tokens per response,
    tool and user tokens included. Both over all ranks, from one reduce."""
    model_1 = batch.mask_BT.double().sum().reshape(1)
    host_2 = torch.tensor([float(sum(map(len, batch.responses))), float(len(batch))], dtype=torch.float64)
    model, tokens, count = dist.all_reduce(torch.cat([model_1, host_2.to(model_1.device)])).tolist()
    return {
        "response/model_token_share": model / max(tokens, 1.0),
        "response_length/with_tool_tokens/mean": tokens / max(count, 1.0),
    }


def equal_score_groups(batch: RolloutBatch) -> torch.Tensor:
    """One flag per group: all its scores are equal (such a group gives zero GRPO advantage)."""
    scores, groups = batch.scores_B.cpu(), batch.group_B.cpu()
    uniq, inv = torch.unique(groups, return_inverse=True)
    hi = torch.full((len(uniq),), -float("inf")).scatter_reduce(0, inv, scores, "amax")
    lo = torch.full((len(uniq),), float("inf")).scatter_reduce(0, inv, scores, "amin")
    return (hi == lo).to(batch.mask_BT.device)


def perf_metrics(
    batch: RolloutBatch,
    seconds: dict[str, float],
    actor,
    cfg,
    dist: DistContext,
    generated: float | None = None,
    trained: int | None = None,
) -> dict[str, float]:
    """Throughputs (which tokens each counts is in its name/table) and the actor's MFU.

    generated: this rank's response tokens generated in the step, over every prompt batch drawn
    (dynamic sampling drops some); None = the trained batch's. Generation throughput counts them.
    trained: the parameters that get weight gradients (LoRA: the adapters'); None = all of them.
    Response tokens are model tokens (the mask's sum); total tokens are what the forwards run
    over (prompts and every response token, tool tokens included): the same for single-turn.
    """
    resp_tokens = float(batch.mask_BT.sum())
    all_tokens = float(sum(batch.seq_lens()))
    gen_tokens = resp_tokens if generated is None else float(generated)
    totals = dist.all_reduce(
        torch.tensor([resp_tokens, all_tokens, gen_tokens], dtype=torch.float64, device=dist.device)
    )
    resp, total, gen = (float(t) for t in totals)
    world = dist.world_size
    out = {
        "perf/total_response_tokens": resp,
        "perf/total_tokens": total,
        "perf/generated_response_tokens": gen,
        "perf/gen_throughput_per_gpu": gen / (seconds["gen"] * world),
        "perf/throughput": total / seconds["step"],
    }
    for phase in ("old_log_prob", "ref", "values"):  # each may be skipped (on-policy; no KL; no critic)
        if phase in seconds:
            out[f"perf/{phase}_throughput_per_gpu"] = total / (seconds[phase] * world)
    peak = peak_flops(dist.device, cfg.trainer.peak_flops)
    if peak > 0 and "update_actor" in seconds:  # skipped during trainer.critic_warmup
        n, lens = flops_params(actor), batch.seq_lens()
        flops = cfg.actor.ppo_epochs * train_flops(actor.config, n, lens, backward=True, n_trained=trained)
        flops = float(dist.all_reduce(torch.tensor(flops, dtype=torch.float64, device=dist.device)))
        out["perf/mfu/actor"] = flops / (seconds["update_actor"] * world * peak)
    if torch.cuda.is_available() and dist.device.type == "cuda":
        out["perf/max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(dist.device) / 2**30
    return out


def engine_metrics(engine, dist: DistContext) -> dict[str, float]:
    """The rollout engine's own account of its last generate, where it keeps one (`last_stats`;
    numbers only), the largest over the ranks. Seconds (keys ending in _s: the native engine's
    KV-cache resume and release, CUDA-graph captures, host wait) are parts of the gen phase,
    logged as timing_s/gen.<part>; GiB (keys ending in _gib: its weights, its KV cache) as
    memory_gib/held/engine.<name> (minirl.observe.memory); counts (preemptions, graph captures)
    as rollout/<name>."""
    stats = getattr(engine, "last_stats", None) or {}
    keys = sorted(k for k, v in stats.items() if isinstance(v, (int, float)))
    if not keys:
        return {}
    values = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64, device=dist.device)
    out = {}
    for key, value in zip(keys, dist.all_reduce(values, "max").tolist()):
        if key.endswith("_s"):
            out[f"timing_s/gen.{key[:-2]}"] = value
        elif key.endswith("_gib"):
            out[f"memory_gib/held/engine.{key[:-4]}"] = value
        else:
            out[f"rollout/{key}"] = value
    return out


def tool_time_metrics(wall_s: float, engine_idle_s: float, dist: DistContext | None = None) -> dict[str, float]:
    """agent/tool_wall_s: the seconds with a tool call out (minirl.agent.server.ToolTime), summed
    over the data-parallel ranks with `dist` (without it: already summed); agent/engine_idle_on_tools_s:
    those the engine had nothing else to decode; agent/tool_overlap: the share of the tool seconds
    the engine decoded other samples (1: the tools cost the engine no time), absent in a step
    without tool calls."""
    wall, idle = wall_s, engine_idle_s
    if dist is not None:
        values = torch.tensor([wall_s, engine_idle_s], dtype=torch.float64, device=dist.device)
        wall, idle = dist.all_reduce(values).tolist()
    out = {"agent/tool_wall_s": wall, "agent/engine_idle_on_tools_s": idle}
    if wall > 0:
        out["agent/tool_overlap"] = max(0.0, 1.0 - idle / wall)
    return out


def value_metrics(batch: RolloutBatch, dist: DistContext) -> dict[str, float]:
    """critic/values/mean|max|min, critic/returns/mean and critic/vf_explained_var over the valid
    tokens of every data-parallel rank (values from the values pass, returns from the estimator)."""
    mask = batch.mask_BT.bool()
    values_BT, returns_BT = batch.values_BT, batch.returns_BT
    out = reduced_stats("critic/values", values_BT[mask], dist)
    out["critic/returns/mean"] = global_mean(returns_BT[mask].detach(), dist)
    out["critic/vf_explained_var"] = explained_variance(returns_BT, values_BT, batch.mask_BT, dist.all_reduce)
    return out


def agent_metrics(trajectories: list, dist: DistContext) -> dict[str, float]:
    """Multi-turn rollouts: num_turns mean|max|min (verl's count: prompt, model turns and
    appended message turns), agent/assistant_turns mean|max|min (model turns per sample) and each
    count the loops report (Trajectory.metrics; tool_agent: tool_calls, tool_<status>,
    tool_latency_s) summed over the step's samples on all ranks (keys ending in _max_s: the
    largest; tool_calls is 0 in a step without any); agent/tool_latency_s/mean is the mean seconds
    per tool call."""
    out = reduced_stats("num_turns", torch.tensor([float(t.num_turns) for t in trajectories]), dist)
    model_turns = torch.tensor([float(t.assistant_turns) for t in trajectories])
    out.update(reduced_stats("agent/assistant_turns", model_turns, dist))
    out["agent/tool_calls"] = 0.0  # a step without any call says so (the console shows it)
    keys = sorted(
        {k for ks in dist.all_gather_objects(sorted({k for t in trajectories for k in t.metrics})) for k in ks}
    )
    if not keys:
        return out
    per_key = [[float(t.metrics.get(k, 0.0)) for t in trajectories] for k in keys]
    biggest = [k.endswith("_max_s") for k in keys]
    local = torch.tensor(
        [max(v, default=0.0) if big else sum(v) for v, big in zip(per_key, biggest)], dtype=torch.float64
    )
    sums = dist.all_reduce(torch.where(torch.tensor(biggest), 0.0, local).to(dist.device))
    maxes = dist.all_reduce(torch.where(torch.tensor(biggest), local, 0.0).to(dist.device), "max")
    values = dict(zip(keys, torch.where(torch.tensor(biggest, device=dist.device), maxes, sums).tolist()))
    out.update({f"agent/{k}": v for k, v in values.items()})
    if values.get("tool_calls"):
        out["agent/tool_latency_s/mean"] = values.get("tool_latency_s", 0.0) / values["tool_calls"]
    return out
