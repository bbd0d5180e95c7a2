"""Which launcher a job gets (trainer.launcher = "auto"), and that launchers are components
like any other: registered through `minirl_launchers`, listed by `python -m minirl plugins`,
with the ray launcher's missing dependency named as the extra to install."""

from __future__ import annotations

import sys

import pytest

from minirl.config.load import load_config
from minirl.dist import launchers
from minirl.errors import UserError
from minirl.plugins import PluginManager


def _trainer(*overrides: str):
    return load_config(None, list(overrides)).trainer


@pytest.fixture
def bare_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "overrides, env, expected",
    [
        ([], {}, "local"),
        (["trainer.world_size=2"], {}, "local"),
        ([], {"RANK": "0", "WORLD_SIZE": "2"}, "torchrun"),
        (["trainer.nnodes=2"], {"RANK": "0", "WORLD_SIZE": "16"}, "torchrun"),  # torchrun on each node
        (["trainer.nnodes=2"], {}, "ray"),
        (["trainer.ray_address='10.0.0.1:6379'"], {}, "ray"),
        ([], {"RAY_ADDRESS": "10.0.0.1:6379"}, "ray"),
        (["trainer.launcher='ray'"], {}, "ray"),
        (["trainer.launcher='local'", "trainer.nnodes=2"], {}, "local"),  # validation refuses it
    ],
)
def test_auto_picks_torchrun_then_ray_then_local(bare_env, overrides, env, expected):
    """torchrun's variables win (each of its processes is a rank); then several nodes or a Ray
    address mean Ray; everything else is the local launcher. An explicit choice is kept."""
    for name, value in env.items():
        bare_env.setenv(name, value)
    name, why = launchers.choose(_trainer(*overrides))
    assert name == expected and why


def test_launchers_register_like_any_plugin():
    """local, torchrun and ray come from built-in plugins through the hook, so a third-party
    launcher registers the same way; `python -m minirl plugins` lists them."""
    pm = PluginManager(entry_points=False)
    assert {"local", "torchrun", "ray"} <= set(pm["launchers"].items)
    assert "minirl_plugins.launchers.ray" in pm["launchers"].providers["ray"]
    assert "launchers:" in pm.describe()


def test_without_ray_the_error_names_the_extra(bare_env):
    """Ray is imported only when the ray launcher runs; missing, it is a user error that says
    why Ray was chosen and what to install."""
    pm = PluginManager(entry_points=False)
    cfg = load_config(None, ["trainer.nnodes=2"])
    bare_env.setitem(sys.modules, "ray", None)  # import ray raises ModuleNotFoundError
    with pytest.raises(UserError, match=r"chosen because trainer.nnodes = 2.*pip install 'minirl\[ray\]'"):
        launchers.launch(cfg, pm, lambda cfg, pm, dist: None)


def test_a_ray_address_nobody_answers_on_fails_at_once(bare_env):
    """ray.init retries an unreachable address for minutes; the launcher checks it first."""
    from minirl_plugins.launchers.ray import cluster

    with pytest.raises(UserError, match=r"'127.0.0.1:1': nothing answers there.*ray_cluster.sh head"):
        cluster.connect("127.0.0.1:1")


def test_the_ray_driver_counts_a_repeated_signal_once(monkeypatch):
    """The first SIGTERM/SIGINT to the ray driver is forwarded (every rank checkpoints); the
    same signal delivered twice within a second is still that request; a later one kills."""
    import signal

    from minirl_plugins.launchers.ray import driver

    now = [100.0]
    monkeypatch.setattr(driver.time, "monotonic", lambda: now[0])
    stop = driver._StopSignals()
    stop._handle(signal.SIGTERM, None)
    stop._handle(signal.SIGTERM, None)
    assert (stop.name, stop.kill_now) == ("SIGTERM", False)
    now[0] += 1.5
    stop._handle(signal.SIGINT, None)
    assert stop.kill_now and stop.signum == signal.SIGTERM
