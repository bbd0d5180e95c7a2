"""Tests of the reward API: custom_reward_function files, batch functions, the reward worker pool
(timeouts and crashes) and DAPO's overlong penalty (minirl.reward)."""

from __future__ import annotations

import logging
import textwrap
import time
from contextlib import closing
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.data.prompts import PromptRecord
from minirl.dist.context import DistContext
from minirl.errors import UserError
from minirl.reward.custom import CustomRewardError, load_custom_function
from minirl.reward.manager import build_reward_manager
from minirl.reward.metrics import reward_metrics
from minirl.reward.overlong import overlong_penalty

REWARD_FILE = """
import os
import time
from contextlib import closing

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        time.sleep(120)
    if solution_str == "abort":
        os.abort()
    if solution_str == "raise":
        raise RuntimeError("broken grader")
    if solution_str == "no score":
        return {"acc": 0.0}
    return {"score": float(solution_str == ground_truth) + extra_info["bonus"], "acc": 1.0, "note": "text"}

def batch_score(data_sources, solution_strs, ground_truths, extra_infos):
    if "abort" in solution_strs:
        os.abort()
    return [float(s == g) + e["bonus"] for s, g, e in zip(solution_strs, ground_truths, extra_infos)]

def short_batch(data_sources, solution_strs, ground_truths, extra_infos):
    return [1.0] * (len(solution_strs) - 1)

def _square(x, out):
    out.put(x * x)

def with_a_child(data_source, solution_str, ground_truth, extra_info=None):
    import multiprocessing  # a grader that runs its check in a process of its own

    ctx = multiprocessing.get_context("fork")  # the function lives in a file-loaded module
    out = ctx.Queue()
    child = ctx.Process(target=_square, args=(int(solution_str), out))
    child.start()
    value = out.get(timeout=20)
    child.join()
    return float(value)

def swallow(data_source, solution_str, ground_truth, extra_info=None):
    try:
        time.sleep(120)
    except Exception:  # a grader that catches everything it knows of
        return 1.0
    return 2.0
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return str(path)


def rec(source, truth, row=0, bonus=0.0):
    return PromptRecord([1], source, truth, {"bonus": bonus}, f"data.parquet:{row}", row)


def manager(path, name="compute_score", batch=False, num_workers=0, timeout_s=60.0):
    reward = SimpleNamespace(reward_manager="batch" if batch else "naive", num_workers=num_workers, timeout_s=timeout_s)
    custom = SimpleNamespace(path=path, name=name)
    return build_reward_manager(reward, custom, registry={})


# ---------------------------------------------------------------------------------------------
# custom_reward_function
# ---------------------------------------------------------------------------------------------


def test_custom_function_scores_every_data_source_with_verl_keywords(reward_file):
    """The custom function scores any data_source (none is registered here), gets the row's
    extra_info, and a dict answer's numeric extra keys are kept for the metrics."""
    records = [rec("anything", "7", 0, bonus=0.5), rec("other", "7", 1), rec("x", "1", 2)]
    result = manager(reward_file).score(records + [rec("x", "1", 3)], ["7", "8", "raise", "no score"])
    assert result.scores == [1.5, 0.0, 0.0, 0.0]
    assert result.failures["error"] == {"x": 2}
    assert result.extras == {"acc": [1.0, 1.0]}
    metrics = reward_metrics(result, None, DistContext(device=torch.device("cpu")))
    assert metrics == {
        "reward/errors": 2.0,
        "reward/timeouts": 0.0,
        "reward/crashes": 0.0,
        "reward/extra/acc/mean": 1.0,
    }


def test_batch_function_gets_lists_and_scores_in_order(reward_file):
    records = [rec("a", "1", bonus=0.25), rec("b", "2"), rec("c", "3")]
    result = manager(reward_file, "batch_score", batch=True).score(records, ["1", "x", "3"])
    assert result.scores == [1.25, 0.0, 1.0]


def test_batch_function_of_the_wrong_length_is_a_user_error_naming_it(reward_file):
    with pytest.raises(UserError, match=r"short_batch of .*my_reward.py returned 1 scores for 2 responses"):
        manager(reward_file, "short_batch", batch=True).score([rec("a", "1"), rec("b", "2")], ["1", "2"])


