"""Config loading: precedence, strict keys with suggestions, types, profiles, printing."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from minirl.config.load import ConfigError, load_config, parse_overrides, to_toml

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_precedence_defaults_file_profile_command_line(tmp_path):
    """defaults < file < [profiles.X] < command line, key by key."""
    path = write(
        tmp_path,
        """
        [actor]
        ppo_epochs = 2
        clip_ratio = 0.3
        [profiles.small.actor]
        clip_ratio = 0.25
        entropy_coeff = 0.01
    """.replace("        ", ""),
    )
    cfg = load_config(path, ["actor.entropy_coeff=0.05"], profile="small")
    assert cfg.actor.ppo_epochs == 2  # file
    assert cfg.actor.clip_ratio == 0.25  # profile over file
    assert cfg.actor.entropy_coeff == 0.05  # command line over profile
    assert cfg.actor.grad_clip == 1.0  # default
    assert cfg.profile == "small"


def test_unknown_key_names_source_and_suggests_nested(tmp_path):
    """A misplaced key is found in its nested table: actor.lr -> actor.optim.lr."""
    path = write(tmp_path, "[actor]\nlr = 1e-5\n")
    with pytest.raises(ConfigError, match=r"job.toml: unknown key actor.lr; did you mean 'actor.optim.lr'"):
        load_config(path)


def test_unknown_section_suggests(tmp_path):
    with pytest.raises(ConfigError, match=r"command line: unknown section \[rolout\]; did you mean 'rollout'"):
        load_config(None, ["rolout.n=4"])


def test_wrong_type_names_key_value_and_source():
    """Types are strict: a bool is not an int, a string is not a float; ints widen to float."""
    with pytest.raises(ConfigError, match=r"command line: rollout.n must be int, got bool True"):
        load_config(None, ["rollout.n=true"])
    with pytest.raises(ConfigError, match=r"actor.clip_ratio must be float, got str"):
        load_config(None, ["actor.clip_ratio=abc"])
    assert load_config(None, ["actor.clip_ratio=1"]).actor.clip_ratio == 1.0


def test_list_and_optional_fields():
    cfg = load_config(None, ['data.train_files=["a.parquet", "b.parquet"]', "actor.clip_ratio_high=0.28"])
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.actor.clip_ratio_high == 0.28 and cfg.actor.clip_ratio_low is None
    with pytest.raises(ConfigError, match=r"data.train_files\[0\] must be str"):
        load_config(None, ["data.train_files=[1]"])


def test_override_parsing_bare_words_and_malformed():
    assert parse_overrides(["algorithm.adv_estimator=rloo"]) == {"algorithm": {"adv_estimator": "rloo"}}
    assert parse_overrides(["actor.optim.lr=3e-6"]) == {"actor": {"optim": {"lr": 3e-6}}}
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["lr"])


def test_missing_profile_lists_available(tmp_path):
    path = write(tmp_path, "[profiles.cpu.rollout]\nn = 2\n")
    with pytest.raises(ConfigError, match=r"no \[profiles.gpu\] table; available: cpu"):
        load_config(path, profile="gpu")


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[actor\n"))
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "absent.toml"))


def test_sections_are_frozen():
    cfg = load_config(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.actor.ppo_epochs = 3


def test_plugin_sections_are_validated_too():
    """A plugin's own section gets the same strict checking as the core ones."""

    @dataclasses.dataclass(frozen=True)
    class MySection:
        alpha: float = 0.5

    cfg = load_config(None, ["mine.alpha=2"], extra_sections={"mine": MySection})
    assert cfg.mine.alpha == 2.0
    with pytest.raises(ConfigError, match=r"unknown key mine.alpah; did you mean 'mine.alpha'"):
        load_config(None, ["mine.alpah=2"], extra_sections={"mine": MySection})


def test_printed_config_round_trips(tmp_path):
    """--print-config output is valid TOML that loads back to the same config."""
    cfg = load_config(str(ROOT / "bench.toml"), ["actor.clip_ratio_high=0.28"], profile="cpu")
    again = load_config(write(tmp_path, to_toml(cfg)))
    assert again.to_dict() == cfg.to_dict()


