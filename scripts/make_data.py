"""Write synthetic training data in verl's parquet schema, without any download.

    python scripts/make_data.py --out data --seed 0 --train 2000 --test 200 --tasks gsm8k countdown copy lookup

writes data/<task>/train.parquet and data/<task>/test.parquet for each task:

- gsm8k: templated arithmetic word problems with 2-3 operations; ground truth the answer as a
  string, extra_info.answer a worked solution ending in "#### <n>" (GSM8K's format);
- countdown: 3-4 numbers and a target reachable with each number exactly once; ground truth
  {target, numbers}, extra_info.solution one such equation;
- copy: "Repeat the digit: 7 7 7 7 7 7 7 7" -> "7", a task a tiny model learns in a few steps;
- lookup: "Look up key kqx with the lookup tool and answer with its digit." -> the digit that only
  the lookup tool knows (plugins/tools/lookup.py): a multi-turn task (agent_name tool_agent) that
  needs the tool; ground truth a uniformly random digit, the table in
  extra_info.tools_kwargs.lookup.create_kwargs = {"key": "kqx", "value": "7"}.

Output is a function of --seed only, and train and test never share a prompt. copy has only
50 distinct prompts (5 phrasings x 10 digits), so its rows repeat within a split; the test split
holds out one phrasing per digit instead. lookup's test keys are held out from training.
Importable: write_task(task, out_dir, n_train, n_test, seed).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NAMES = [
    "Ava",
    "Ben",
    "Chloe",
    "Diego",
    "Emma",
    "Farid",
    "Grace",
    "Hiro",
    "Isla",
    "Jamal",
    "Kira",
    "Liam",
    "Mia",
    "Noah",
    "Olga",
    "Priya",
    "Quinn",
    "Rosa",
    "Sam",
    "Tariq",
]
ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards"]
# The digit stands 8 times so that even a randomly initialised model's near-uniform attention
# carries it to the answer position: that is what makes the task learnable in a few CPU minutes.
COPY_TEMPLATES = [
    "Repeat the digit: {r}",
    "Copy this digit: {r}",
    "Say the digit {r}",
    "Echo: {r}",
    "Write the digit {r}",
]
COPY_REPEATS = 8
# Short prompts (the tiny model reads every byte). Keys are letters ("kqx"), so the tool's reply
# holds the only digit the model sees: a random-init model then learns to copy it in minutes,
# where digits in the key (k37) are distractors it must first learn to tell apart.
LOOKUP_TEMPLATES = [
    "Look up key {key} with the lookup tool and answer with its digit.",
    "Use the lookup tool on key {key} and answer with its digit.",
    "Find key {key} with the lookup tool; answer with its digit.",
    "Look up {key} with the lookup tool and reply with its digit.",
]
LOOKUP_KEYS = [f"k{a}{b}" for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz"]
LOOKUP_TEST_KEYS = 100  # keys held out for the test split


@dataclass
class Problem:
    prompt: str
    ground_truth: Any
    extra: dict = field(default_factory=dict)
    agent_name: str = ""  # the row's agent loop; "" writes no agent_name column


# ---------------------------------------------------------------------------------------------
# gsm8k-style word problems: each story returns (question, solution steps, answer)
# ---------------------------------------------------------------------------------------------


def _story_bags(rng: random.Random) -> tuple[str, list[str], int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    have, bags, per = rng.randint(5, 60), rng.randint(2, 9), rng.randint(3, 12)
    total = have + bags * per
    give = rng.randint(1, total - 1)
    question = (
        f"{name} has {have} {item}. {name} buys {bags} bags with {per} {item} in each bag, "
        f"then gives {give} {item} to a friend. How many {item} does {name} have now?"
    )
    steps = [
        f"{name} buys {bags} * {per} = {bags * per} {item}.",
        f"{name} then has {have} + {bags * per} = {total} {item}.",
        f"After giving {give} away, {name} has {total} - {give} = {total - give} {item}.",
    ]
    return question, steps, total - give


def _story_change(rng: random.Random) -> tuple[str, list[str], int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    price, count, extra = rng.randint(2, 15), rng.randint(2, 9), rng.randint(1, 9)
    cost = price * count + extra
    bill = next(b for b in (20, 50, 100, 200) if b > cost)
    question = (
        f"A shop sells {item} for ${price} each. {name} buys {count} {item} and a ${extra} "
        f"bag, and pays with a ${bill} bill. How much change does {name} get in dollars?"
    )
    steps = [
        f"The {item} cost {count} * {price} = {price * count} dollars.",
        f"With the bag, {price * count} + {extra} = {cost} dollars.",
        f"The change is {bill} - {cost} = {bill - cost} dollars.",
    ]
    return question, steps, bill - cost


def _story_legs(rng: random.Random) -> tuple[str, list[str], int]:
    cows, hens = rng.randint(2, 40), rng.randint(2, 60)
    question = f"A farm has {cows} cows and {hens} chickens. How many legs do the animals have in total?"
    steps = [
        f"The cows have {cows} * 4 = {4 * cows} legs.",
        f"The chickens have {hens} * 2 = {2 * hens} legs.",
        f"In total {4 * cows} + {2 * hens} = {4 * cows + 2 * hens} legs.",
    ]
    return question, steps, 4 * cows + 2 * hens


def _story_wages(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    wage, hours, days = rng.randint(8, 30), rng.randint(2, 8), rng.randint(2, 6)
    earned = wage * hours * days
    spent = rng.randint(1, earned - 1)
    question = (
        f"{name} earns ${wage} per hour and works {hours} hours a day for {days} days. "
        f"{name} then spends ${spent}. How many dollars does {name} have left?"
    )
    steps = [
        f"{name} works {hours} * {days} = {hours * days} hours.",
        f"{name} earns {hours * days} * {wage} = {earned} dollars.",
        f"{name} has {earned} - {spent} = {earned - spent} dollars left.",
    ]
    return question, steps, earned - spent


def _story_pages(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    per_day, days = rng.randint(5, 40), rng.randint(2, 9)
    pages = per_day * days + rng.randint(5, 120)
    question = (
        f"A book has {pages} pages. {name} reads {per_day} pages a day for {days} days. "
        f"How many pages are left to read?"
    )
    steps = [
        f"{name} reads {per_day} * {days} = {per_day * days} pages.",
        f"{pages} - {per_day * days} = {pages - per_day * days} pages are left.",
    ]
    return question, steps, pages - per_day * days


STORIES = [_story_bags, _story_change, _story_legs, _story_wages, _story_pages]


def make_gsm8k(rng: random.Random) -> Problem:
    question, steps, answer = rng.choice(STORIES)(rng)
    solution = "\n".join(steps) + f"\n#### {answer}"
    return Problem(f"{question} {GSM8K_INSTRUCTION}", str(answer), {"question": question, "answer": solution})


# ---------------------------------------------------------------------------------------------
# countdown: fold the shuffled numbers with random operators, keeping every value a positive
# integer, so the target is reachable with each number exactly once
# ---------------------------------------------------------------------------------------------


def _combine(rng: random.Random, value: int, expr: str, n: int) -> tuple[int, str]:
    """Apply a random operator that keeps the value a positive integer ("+" always can)."""
    left = f"({expr})" if ("+" in expr or "-" in expr) else expr  # only a sum needs parentheses
    ops = ["+", "-", "*", "/"]
    rng.shuffle(ops)
    for op in ops:
        if op == "-" and value <= n or op == "/" and value % n:
            continue
        result = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
        return result, f"{expr} {op} {n}" if op in "+-" else f"{left} {op} {n}"
    raise AssertionError("unreachable: '+' always applies")


def make_countdown(rng: random.Random) -> Problem:
    while True:
        numbers = [rng.randint(1, 50) for _ in range(rng.randint(3, 4))]
        order = rng.sample(numbers, len(numbers))
        value, expr = order[0], str(order[0])
        for n in order[1:]:
            value, expr = _combine(rng, value, expr, n)
        if 1 <= value <= 999:
            break
    prompt = (
        f"Using the numbers {numbers}, create an equation that equals {value}. You can use "
        f"+, -, *, / and each number exactly once. Show your work in <think> </think> tags "
        f"and give the final equation in <answer> </answer> tags, for example "
        f"<answer> (1 + 2) / 3 </answer>."
    )
    return Problem(prompt, {"target": value, "numbers": numbers}, {"solution": expr})


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------

TASKS: dict[str, tuple[str, str, Callable[[random.Random], Problem] | None]] = {
    # task -> (data_source, ability, problem maker; None: made by its SPLITTERS entry)
    "gsm8k": ("gsm8k", "math", make_gsm8k),
    "countdown": ("countdown", "math", make_countdown),
    "copy": ("copy", "copy", None),
    "lookup": ("lookup", "tool", None),
}


def _distinct(make: Callable[[random.Random], Problem], rng: random.Random, n: int, task: str) -> list[Problem]:
    """n problems with distinct prompts (so a split of them is disjoint by construction)."""
    seen: dict[str, Problem] = {}
    for _ in range(50 * n + 1000):
        if len(seen) == n:
            return list(seen.values())
        problem = make(rng)
        seen.setdefault(problem.prompt, problem)
    raise ValueError(f"{task}: could not generate {n} distinct problems; ask for fewer rows")


def _copy_splits(rng: random.Random, n_train: int, n_test: int) -> tuple[list[Problem], list[Problem]]:
    """Hold out one phrasing per digit for test; rows repeat within a split (50 prompts in all)."""
    train, test = [], []
    for d in range(10):
        held_out = rng.randrange(len(COPY_TEMPLATES))
        for t, template in enumerate(COPY_TEMPLATES):
            prompt = template.format(r=" ".join([str(d)] * COPY_REPEATS))
            (test if t == held_out else train).append(Problem(prompt, str(d)))
    return [rng.choice(train) for _ in range(n_train)], [test[i % 10] for i in range(n_test)]


def _lookup_problem(rng: random.Random, key: str) -> Problem:
    digit = str(rng.randrange(10))
    tools_kwargs = {"lookup": {"create_kwargs": {"key": key, "value": digit}}}
    prompt = rng.choice(LOOKUP_TEMPLATES).format(key=key)
    return Problem(prompt, digit, {"tools_kwargs": tools_kwargs}, agent_name="tool_agent")


def _lookup_splits(rng: random.Random, n_train: int, n_test: int) -> tuple[list[Problem], list[Problem]]:
    """Disjoint keys for train and test (so no prompt is shared); rows repeat keys within a
    split, each with its own random digit, which only the tool reveals."""
    keys = rng.sample(LOOKUP_KEYS, len(LOOKUP_KEYS))
    test_keys, train_keys = keys[:LOOKUP_TEST_KEYS], keys[LOOKUP_TEST_KEYS:]
    train = [_lookup_problem(rng, rng.choice(train_keys)) for _ in range(n_train)]
    test = [_lookup_problem(rng, rng.choice(test_keys)) for _ in range(n_test)]
    return train, test


SPLITTERS = {"copy": _copy_splits, "lookup": _lookup_splits}


def make_splits(task: str, n_train: int, n_test: int, seed: int) -> dict[str, list[Problem]]:
    """The problems of each split, a function of (task, seed) only."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    rng = random.Random(f"minirl-{task}-{seed}")  # str seeds hash deterministically (sha512)
    make = TASKS[task][2]
    if make is None:
        train, test = SPLITTERS[task](rng, n_train, n_test)
    else:
        problems = _distinct(make, rng, n_train + n_test, task)
        train, test = problems[:n_train], problems[n_train:]
    return {"train": train, "test": test}


def to_rows(task: str, problems: list[Problem], split: str) -> list[dict]:
    data_source, ability, _ = TASKS[task]
    return [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": p.prompt}],
            "ability": ability,
            "reward_model": {"style": "rule", "ground_truth": p.ground_truth},
            "extra_info": {"split": split, "index": i, **p.extra},
            **({"agent_name": p.agent_name} if p.agent_name else {}),
        }
        for i, p in enumerate(problems)
    ]


def write_task(task: str, out_dir: str | Path, n_train: int, n_test: int, seed: int) -> dict[str, Path]:
    """Write <out_dir>/<task>/{train,test}.parquet; returns split -> path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {}
    for split, problems in make_splits(task, n_train, n_test, seed).items():
        path = Path(out_dir) / task / f"{split}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(to_rows(task, problems, split)), path)
        paths[split] = path
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data", help="output directory (default: data)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=2000, help="train rows per task")
    parser.add_argument("--test", type=int, default=200, help="test rows per task")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    args = parser.parse_args(argv)
    for task in args.tasks:
        for split, path in write_task(task, args.out, args.train, args.test, args.seed).items():
            print(f"wrote {path} ({args.train if split == 'train' else args.test} rows)")


if __name__ == "__main__":
    main()