BAD_FILES = {
    "syntax": ("x = 1\ndef compute_score(:\n", "custom_reward_function.path", "my_reward.py:2", "SyntaxError"),
    "import": ("import os\nimport not_a_package_xyz\n", "my_reward.py:2", "not_a_package_xyz", "install"),
    "raises": ("\n\nraise RuntimeError('no key')\n", "my_reward.py:3", "RuntimeError: no key"),
    "missing": ("def compute_scores(): pass\n", "custom_reward_function.name", "did you mean 'compute_scores'"),
    "not_callable": ("compute_score = 3\n", "'compute_score' is a int, not a function"),
    "signature": ("def compute_score(src, text, gt):\n    return 0\n", "cannot be called with the keywords"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_custom_files_are_one_clear_line(tmp_path, case):
    body, *needles = BAD_FILES[case]
    (tmp_path / "my_reward.py").write_text(body)
    with pytest.raises(CustomRewardError) as err:
        load_custom_function(str(tmp_path / "my_reward.py"), "compute_score")
    msg = str(err.value)
    assert len(msg.splitlines()) == 1, msg
    for needle in needles:
        assert needle in msg, msg


def test_missing_custom_file(tmp_path):
    with pytest.raises(CustomRewardError, match="no such file"):
        load_custom_function(str(tmp_path / "nope.py"), "compute_score")


# ---------------------------------------------------------------------------------------------
# the reward worker pool
# ---------------------------------------------------------------------------------------------


def test_pool_survives_a_hang_and_a_crash_and_keeps_order(reward_file, caplog):
    """A call past timeout_s and a worker killed by os.abort() score 0 and are counted per kind and
    data_source; the other responses score correctly, in order; the pool keeps working after."""
    records = [
        rec("ok", "1", 0, bonus=0.5),
        rec("slow", "x", 1),
        rec("ok", "2", 2),
        rec("fatal", "x", 3),
        rec("ok", "3", 4),
        rec("ok", "4", 5, bonus=2.0),
    ]
    texts = ["1", "hang", "2", "abort", "9", "4"]
    with closing(manager(reward_file, num_workers=2, timeout_s=1.0)) as rewards:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="minirl.reward"):
            result = rewards.score(records, texts)
        assert time.monotonic() - start < 30  # the hung call (120 s) did not stall the step
        assert result.scores == [1.5, 0.0, 1.0, 0.0, 0.0, 3.0]
        assert result.failures == {"error": {}, "timeout": {"slow": 1}, "crash": {"fatal": 1}}
        assert "'slow' timed out" in caplog.text and "'fatal' crashed its worker" in caplog.text
        assert "SIGABRT" in caplog.text
        again = rewards.score(records[:1] + records[3:5], ["1", "abort", "3"])  # a crash again, then more
        assert again.scores == [1.5, 0.0, 1.0] and again.failures["crash"] == {"fatal": 1}
        assert caplog.text.count("crashed its worker") == 1  # logged once per data_source
        workers = [w.process for w in rewards.pool.workers]
    assert not any(p.is_alive() for p in workers)  # closed on leaving the block


@pytest.mark.parametrize("name", ["compute_score", "swallow"])
def test_timeout_s_applies_in_the_training_process_too(reward_file, name):
    """reward.num_workers = 0: a call past reward.timeout_s is abandoned (scores 0, counted as a
    timeout) instead of hanging the run, even when the function catches Exception; the next
    calls score normally and no timer is left armed."""
    import signal

    rewards = manager(reward_file, name, num_workers=0, timeout_s=0.5)
    start = time.monotonic()
    result = rewards.score([rec("slow", "x", 0)], ["hang"])
    assert time.monotonic() - start < 5
    assert result.scores == [0.0] and result.failures["timeout"] == {"slow": 1}
    if name == "compute_score":
        assert rewards.score([rec("ok", "1", 1)], ["1"]).scores == [1.0]
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_timeout_s_off_the_main_thread_abandons_the_call(reward_file):
    """Signals reach only the main thread: elsewhere the call is left on a thread of its own."""
    import threading

    rewards, box = manager(reward_file, num_workers=0, timeout_s=0.5), {}
    thread = threading.Thread(target=lambda: box.update(r=rewards.score([rec("slow", "x", 0)], ["hang"])))
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and box["r"].failures["timeout"] == {"slow": 1}


def test_a_reward_function_may_start_its_own_processes(reward_file):
    """Reward workers are not daemonic, so a grader can run a process of its own (a daemonic
    worker's child raises 'daemonic processes are not allowed to have children')."""
    with closing(manager(reward_file, "with_a_child", num_workers=1, timeout_s=30)) as rewards:
        result = rewards.score([rec("ok", "", 0), rec("ok", "", 1)], ["3", "4"])
        assert result.scores == [9.0, 16.0] and result.count("error") == 0
        workers = [w.process for w in rewards.pool.workers]
    assert not any(p.is_alive() for p in workers)


def test_pool_runs_batch_functions_in_chunks(reward_file):
    """A batch manager with workers splits the responses over them; a chunk whose worker dies
    scores 0 for its rows only."""
    records = [rec("s", str(i)) for i in range(6)]
    texts = ["0", "1", "x", "abort", "4", "5"]
    with closing(manager(reward_file, "batch_score", batch=True, num_workers=2, timeout_s=30)) as rewards:
        result = rewards.score(records, texts)
    assert result.scores == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert result.failures["crash"] == {"s": 3}


def test_pool_with_the_plugin_registry():
    """Without a custom file the workers rebuild the registry from the plugin modules."""
    reward = SimpleNamespace(reward_manager="naive", num_workers=1, timeout_s=30.0)
    custom = SimpleNamespace(path="", name="compute_score")
    from minirl.plugins import PluginManager

    registry = PluginManager(entry_points=False)["reward_functions"]
    with closing(build_reward_manager(reward, custom, registry)) as rewards:
        result = rewards.score([rec("copy", "7"), rec("gsm8k", "4")], ["7", "#### 5"])
    assert result.scores == [1.0, 0.0]


def test_worker_that_cannot_load_is_a_user_error(reward_file, tmp_path):
    path = tmp_path / "later.py"
    path.write_text(textwrap.dedent(REWARD_FILE))
    rewards = manager(str(path), num_workers=1)
    path.write_text("import not_a_package_xyz\n")  # broken after the trainer loaded it
    with pytest.raises(UserError, match="could not load the reward functions.*not_a_package_xyz"):
        rewards.score([rec("a", "1")], ["1"])
    assert rewards.pool.workers == []


# ---------------------------------------------------------------------------------------------
# DAPO overlong penalty
# ---------------------------------------------------------------------------------------------


def test_overlong_penalty_golden_values():
    """L_max = 20, len = 4, factor 0.5: expected = 16; by hand, penalty = min(-(|y|-16)/4*0.5, 0):
    |y| = 10 -> 0, 16 -> 0 (at the buffer's start), 17 -> -0.125, 18 -> -0.25, 20 -> -0.5."""
    buf = SimpleNamespace(enable=True, len=4, penalty_factor=0.5)
    got = overlong_penalty([10, 16, 17, 18, 20], 20, buf)
    assert got.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    assert overlong_penalty([0, 20], 20, SimpleNamespace(enable=False, len=4, penalty_factor=0.5)).tolist() == [0, 0]
    full = overlong_penalty([1, 7, 8], 8, SimpleNamespace(enable=True, len=7, penalty_factor=1.0))
    assert torch.allclose(full, torch.tensor([0.0, -6 / 7, -1.0]))


@settings(max_examples=200, deadline=None)
@given(
    max_len=st.integers(2, 4096),
    data=st.data(),
    factor=st.floats(0, 10, allow_nan=False),
)
def test_overlong_penalty_properties(max_len, data, factor):
    """Against the float64 formula: 0 up to L_max - len, linear in between, -factor at L_max, and
    never positive or below -factor for any length in [0, L_max]."""
    buf_len = data.draw(st.integers(1, max_len - 1))
    lengths = data.draw(st.lists(st.integers(0, max_len), min_size=1, max_size=16))
    got = overlong_penalty(lengths, max_len, SimpleNamespace(enable=True, len=buf_len, penalty_factor=factor))
    expected = [min(-(n - (max_len - buf_len)) / buf_len * factor, 0.0) for n in lengths]
    assert torch.allclose(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    assert bool((got <= 0).all()) and bool((got >= -factor * (1 + 1e-6)).all())
    at_max = overlong_penalty([max_len], max_len, SimpleNamespace(enable=True, len=buf_len, penalty_factor=factor))
    assert at_max.item() == pytest.approx(-factor, rel=1e-6)


def test_overlong_metrics():
    result = SimpleNamespace(count=lambda kind: 0, extras={})
    penalty_B = torch.tensor([0.0, -0.5, -0.25, 0.0])
    metrics = reward_metrics(result, penalty_B, DistContext(device=torch.device("cpu")))
    assert metrics["reward/overlong_penalty/mean"] == -0.1875
    assert metrics["reward/overlong_penalty/frac"] == 0.5