def test_cli_print_config_and_error_exit_code():
    """The CLI prints the resolved config, and a bad key is one error line with exit status 2."""
    run = [sys.executable, "-m", "minirl", "--config", str(ROOT / "bench.toml"), "--profile", "cpu"]
    ok = subprocess.run(run + ["--print-config"], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and 'preset = "tiny"' in ok.stdout
    bad = subprocess.run(run + ["actor.ppo_epoch=2", "--print-config"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2
    assert "did you mean 'actor.ppo_epochs'" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["actor.ulysses_sequence_parallel_size=3"], r"actor\.ulysses_sequence_parallel_size = 3 .*world size 4"),
        (["data.train_batch_size=6"], r"data\.train_batch_size = 6 .*over 4 data-parallel ranks"),
        (["actor.ppo_mini_batch_size=2"], r"actor\.ppo_mini_batch_size = 2 .*multiple of 4"),
        (
            ["actor.ulysses_sequence_parallel_size=2", "ref.ulysses_sequence_parallel_size=4"],
            r"ref\.ulysses_sequence_parallel_size = 4 .*use 1 or the actor's 2",
        ),
    ],
)
def test_layout_of_a_world_the_launcher_learns_late(overrides, match):
    """A launcher that learns the number of workers only when it starts (ray on a cluster's GPUs)
    asks the validation pass's layout rules again; each error names the key and the fix. The
    mesh and the data loader only assert the layout (minirl.dist.spmd, minirl.data.prompts)."""
    from minirl.plugins import PluginManager
    from minirl.validate.core import check_world

    pm, fits = PluginManager(), ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]
    check_world(load_config(None, fits), pm, 4)
    with pytest.raises(ConfigError, match=match):
        check_world(load_config(None, [*fits, *overrides]), pm, 4)


@pytest.mark.parametrize("overrides", [[], ["critic.grad_clip=2.0"], ["algorithm.adv_estimator=gae"]])
def test_printed_config_runs_quietly(tmp_path, capsys, overrides):
    """--print-config writes what the run uses: without a critic (grpo) the critic's defaults are
    left out, so the printed file loads back to the same config and running it draws no
    "ignored" notice; a critic key the user did set is kept, and draws the notice it drew before."""
    from minirl import build
    from minirl.cli import main
    from minirl.plugins import PluginManager

    argv = ["--config", str(ROOT / "bench.toml"), "--profile", "cpu", *overrides]
    assert main([*argv, "--print-config"]) == 0
    printed = capsys.readouterr().out
    cfg, again = load_config(argv[1], overrides, "cpu"), load_config(write(tmp_path, printed))
    assert again.to_dict() == cfg.to_dict()
    if cfg.algorithm.adv_estimator == "gae":
        assert "[critic]" in printed and "critic_warmup = 0" in printed
        return
    pm, said = PluginManager(), []
    estimator = pm["advantage_estimators"].get("grpo")
    assert build.critic(pm, again, None, 1, estimator, said.append) is None  # none built: dist unused
    assert len(said) == len(overrides)
    assert all("critic.grad_clip ignored" in line for line in said)


@pytest.mark.parametrize(
    "overrides, cap",
    [
        (["rollout.kv_cache_dtype=fp8"], 2.0),  # an fp8 KV cache turns TIS on
        (["rollout.kv_cache_dtype=fp8_e5m2"], 2.0),
        (["rollout.kv_cache_dtype=fp8", "actor.tis_imp_ratio_cap=-1"], -1.0),  # set: kept, even to off
        (["rollout.kv_cache_dtype=fp8", "actor.tis_imp_ratio_cap=5.0"], 5.0),
        (["rollout.kv_cache_dtype=fp8", "rollout.calculate_log_probs=false"], -1.0),  # no log-probs to weigh by
        ([], -1.0),
        (["rollout.kv_cache_dtype=auto"], -1.0),
        (["rollout.quantization=fp8"], 2.0),  # so do fp8 GEMMs
        (["rollout.quantization=fp8", "rollout.calculate_log_probs=false"], -1.0),
        (["rollout.quantization=none"], -1.0),
    ],
)
def test_an_fp8_kv_cache_turns_truncated_importance_sampling_on(overrides, cap):
    cfg = load_config(None, overrides)
    assert cfg.actor.tis_imp_ratio_cap == cap
    if cap == 2.0:
        key = overrides[0].split("=")[0]
        assert key in cfg.origin("actor.tis_imp_ratio_cap")
