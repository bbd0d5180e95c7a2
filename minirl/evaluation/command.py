"""`python -m minirl eval`: generate on parquet files (verl's schema) with a training checkpoint or a
Hugging Face directory, without training; score every response with the reward function of its
row's data_source (or custom_reward_function.path); print the mean score and pass@k per
data_source; write every sample to a JSON-lines file. verl's generation and evaluation scripts
do this job for verl.

The model, tokenizer, rollout engine, agent loops and rewards are built as a run builds them
(minirl.build), from the checkpoint's config.toml (or the defaults, for a Hugging Face
directory), with `section.key=value` overrides on top (e.g. rollout.name=hf, trainer.device=cuda,
custom_reward_function.path=my_reward.py). A sample counts as correct for pass@k when its score
is at least --pass-score (1.0: the built-in rewards' full marks).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

from minirl import build
from minirl.agent.loop import to_samples
from minirl.checkpoint import store
from minirl.checkpoint.export import OVERRIDES_HELP, checkpoint_config, find_checkpoint, load_checkpoint_model
from minirl.config.load import Config, load_config
from minirl.data.prompts import expand_groups, load_prompts
from minirl.dist import spmd
from minirl.errors import UserError
from minirl.evaluation.passk import ks_for, pass_at_k
from minirl.models import lora
from minirl.models.loading import load_model
from minirl.plugins import PluginManager
from minirl.protocols import SamplingParams
from minirl.reward.manager import build_reward_manager
from minirl.reward.trajectory import rule_scores


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minirl eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="a ckpt_<step> directory, a run directory or a Hugging Face one")
    p.add_argument("--data", required=True, nargs="+", metavar="FILE", help="parquet files in verl's schema")
    p.add_argument("--out", required=True, metavar="FILE", help="the JSON-lines file of every sample (rewritten)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0: off)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (one sample per prompt)")
    p.add_argument("--max-response-length", type=int, help="tokens per response (default: data.max_response_length)")
    p.add_argument("--pass-score", type=float, default=1.0, help="the score a correct sample reaches (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP.replace("the checkpoint's config.toml", "the config"))
    return p


def eval_command(argv: list[str]) -> int:
    args = _parser().parse_intermixed_args(argv)
    _check_args(args)
    cfg, ckpt = model_config(args.model, args.overrides)
    dist = spmd.single_process(cfg)  # the device, and the CPU threads a run takes
    try:
        model, tokenizer = _model(cfg, ckpt, args.overrides, dist.device)
        records, samples = _generate(args, cfg, model, tokenizer, dist)
    finally:
        spmd.shutdown()
    _write(args.out, samples)
    print(summary_table(summarize(records, samples, args.pass_score)))
    print(f"wrote {args.out}: {len(samples)} samples ({len(records)} prompts x {len(samples) // len(records)})")
    return 0


def _check_args(args) -> None:
    if args.n < 1:
        raise UserError(f"--n {args.n}: give at least 1 sample per prompt")
    if args.greedy and args.n > 1:
        raise UserError(f"--greedy with --n {args.n}: greedy decoding gives one response per prompt; drop one flag")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UserError(f"--temperature {args.temperature} --top-p {args.top_p}: need temperature >= 0, 0 < top-p <= 1")
    if args.max_response_length is not None and args.max_response_length < 1:
        raise UserError(f"--max-response-length {args.max_response_length}: give at least 1 token")
    for path in args.data:
        if not os.path.isfile(path):
            raise UserError(f"--data {path}: no such file; give parquet files in verl's schema (make data writes some)")
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise UserError(f"--out {args.out}: cannot write in {parent} (missing or read-only); create it first")


def model_config(path: str, overrides: list[str]) -> tuple[Config, str | None]:
    """(config, checkpoint or None): a checkpoint's own config.toml, else the defaults with
    model.path = the Hugging Face directory; the overrides on top."""
    if not os.path.isdir(path):
        raise UserError(f"--model {path}: no such directory; give a ckpt_<step>, run or Hugging Face directory")
    if os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, store.MANIFEST)):
        return load_config(None, [f"model.path={json.dumps(path)}", *overrides]), None
    ckpt = find_checkpoint(path, "--model")
    return checkpoint_config(ckpt, overrides), ckpt


def _model(cfg: Config, ckpt: str | None, overrides: list[str], device):
    """A plain model (LoRA merged) and its tokenizer, on `device`."""
    if ckpt is None:
        return load_model(cfg.model, device, cfg.model.dtype)
    model, tokenizer, _ = load_checkpoint_model(ckpt, device, overrides)
    return lora.unload(model), tokenizer


def _generate(args, cfg: Config, model, tokenizer, dist) -> tuple[list, list[dict]]:
    """Every prompt's samples through its row's agent loop, then scored: (records, one dict each)."""
    pm = PluginManager(cfg.plugins.modules)
    agents = build.agent_rollout(pm, cfg, tokenizer)
    records = load_prompts(args.data, tokenizer, cfg.data, agents.tool_schemas)
    agents.check_rows(records)
    if not records:
        raise UserError(f"--data {' '.join(args.data)}: no prompt left to generate on (see the notice above)")
    rewards = build_reward_manager(cfg.reward, cfg.custom_reward_function, pm["reward_functions"], cfg.plugins.modules)
    rewards.check_sources(records)  # before any generation
    engine = build.engine(pm, cfg, model, tokenizer, dist)
    expanded, uids = expand_groups(records, args.n, 0)
    params = SamplingParams(
        temperature=0.0 if args.greedy else args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_response_length or cfg.data.max_response_length,
        seed=args.seed,
    )
    try:
        trajectories = agents.run(engine, to_samples(expanded, uids, params, "eval-"), [r.agent_name for r in expanded])
        scores = rule_scores(rewards, tokenizer, expanded, trajectories).scores
    finally:
        rewards.close()
        agents.close()
    return records, [_sample(rec, uid, t, s, tokenizer) for rec, uid, t, s in zip(expanded, uids, trajectories, scores)]


def _sample(rec, uid: int, t, score: float, tokenizer) -> dict:
    return {
        "prompt_index": uid,
        "source": rec.source,
        "data_source": rec.data_source,
        "prompt": tokenizer.decode(rec.prompt_ids),
        "response": tokenizer.decode(t.response_ids, skip_special_tokens=True),
        "response_tokens": sum(t.response_mask),
        "finish_reason": t.finish_reason,
        "score": score,
        "ground_truth": rec.ground_truth,
    }


def summarize(records: list, samples: list[dict], pass_score: float) -> dict[str, dict]:
    """Per data_source (and "all"): prompts, samples per prompt, mean score, pass@k for k = 1, 2,
    4, ... n (each prompt's unbiased estimate, averaged over the prompts)."""
    correct: dict[int, list[bool]] = defaultdict(list)
    for s in samples:
        correct[s["prompt_index"]].append(s["score"] >= pass_score)
    groups = defaultdict(list)
    for i, rec in enumerate(records):
        groups[rec.data_source].append(i)
    out = {src: _group_stats(idx, correct, samples) for src, idx in sorted(groups.items())}
    return out | {"all": _group_stats(list(range(len(records))), correct, samples)}


def _group_stats(prompts: list[int], correct: dict[int, list[bool]], samples: list[dict]) -> dict:
    n = len(correct[prompts[0]])
    chosen = set(prompts)
    scores = [s["score"] for s in samples if s["prompt_index"] in chosen]
    passes = {f"pass@{k}": sum(pass_at_k(n, sum(correct[i]), k) for i in prompts) / len(prompts) for k in ks_for(n)}
    return {"prompts": len(prompts), "n": n, "mean_score": sum(scores) / len(scores), **passes}


def summary_table(stats: dict[str, dict]) -> str:
    keys = [k for k in next(iter(stats.values())) if k.startswith("pass@")]
    head = f"{'data_source':24s} {'prompts':>8s} {'n':>4s} {'mean score':>11s}" + "".join(f" {k:>8s}" for k in keys)
    lines = [head, "-" * len(head)]
    for src, s in stats.items():
        row = f"{src:24s} {s['prompts']:8d} {s['n']:4d} {s['mean_score']:11.4f}"
        lines.append(row + "".join(f" {s[k]:8.4f}" for k in keys))
    return "\n".join(lines)


def _write(path: str, samples: list[dict]) -> None:
    with open(path, "w") as f:
        for s in samples:
            f.write(json.dumps(s, default=_plain) + "\n")


def _plain(value):
    """Parquet structs come back with numpy arrays inside: as lists; anything else as its text."""
    return value.tolist() if hasattr(value, "tolist") else str(value)
