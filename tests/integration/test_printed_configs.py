"""`--print-config > job.toml`, then `--config job.toml`: the printed file runs as is, for every
profile of bench.toml.

The README promises it, and it broke once (every LoRA key written at its default was refused as
"set while LoRA is off") while the only test parsed the printed text. Here the CPU profiles run
the printed file for one step (the one override: trainer.total_training_steps = 1), in a
directory laid out as a clone is (data/, examples/), so the file's relative paths are the ones
a user has. The GPU profiles cannot run on CPU: their printed files are loaded and go through
the whole validation pass, files included (model, data, output directory), which is what a GPU
run does before anything loads.
"""

from __future__ import annotations

import json
import os

import pytest

from minirl.cli import build_parser, main, resolve
from minirl.config.load import profiles_in
from minirl.validate.core import validate
from tests.integration.conftest import ROOT, _make_data_module

BENCH = str(ROOT / "bench.toml")
CPU_PROFILES = ("cpu", "cpu-agent")
PROFILES = profiles_in(BENCH)


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A directory laid out as a fresh clone after `make data` (small files)."""
    root = tmp_path_factory.mktemp("clone")
    make_data = _make_data_module()
    for task, rows in (("copy", 64), ("lookup", 64), ("gsm8k", 128)):  # gsm8k: the bench's batch
        make_data.write_task(task, root / "data", rows, 16, 0)
    os.symlink(ROOT / "examples", root / "examples")
    return root


def printed(capsys, profile: str) -> str:
    assert main(["--config", BENCH, "--profile", profile, "--print-config"]) == 0
    return capsys.readouterr().out


def test_every_profile_is_covered():
    """A new profile in bench.toml is either run below or validated: none is forgotten."""
    assert set(CPU_PROFILES) <= set(PROFILES) and len(PROFILES) > len(CPU_PROFILES)


@pytest.mark.parametrize("profile", CPU_PROFILES)
def test_printed_cpu_profile_runs_one_step(capsys, clone, monkeypatch, profile):
    monkeypatch.chdir(clone)
    job = clone / f"{profile}.toml"
    job.write_text(printed(capsys, profile))
    name = f"printed_{profile}"
    code = main(["--config", str(job), "trainer.total_training_steps=1", f"trainer.experiment_name={name}"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "notice" not in err, err  # nothing in the printed file is ignored
    lines = (clone / "runs" / name / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]


@pytest.mark.parametrize("profile", [p for p in PROFILES if p not in CPU_PROFILES])
def test_printed_gpu_profile_loads_and_validates(capsys, clone, monkeypatch, profile):
    monkeypatch.chdir(clone)
    job = clone / f"{profile}.toml"
    job.write_text(printed(capsys, profile))
    pm, cfg = resolve(build_parser().parse_intermixed_args(["--config", str(job)]))
    assert cfg.load_errors == ()
    validate(cfg, pm, files=True)
