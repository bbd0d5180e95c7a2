"""A background checkpoint write (trainer.async_save) at world size 2 (gloo, CPU, the FSDP2
tiny actor with its AdamW state): every rank copies its own shards (DTensors) to host memory and
writes them on its thread; rank 0 writes the manifest only once every rank has finished, even
when rank 1 is slower; the ranks agree on when a write is done; the host buffers are reused; a
fresh actor loads the checkpoint back to the saved weights exactly, though training changed
them after the save; `python -m minirl export` turns it into those weights on one process. A
prepared writer's buffers are host DTensors of the live ones' mesh and placements, and its first
copy allocates none."""

from __future__ import annotations

import os
import time

import dist_helpers as h
import pytest
import torch

from minirl.checkpoint import staging, store
from minirl.checkpoint import state as ckpt_state
from minirl.checkpoint.writer import CheckpointWriter
from minirl.dist import spmd
from minirl.dist.launchers import spawn
from minirl.models import assembly
from minirl.plugins import PluginManager

pytestmark = pytest.mark.distributed

SLOW_RANK_S = 1.0  # rank 1's write starts this much later


def _actor(pm, cfg, dist):
    actor = assembly.assemble_actor(pm, h.tiny_model(), cfg, dist)
    optimizer, _ = assembly.build_optimizer(pm, actor, cfg.actor.optim, 10)
    actor(torch.arange(1, 9).view(1, 8)).logits.sum().backward()
    optimizer.step()
    return ckpt_state.Checkpointable(actor, optimizer)


def _full(parts) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in parts.model.parameters()]


def _slow_rank_1(rank: int) -> None:
    write = ckpt_state._write_rank_files

    def slow(tmp, snap, group=None):
        time.sleep(SLOW_RANK_S)
        return write(tmp, snap, group)

    if rank == 1:
        ckpt_state._write_rank_files = slow


def _like(staged: torch.Tensor, live: torch.Tensor) -> bool:
    """A host DTensor of the live one's mesh, placements and local shard shape."""
    return (
        hasattr(staged, "to_local")
        and (staged.device_mesh, tuple(staged.placements)) == (live.device_mesh, tuple(live.placements))
        and (staged.shape, staged.to_local().shape) == (live.shape, live.to_local().shape)
        and staged.to_local().device.type == "cpu"
    )


def _prepared(dist, parts) -> dict:
    """prepare() on a second writer (every rank), then a copy into its buffers."""
    writer = CheckpointWriter(dist, True, 120, lambda step, path: None)
    writer.prepare(parts, save_freq=1)
    writer.staging.join()
    live = {}
    staging._map_tensors(parts.state_dicts(), (), lambda t, path: live.setdefault(path, t))
    buffers, allocated = writer.staging.buffers, writer.staging.allocations
    like = buffers.keys() == live.keys() and all(_like(buffers[p], t) for p, t in live.items() if t.dim())
    staged = writer.staging.stage(parts.state_dicts())
    copied = all(torch.equal(staged["model"][k].to_local(), v.to_local()) for k, v in parts.model.state_dict().items())
    writer.close()
    return {"prepared_like_live": like, "prepared_copied": copied and writer.staging.allocations == allocated}


