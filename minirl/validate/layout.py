"""The rules of the job's shape: the launcher and the devices it starts on, how a step's batch
splits into mini-batches and over the (dp, sp) mesh, and the token budgets of dynamic
micro-batches. They are the only check of these rules: the code that splits batches
(minirl.dist.spmd, minirl.data.prompts, minirl.batch) takes them as given.
"""

from __future__ import annotations

from minirl.config.load import Config
from minirl.critic import resolved
from minirl.validate.critic import uses_critic
from minirl.validate.problem import Problem, value, world_size


def launcher_problems(cfg: Config, pm) -> list[Problem]:
    """The launcher exists and fits the job: one node for local, torchrun's variables for torchrun."""
    from minirl.dist.launchers import AUTO, choose
    from minirl.dist.spmd import under_torchrun

    t, key = cfg.trainer, "trainer.launcher"
    if t.launcher != AUTO and t.launcher not in pm["launchers"]:
        names = ", ".join([AUTO, *sorted(pm["launchers"].items)])
        return [Problem(key, t.launcher, "no such launcher", f"choose one of {names}")]
    name, _ = choose(t)
    if name == "local" and t.nnodes > 1:
        rule = "the local launcher starts the processes of one machine"
        return [Problem("trainer.nnodes", t.nnodes, rule, "use trainer.launcher = 'ray' (or 'auto') for several nodes")]
    if name != "ray" and t.ray_address:
        return [Problem("trainer.ray_address", t.ray_address, f"unused: {key} = {name!r}", "use 'ray' or 'auto'")]
    if name == "local" and under_torchrun():
        return [Problem(key, t.launcher, "RANK and WORLD_SIZE are set (torchrun)", "use 'auto' or 'torchrun'")]
    if name == "torchrun" and not under_torchrun():
        return [Problem(key, t.launcher, "RANK and WORLD_SIZE are not set", "start with torchrun, or use 'auto'")]
    if t.device != "cuda" and t.nnodes > 1 and t.world_size % t.nnodes:
        rule = f"CPU processes in all, which must split evenly over trainer.nnodes = {t.nnodes}"
        return [Problem("trainer.world_size", t.world_size, rule, f"use a multiple of {t.nnodes}")]
    return []


def device_problems(cfg: Config, pm) -> list[Problem]:
    t = cfg.trainer
    if t.device not in ("cuda", "auto"):
        return []
    from minirl.dist.launchers import choose

    if choose(t)[0] == "ray":
        return []  # the GPUs are the Ray cluster's, not this machine's (the launcher checks them)
    import torch

    if t.device == "cuda" and not torch.cuda.is_available():
        return [Problem("trainer.device", t.device, "CUDA is not available here", "use 'cpu' or 'auto'")]
    count = torch.cuda.device_count()
    if torch.cuda.is_available() and t.n_gpus_per_node > count:
        rule, fix = f"this machine has {count} GPU(s)", f"use at most {count}"
        return [Problem("trainer.n_gpus_per_node", t.n_gpus_per_node, rule, fix)]
    rollout = cfg.rollout_world
    if torch.cuda.is_available() and rollout and t.n_gpus_per_node + rollout > count:
        rule = f"rollout GPUs come on top of trainer.n_gpus_per_node = {t.n_gpus_per_node}; this machine has {count}"
        fix = f"use at most {count - t.n_gpus_per_node}, or fewer trainer GPUs"
        return [Problem("rollout.n_gpus_per_node", cfg.rollout.n_gpus_per_node, rule, fix)]
    return []


def _mini_batches(cfg: Config, pm) -> list[tuple[str, int]]:
    """The mini-batch sizes in force: the actor's, and the critic's when it trains and is set
    (unset, it is the actor's)."""
    found = [("actor.ppo_mini_batch_size", cfg.actor.ppo_mini_batch_size)]
    if uses_critic(cfg, pm) and cfg.critic.ppo_mini_batch_size is not None:
        found.append(("critic.ppo_mini_batch_size", cfg.critic.ppo_mini_batch_size))
    return found


