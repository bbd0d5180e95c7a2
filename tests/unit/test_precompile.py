"""Compiling ahead (model.precompile, minirl/precompile.py): the twin's config and passes, and the
hand-over between the trainer and the twin, with the twin's side run by the real `serve` in a
thread (tests/integration/test_precompile.py runs the real twin and checks its graphs)."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from minirl import precompile
from minirl.config.load import load_config
from minirl.dist.context import DistContext
from minirl.precompile import NO_GRAD, UPDATE, Precompile

CPU = DistContext(device=torch.device("cpu"))


def _cfg(*overrides: str):
    return load_config(None, ["trainer.device='cpu'", *overrides])


# ---------------------------------------------------------------------------------------------
# the twin's config
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset, asked, twin",
    [
        ("qwen2-1.5b", 7, 2),  # layers 0 and 1 recompute, layer 2 keeps: 0-6 and 7-27 of the real model
        ("qwen2-1.5b", 1, 1),
        ("qwen2-1.5b", 0, 0),
        ("qwen2-1.5b", -1, -1),
        ("qwen2-1.5b", 28, -1),
        ("qwen2-1.5b", 30, -1),
        ("tiny", 1, 1),  # two layers: the twin has them both
        ("tiny", 2, -1),
    ],
)
def test_the_twin_recomputes_the_variants_the_model_does(preset, asked, twin):
    """recompute_num_layers mapped onto the twin's three layers: recomputed and kept layers where
    the real model has both (layer 0 among the recomputed when any are), all or none as asked."""
    cfg = _cfg(
        f"model.preset='{preset}'", "model.enable_gradient_checkpointing=true", f"model.recompute_num_layers={asked}"
    )
    assert precompile.twin_config(cfg).model.recompute_num_layers == twin


def test_the_twin_model_is_cut_to_three_layers_and_a_small_vocabulary():
    config = precompile.twin_model_config(_cfg("model.preset='qwen2-1.5b'").model)
    assert config.num_hidden_layers == precompile.TWIN_LAYERS == len(config.layer_types)
    assert config.vocab_size == precompile.TWIN_VOCAB
    assert config.hidden_size == 1536 and config.intermediate_size == 8960  # what the layer graphs depend on
    tiny = precompile.twin_model_config(_cfg("model.preset='tiny'").model)
    assert tiny.num_hidden_layers == 2 and tiny.vocab_size == 259  # never more than the model has


def test_an_adapter_to_continue_from_becomes_fresh_adapters_of_its_shape(tmp_path):
    """Its weights fit only the full depth; the twin needs its rank, alpha and targets."""
    from peft import LoraConfig

    LoraConfig(r=6, lora_alpha=12, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM").save_pretrained(tmp_path)
    model = precompile.twin_config(_cfg(f"model.lora_adapter_path='{tmp_path}'")).model
    assert (model.lora_adapter_path, model.lora_rank, model.lora_alpha) == ("", 6, 12)
    assert model.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    "overrides, passes",
    [
        (["actor.use_kl_loss=false", "actor.ppo_mini_batch_size=8", "data.train_batch_size=8"], (UPDATE,)),
        (["actor.use_kl_loss=true", "actor.ppo_mini_batch_size=8", "data.train_batch_size=8"], (NO_GRAD, UPDATE)),
        (["actor.use_kl_loss=false", "actor.ppo_mini_batch_size=4", "data.train_batch_size=8"], (NO_GRAD, UPDATE)),
    ],
    ids=["on-policy", "reference", "prev-log-probs"],
)
def test_the_twin_runs_the_passes_the_trainer_will_in_its_order(overrides, passes):
    assert precompile.twin_passes(_cfg(*overrides)) == passes


def test_no_twin_without_compiled_layers_on_several_processes_or_without_caches(monkeypatch):
    on = _cfg("model.compile_layers=true")
    assert "nothing to overlap" in precompile.reason_off(on, CPU)  # the CPU generates on the host
    monkeypatch.setattr(precompile, "OVERLAPPING_DEVICES", ("cuda", "cpu"))
    assert precompile.reason_off(on, CPU) == ""
    assert precompile.reason_off(_cfg(), CPU) == "off"
    assert precompile.reason_off(_cfg("model.compile_layers=true", "model.precompile=false"), CPU) == "off"
    assert "several processes" in precompile.reason_off(on, DistContext(device=torch.device("cpu"), world_size=2))
    from torch._inductor import config as inductor_config

    with inductor_config.patch(fx_graph_cache=False):  # (monkeypatch would delete the key on undo)
        assert "caches are off" in precompile.reason_off(on, CPU)
        handle = precompile.start(on, CPU)
    assert handle.process is None  # and the trainer's calls do nothing
    handle.go()
    handle.wait()
    handle.close()
    assert handle.metrics() == {} and handle.describe() == ""


def test_the_twin_runs_micro_batches_of_the_trainers_size():
    """Its graphs keep the sizes they first ran at as their kernels' size hints."""
    cfg = _cfg(
        "actor.use_dynamic_bsz=true",
        "actor.ppo_max_token_len_per_gpu=30000",
        "rollout.log_prob_use_dynamic_bsz=false",
        "rollout.log_prob_micro_batch_size_per_gpu=4",
        "ref.log_prob_use_dynamic_bsz=true",
        "ref.log_prob_max_token_len_per_gpu=20000",
        "data.max_prompt_length=100",
        "data.max_response_length=1000",
        "actor.ppo_mini_batch_size=4",
        "data.train_batch_size=8",
    )
    assert precompile.twin_tokens(cfg, UPDATE) == 30000
    assert precompile.twin_tokens(cfg, NO_GRAD) == 4 * 1100  # the prev-log-prob pass comes first
    on_policy = _cfg("actor.ppo_mini_batch_size=8", "data.train_batch_size=8", "ref.log_prob_use_dynamic_bsz=true")
    assert precompile.twin_tokens(on_policy, NO_GRAD) == on_policy.ref.log_prob_max_token_len_per_gpu  # the reference's
    for tokens in (8, 9, 4400, 30000):
        prompts, responses = precompile._batch(tokens)
        assert len(prompts) == 2 and sum(map(len, prompts + responses)) == tokens and min(map(len, prompts)) >= 1