def _worker(rank: int, out_path: str, run_dir: str) -> None:
    cfg = h.config("trainer.world_size=2", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2")
    dist = spmd.init_from_env(cfg)
    pm = PluginManager(entry_points=False)
    parts, saved = _actor(pm, cfg, dist), []
    results = _prepared(dist, parts)
    writer = CheckpointWriter(dist, True, 120, lambda step, path: saved.append(step))
    _slow_rank_1(rank)
    before = _full(parts)
    if rank == 0:  # what `python -m minirl export` of ckpt_1 must write (test below)
        names = [assembly.hf_name(n) for n, _ in parts.model.named_parameters()]
        torch.save(dict(zip(names, before)), os.path.join(run_dir, "ckpt_1_weights.pt"))
    state = {"step": 1, "data": {}, "schedulers": {}, "kl_coef": None, "seed": 1, "world_size": 2}
    path = writer.save(run_dir, 1, parts, state, "", 0)
    results["no_checkpoint_yet"] = not os.path.exists(path)  # rank 1 is still asleep
    results["staged_dtensors"] = all(hasattr(t, "to_local") for t in writer.staging.buffers.values() if t.dim())
    with torch.no_grad():  # the next step trains meanwhile
        for p in parts.model.parameters():
            p.add_(1.0)
    polls = 0
    while writer.in_flight:  # both ranks poll until they agree that the write is done
        writer.poll()
        polls += 1
        time.sleep(0.05)
    results["polls"], results["saved"] = polls, list(saved)
    allocated = writer.staging.allocations
    state["step"] = 2
    writer.save(run_dir, 2, parts, state, "", 0)
    writer.wait()
    results["reused"] = writer.staging.allocations == allocated
    fresh = _actor(pm, cfg, dist)
    ckpt_state.load(path, fresh, dist)
    results["loaded_the_saved_weights"] = all(torch.equal(a, b) for a, b in zip(_full(fresh), before))
    h.write_results(out_path, rank, results)
    spmd.shutdown()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt_world2") / "results.json"
    run_dir = tmp_path_factory.mktemp("ckpt_world2_run")
    assert spawn.spawn(_worker, 2, (str(out), str(run_dir))) == 0, "a worker failed: see its traceback above"
    return h.read_results(out), run_dir


def test_the_save_returns_before_the_slow_rank_has_written(results):
    """Rank 0's save returns at once (the copy), not after rank 1's write."""
    got, _ = results
    assert got["no_checkpoint_yet"] and got["staged_dtensors"]


def test_the_manifest_is_written_after_every_rank_finished(results):
    """ckpt_1's manifest lists both ranks' shards and random streams and is the newest file of
    the checkpoint: rank 0 waited for the slower rank 1."""
    _, run_dir = results
    ckpt = run_dir / "ckpt_1"
    files = store.verify(str(ckpt))["files"]
    assert {"rng/rank0.pt", "rng/rank1.pt"} <= set(files)
    assert {name.split("_")[2] for name in files if name.endswith(".distcp")} == {"0", "1"}
    manifest_at = (ckpt / store.MANIFEST).stat().st_mtime
    assert all((ckpt / name).stat().st_mtime <= manifest_at for name in files)
    assert store.damaged_files(str(ckpt)) == []


def test_the_ranks_agree_and_the_hook_fires_once_per_save(results):
    """poll() stopped on both ranks after the same number of calls (else one would hang), and
    every save was collected once, in order."""
    got, _ = results
    assert got["polls"] >= 1 and got["saved"] == [1]


def test_buffers_reused_and_the_saved_weights_load_back(results):
    """The second save allocated no host buffer; ckpt_1 holds the weights of its moment."""
    got, run_dir = results
    assert got["reused"] and got["loaded_the_saved_weights"]
    assert store.complete_checkpoints(str(run_dir))[-1][0] == 2


def test_export_gathers_both_ranks_shards(results, tmp_path):
    """`python -m minirl export` of the world-2 checkpoint, on one process: a Hugging Face
    directory holding exactly the weights the two ranks' shards held at the save."""
    from safetensors.torch import load_file

    from minirl.cli import main

    _, run_dir = results
    assert main(["export", "--checkpoint", str(run_dir / "ckpt_1"), "--out", str(tmp_path / "hf")]) == 0
    exported, want = load_file(tmp_path / "hf" / "model.safetensors"), torch.load(run_dir / "ckpt_1_weights.pt")
    assert set(exported) == set(want) and all(torch.equal(exported[k], want[k]) for k in want)


def test_prepared_buffers_are_host_dtensors_of_the_same_placements(results):
    """prepare(): a host DTensor per live DTensor (same mesh, placements, local shape); the
    first copy goes into them without allocating and holds the live values."""
    got, _ = results
    assert got["prepared_like_live"] and got["prepared_copied"]