def batch_problems(cfg: Config, pm) -> list[Problem]:
    """A mini-batch is whole prompts of the step: at most data.train_batch_size, and dividing it."""
    batch, out = cfg.data.train_batch_size, []
    for key, mini in _mini_batches(cfg, pm) if batch >= 1 else []:
        if mini > batch:
            out.append(Problem(key, mini, f"larger than data.train_batch_size = {batch}", f"use at most {batch}"))
        elif mini >= 1 and batch % mini:
            rule = f"does not divide data.train_batch_size = {batch} (the rest would be left out)"
            divisor = max(d for d in range(1, mini + 1) if batch % d == 0)
            out.append(Problem(key, mini, rule, f"use a divisor such as {divisor}"))
    return out


def layout_problems(cfg: Config, pm, world: int | None = None) -> list[Problem]:
    """sp divides the world (default: the one the config asks for); the batch and every mini-batch
    divide over the data-parallel ranks (ranks take whole prompts); the reference and the critic
    run on the actor's mesh."""
    world, sp = world_size(cfg) if world is None else world, cfg.actor.ulysses_sequence_parallel_size
    if world < 1 or sp < 1:
        return []  # the range rules say so
    if world % sp:
        fix = f"use a divisor of {world} (1 runs without sequence parallelism)"
        return [Problem("actor.ulysses_sequence_parallel_size", sp, f"does not divide the world size {world}", fix)]
    dp = world // sp
    rule, fix = f"does not divide over {dp} data-parallel ranks (world {world} / sp {sp})", f"use a multiple of {dp}"
    sized = [("data.train_batch_size", cfg.data.train_batch_size), *_mini_batches(cfg, pm)]
    out = [Problem(key, v, rule, f"{fix}: ranks take whole prompts") for key, v in sized if v >= 1 and v % dp]
    followers = [("ref", "the reference")] + ([("critic", "the critic")] if uses_critic(cfg, pm) else [])
    for section, who in followers:
        key = f"{section}.ulysses_sequence_parallel_size"
        if value(cfg, key) not in (1, sp):
            out.append(Problem(key, value(cfg, key), f"{who} runs on the actor's mesh", f"use 1 or the actor's {sp}"))
    return out


def token_budget_problems(cfg: Config, pm) -> list[Problem]:
    """With dynamic batching a micro-batch holds at least one whole sequence. Each rank of an sp
    group holds 1/sp of a micro-batch's tokens, so a budget per GPU times the actor's
    ulysses_sequence_parallel_size (the mesh every model runs on) must reach the longest sequence."""
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    sp = max(1, cfg.actor.ulysses_sequence_parallel_size)
    least = -(-longest // sp)
    sequence = f"one sequence (max_prompt_length + max_response_length = {longest})"
    out = []
    for key, budget in _token_budgets(cfg, pm):
        if budget < least:
            split = f"x actor.ulysses_sequence_parallel_size {sp} = {budget * sp} tokens, " if sp > 1 else ""
            out.append(Problem(key, budget, f"{split}smaller than {sequence}", f"raise it to at least {least}"))
    return out


def _token_budgets(cfg: Config, pm) -> list[tuple[str, int]]:
    """(key, tokens per GPU) of every pass that micro-batches by tokens (use_dynamic_bsz)."""
    a, r, ref = cfg.actor, cfg.rollout, cfg.ref
    found = [
        ("actor.ppo_max_token_len_per_gpu", a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu),
        ("rollout.log_prob_max_token_len_per_gpu", r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu),
        ("ref.log_prob_max_token_len_per_gpu", ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu),
    ]
    if uses_critic(cfg, pm):
        # a critic key left unset is the actor's budget, checked above under the actor's key
        c, own = resolved(cfg.critic, cfg.actor), cfg.critic
        if own.use_dynamic_bsz is not None or own.ppo_max_token_len_per_gpu is not None:
            found.append(("critic.ppo_max_token_len_per_gpu", c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu))
        if own.forward_max_token_len_per_gpu is not None:
            found.append(("critic.forward_max_token_len_per_gpu", c.use_dynamic_bsz, c.forward_max_token_len_per_gpu))
    return [(key, budget) for key, dynamic, budget in found if dynamic]