# ---------------------------------------------------------------------------------------------
# the hand-over
# ---------------------------------------------------------------------------------------------


class ScriptedTwin:
    """The twin's side through precompile.serve in a thread: each pass "compiles" until the test
    releases it (or fails on request); `ran` lists the passes it began."""

    def __init__(self, passes=(NO_GRAD, UPDATE), fail_in: str = "", die_in: str = "", wait_s: float = 30.0):
        self.passes, self.fail_in, self.die_in = passes, fail_in, die_in
        self.release = {kind: threading.Event() for kind in passes}
        self.ran: list[str] = []
        ours, theirs = multiprocessing.Pipe()
        self.thread = threading.Thread(target=self._main, args=(theirs,), daemon=True)
        self.handle = Precompile(self, ours, passes, log="twin.log", wait_s=wait_s)
        self.exitcode, self.pid, self.killed = None, 0, False
        self.thread.start()

    def _main(self, conn) -> None:
        if self.die_in:  # a process that died: the pipe closes, not a word said
            conn.recv()
            self.ran.append(self.die_in)
            conn.close()
            self.exitcode = 1
            return
        try:
            precompile.serve(conn, self._run)
            self.exitcode = 0
        except Exception:
            self.exitcode = 1

    def _run(self, report) -> None:
        for kind in self.passes:
            self.ran.append(kind)
            self.release[kind].wait(timeout=30)
            if kind == self.fail_in or self.killed:
                raise RuntimeError(f"inductor blew up in the {kind}")
            report(kind)

    def update_never_ran(self) -> bool:
        return UPDATE not in self.ran

    # the multiprocessing.Process interface Precompile uses
    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout=None) -> None:
        self.thread.join(timeout)

    def terminate(self) -> None:
        self.killed = True
        for event in self.release.values():
            event.set()

    kill = terminate


def _released_later(twin: ScriptedTwin, kind: str, after_s: float = 0.2) -> None:
    threading.Timer(after_s, twin.release[kind].set).start()


def test_the_trainer_waits_until_the_twin_compiled_every_pass():
    """With model.precompile_wait_s long enough, the trainer that reaches its first compiled pass
    while the twin still compiles waits for all of the twin's passes (their graphs and its
    device memory are then done with), once."""
    twin = ScriptedTwin(wait_s=30.0)
    twin.handle.go()
    _wait_until(lambda: twin.ran == [NO_GRAD])
    _released_later(twin, NO_GRAD, 0.2)
    _released_later(twin, UPDATE, 0.4)
    assert twin.handle.metrics() == {}  # not before the twin is done with
    twin.handle.wait()
    assert twin.handle.finished == [NO_GRAD, UPDATE] and twin.handle.waited_s > 0.3
    assert twin.exitcode == 0 and not twin.killed  # it left by itself
    twin.handle.wait()  # later passes: nothing to wait for
    metrics = twin.handle.metrics()
    assert metrics["compile/precompile_passes"] == 2 and metrics["compile/precompile_unfinished"] == 0
    assert twin.handle.metrics() == {}  # once


