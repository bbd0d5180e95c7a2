"""The reward phase alone: decoding the responses and scoring them (minirl.reward.trajectory's
training_scores with the built-in gsm8k reward), at the long-context step's shape (64 x 27,648
response tokens) and the 32 x 8 x 1,024 workload's, with DeepSeek-R1-Distill-Qwen's tokenizer.

    python3 dev/bench_reward.py                 # no GPU needed
    python3 dev/bench_reward.py --reps 5

Printed per shape: the median seconds of transformers' batch_decode, of minirl's decode
(minirl.models.tokenizers.decode_batch: the tokenizers library's own batch decode), of finding
every response's final turn, and of the whole phase as the trainer runs it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

import torch

from minirl.data.prompts import PromptRecord
from minirl.dist.context import DistContext
from minirl.models.tokenizers import decode_batch, qwen2_tokenizer
from minirl.plugins import PluginManager
from minirl.protocols import Trajectory
from minirl.reward.manager import build_reward_manager
from minirl.reward.trajectory import final_turn_ids, training_scores

SHAPES = ((64, 27648), (256, 1024))


def median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def batch(rows: int, length: int, vocab: int, seed: int = 0):
    """Random responses that end in a gsm8k answer, one record per response."""
    rng = random.Random(seed)
    answer = [int(i) for i in qwen2_tokenizer().encode(" #### 42", add_special_tokens=False)]
    trajectories, records = [], []
    for i in range(rows):
        ids = [rng.randrange(vocab) for _ in range(length - len(answer))] + answer
        trajectories.append(Trajectory(prompt_ids=[1, 2, 3], response_ids=ids, response_mask=[1] * length))
        records.append(PromptRecord([1, 2, 3], "gsm8k", "42", {}, f"bench:{i}", i))
    return records, trajectories


def row(tokenizer, rewards, rows: int, length: int, reps: int) -> str:
    """One shape's line of the table."""
    records, trajectories = batch(rows, length, len(tokenizer) - 300)
    ids = [t.response_ids for t in trajectories]
    assert decode_batch(tokenizer, ids) == tokenizer.batch_decode(ids, skip_special_tokens=True)
    old = median_s(lambda: tokenizer.batch_decode(ids, skip_special_tokens=True), reps)
    new = median_s(lambda: decode_batch(tokenizer, ids), reps)
    turns = median_s(lambda: [final_turn_ids(t) for t in trajectories], reps)
    overlong = SimpleNamespace(enable=False, len=0, penalty_factor=1.0)
    dist = DistContext(device=torch.device("cpu"))

    def phase():
        scores, _ = training_scores(rewards, tokenizer, records, trajectories, overlong, length, dist)
        assert float(scores.min()) == 1.0, "every response ends in the right answer"

    return f"| {rows} x {length:,} | {old:.3f} | {new:.3f} | {turns:.3f} | {median_s(phase, reps):.3f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    tokenizer = qwen2_tokenizer()
    registry = PluginManager(entry_points=False)["reward_functions"]
    reward_cfg = SimpleNamespace(reward_manager="naive", num_workers=0, timeout_s=0.0)
    rewards = build_reward_manager(reward_cfg, SimpleNamespace(path="", name="compute_score"), registry)
    print("| responses x tokens | batch_decode s | decode_batch s | final turns s | reward phase s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for rows, length in SHAPES:
        print(row(tokenizer, rewards, rows, length, args.reps))


if __name__ == "__main__":
    main()
