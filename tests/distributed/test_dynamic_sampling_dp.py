"""Dynamic sampling at dp = 2 (gloo) against one process: the ranks draw the same number of
prompt batches, keep the same global set of groups (the first informative ones in prompt
order), and end with equally many groups each, although each rank's own batches hold different
numbers of informative groups (surplus groups move between ranks).

The fake engine and reward are tests/unit/test_dynamic_sampling.py's: responses depend on the
prompt, the sample and the batch number only, so one process and two ranks generate the same.
"""

from __future__ import annotations

import json

import dist_helpers as h
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from minirl.algo.dynamic_sampling import informative_groups
from minirl.config.schema import FilterGroupsConfig
from minirl.data.prompts import PromptLoader
from minirl.dist import spmd
from minirl.dist.context import DistContext
from minirl.dist.launchers import spawn
from minirl.rollout.dynamic_sampling import fill_batch
from tests.unit.test_dynamic_sampling import N, fake_engine, records

pytestmark = pytest.mark.distributed

CPU = torch.device("cpu")
TARGET, STEPS = 8, 4
VOLATILE = {"filter_groups/groups_moved"}


def third_solved(rec, i: int) -> float:
    """Prompts 0, 3, 6, ...: every sample correct; the others alternate (informative)."""
    return 1.0 if rec.index % 3 == 0 else float((i + rec.index) % 2)


def _steps(dist: DistContext, cap: int) -> list[dict]:
    """STEPS steps of fill_batch; per step this rank's groups, as (prompt, batch number), and metrics."""
    loader = PromptLoader(records(64), TARGET, shuffle=True, seed=3).shard(dist.dp_rank, dist.dp_size)
    cfg = FilterGroupsConfig(enable=True, metric="score", max_num_gen_batches=cap)
    engine = fake_engine(third_solved, dist.dp_rank, dist.dp_size)
    out = []
    for _ in range(STEPS):
        batch, metrics = fill_batch(engine, loader.next_batch(), loader, cfg, TARGET, N, dist)
        groups = [(rec.index, batch.responses[g * N][1]) for g, rec in enumerate(batch.records[::N])]
        out.append(
            {
                "groups": groups,
                "informative": informative_groups(batch, "score", N).tolist(),
                "uids": batch.group_B.tolist(),
                "metrics": metrics,
                "drawn": loader.drawn,
            }
        )
    return out


def _worker(rank: int, out_path: str) -> None:
    dist = spmd.init_from_env(h.config("trainer.world_size=2", "data.train_batch_size=8"))
    results = {}
    for cap in (0, 1):
        per_rank = dist.all_gather_objects(_steps(dist, cap))
        results[f"cap{cap}"] = {"ranks": per_rank, "one": _steps(DistContext(device=CPU), cap)}
    h.write_results(out_path, rank, results)
    spmd.shutdown()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dynamic_sampling") / "results.json"
    assert spawn.spawn(_worker, 2, (str(out),)) == 0, "a worker failed: see its traceback above"
    return h.read_results(out)


def test_dp2_keeps_the_same_groups_as_one_process(results):
    """No cap: the same global set of groups, the same number of batches drawn, the same
    metrics; every rank holds TARGET / 2 groups, all informative, with unique uids."""
    ranks, one = results["cap0"]["ranks"], results["cap0"]["one"]
    for step in range(STEPS):
        got = sorted(tuple(g) for r in ranks for g in r[step]["groups"])
        assert got == sorted(tuple(g) for g in one[step]["groups"]), step
        assert [len(r[step]["groups"]) for r in ranks] == [TARGET // 2] * 2
        assert all(all(r[step]["informative"]) for r in ranks)
        uids = [u for r in ranks for u in r[step]["uids"]]
        assert len(set(uids)) == TARGET
        assert ranks[0][step]["drawn"] == ranks[1][step]["drawn"] == one[step]["drawn"]
        stable = {k: v for k, v in one[step]["metrics"].items() if k not in VOLATILE}
        assert {k: v for k, v in ranks[0][step]["metrics"].items() if k not in VOLATILE} == stable
    assert one[-1]["drawn"] > STEPS, "the test data should need refills"
    assert any(ranks[0][s]["metrics"]["filter_groups/groups_moved"] > 0 for s in range(STEPS)), (
        "the test data should leave the ranks unbalanced before the hand-over"
    )


def test_dp2_short_steps_stay_balanced(results):
    """Cap 1: each step keeps the informative groups of its one batch (as one process does),
    plus an uninformative one when their number is odd, so the ranks hold equally many."""
    ranks, one = results["cap1"]["ranks"], results["cap1"]["one"]
    for step in range(STEPS):
        counts = [len(r[step]["groups"]) for r in ranks]
        assert counts[0] == counts[1] >= 1
        kept = [(tuple(g), f) for r in ranks for g, f in zip(r[step]["groups"], r[step]["informative"])]
        assert sorted(g for g, f in kept if f) == sorted(tuple(g) for g in one[step]["groups"])
        assert sum(1 for _, f in kept if not f) == ranks[0][step]["metrics"]["filter_groups/groups_padded"] <= 1
        assert ranks[0][step]["metrics"]["filter_groups/cap_hit"] == 1.0


def test_cli_world_2_trains_short_balanced_steps(tmp_path, data_dir):
    """The real loop over 2 ranks (FSDP2, gloo) with the cap at one batch: steps keep the
    informative groups of their batch, padded to an even count, and train (a step of 2 or 6
    groups has a mini-batch of fewer than actor.ppo_mini_batch_size = 4 groups; measured: steps of
    4, 4 and 2 groups)."""
    table = pq.read_table(data_dir / "copy" / "train.parquet")
    column = table.column_names.index("data_source")
    pq.write_table(
        table.set_column(column, "data_source", pa.array(["half_solved"] * table.num_rows)), tmp_path / "t.parquet"
    )
    proc = h.run_cli(
        tmp_path,
        data_dir,
        f'data.train_files=["{tmp_path / "t.parquet"}"]',
        'plugins.modules=["ds_half_solved"]',
        "trainer.total_training_steps=3",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=4",
        "rollout.n=4",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_num_gen_batches=1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "bench" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    print("groups kept per step:", [r["filter_groups/groups_kept"] for r in rows])
    for r in rows:
        kept, informative = r["filter_groups/groups_kept"], r["filter_groups/groups_informative"]
        assert kept % 2 == 0 and kept - r["filter_groups/groups_padded"] == min(informative, 8)
        assert r["filter_groups/num_gen_batches"] == 1.0 and r["actor/grad_norm"] > 0