@pytest.mark.parametrize("done, wait_s", [((), 0.0), ((NO_GRAD,), 0.0), ((NO_GRAD,), 0.3)])
def test_a_twin_not_done_when_the_trainer_needs_it_is_stopped_quietly(capsys, done, wait_s):
    """By default (model.precompile_wait_s = 0) the trainer does not wait: a twin still compiling
    is stopped, what it finished is used, and the rest compiles in the trainer (a graph the twin
    has not finished costs its whole compile either way). Not a failure: no notice; the metrics
    say how far it got. A wait_s waits that long first."""
    twin = ScriptedTwin(wait_s=wait_s)
    twin.handle.go()
    for kind in done:
        twin.release[kind].set()
    _wait_until(lambda: len(twin.ran) == len(done) + 1)  # in the middle of its next pass
    twin.handle.wait()
    assert twin.killed and not twin.handle.failed and capsys.readouterr().err == ""
    assert twin.handle.finished == list(done) and wait_s <= twin.handle.waited_s < wait_s + 0.2
    metrics = twin.handle.metrics()
    assert metrics["compile/precompile_passes"] == len(done) and metrics["compile/precompile_unfinished"] == 2 - len(
        done
    )


def test_a_twin_that_is_done_costs_no_wait():
    twin = ScriptedTwin()
    twin.handle.go()
    for event in twin.release.values():
        event.set()
    _wait_until(lambda: twin.exitcode == 0)
    twin.handle.wait()
    assert twin.handle.finished == [NO_GRAD, UPDATE] and twin.handle.waited_s < 0.05


def test_a_failing_twin_costs_one_notice_and_no_further_wait(capsys):
    twin = ScriptedTwin(fail_in=NO_GRAD)
    twin.handle.go()
    _released_later(twin, NO_GRAD)
    twin.handle.wait()
    note = capsys.readouterr().err
    assert "failed: RuntimeError: inductor blew up in the gradient-free passes" in note and "twin.log" in note
    twin.handle.wait()  # nothing more to wait for, nothing more said
    assert capsys.readouterr().err == "" and twin.update_never_ran()
    assert twin.handle.failed and twin.handle.metrics()["compile/precompile_passes"] == 0


def test_a_twin_that_dies_without_a_word_is_noticed(capsys):
    twin = ScriptedTwin(die_in=NO_GRAD)
    twin.handle.go()
    twin.handle.wait()
    assert twin.handle.failed and "before it finished" in capsys.readouterr().err


def _wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        deadline.wait(0.01)
    raise AssertionError("the scripted twin never got there")


def test_step_ones_compile_note_says_how_far_a_stopped_twin_got():
    from minirl.trainer import _compile_note

    metrics = {"compile/seconds": 20.0, "timing_s/step": 50.0, "compile/graphs": 14, "compile/cache_hits": 6}
    stopped = {"compile/precompile_wait_s": 0.0, "compile/precompile_passes": 1.0, "compile/precompile_unfinished": 1.0}
    note = _compile_note({**metrics, **stopped}, 1)
    assert "14 graphs, 6 found compiled" in note and "had compiled 1 of 2 passes" in note and "waited" not in note
    waited = {"compile/precompile_wait_s": 31.5, "compile/precompile_passes": 2.0, "compile/precompile_unfinished": 0.0}
    note = _compile_note({**metrics, **waited}, 1)
    assert "31.5 s waited for the second process" in note and "had compiled" not in note


def test_a_twin_nobody_waits_for_yields_the_cpu_to_the_trainer():
    """Not waited for (the default), the twin's compile only fills idle cores, never the decode
    loop's; waited for, it runs at the trainer's priority (a starved twin would be the trainer's wait)."""
    assert precompile.twin_niceness(_cfg().model) == precompile.TWIN_NICENESS > 0
    assert precompile.twin_niceness(_cfg("model.precompile_wait_s=60").model) == 0
