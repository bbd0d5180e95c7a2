"""`python -m minirl report`: the figures' structure (axes, one line per run) and the PNGs on disk.

matplotlib is imported without a skip: `make test` installs it (the dev extra), so a lost extra
fails here instead of silently untesting the figures.
"""

from __future__ import annotations

import sys

import matplotlib.image
import pytest

from minirl.cli import main
from minirl.errors import UserError
from minirl.observe.runs.read import Run, read_run
from minirl.observe.runs.report import LINE_FIGURES, build_figures, figure_class, phase_names
from tests.unit.test_compare import write_run

AXES = {"score": 2, "response_length": 3, "kl_entropy": 2, "grad_lr": 2, "throughput": 3}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def records(scale: float, steps: int = 4, kl: bool = True) -> list[dict]:
    out = [{"step": 0, "val/score/mean": 0.0}]
    for s in range(1, steps + 1):
        r = {
            "step": s,
            "score/mean": scale * s,
            "response_length/mean": 2.0,
            "response_length/max": 3.0,
            "response_length/clip_ratio": 0.5,
            "actor/entropy": 5.0 - s,
            "actor/grad_norm": 0.1 * s,
            "actor/lr": 1e-3,
            "perf/gen_throughput_per_gpu": 100.0 * s,
            "perf/throughput": 50.0 * s,
            "perf/old_log_prob_throughput_per_gpu": 80.0,
            "timing_s/gen": 1.0,
            "timing_s/old_log_prob": 0.5,
            "timing_s/update_actor": 2.0,
            "timing_s/step": 4.0,
        }
        if kl:
            r["actor/kl_loss"] = 0.01 * s
        out.append(r)
    out[-1]["val/score/mean"] = scale
    return out


def lines_per_axes(fig) -> list[int]:
    return [len(ax.get_lines()) for ax in fig.axes]


def test_one_run_figures_have_the_expected_axes(tmp_path):
    run = read_run(write_run(tmp_path, "a", records(0.1), None))
    figures = build_figures([run])
    assert set(figures) == set(LINE_FIGURES) | {"phases"}
    for name, n_axes in AXES.items():
        assert len(figures[name].axes) == n_axes, name
        assert lines_per_axes(figures[name]) == [1] * n_axes, name
    phases = figures["phases"].axes
    assert len(phases) == 1
    assert len(phases[0].collections) == 4  # gen, old_log_prob, update_actor, other (0.5 s a step)


def test_parts_of_a_phase_are_not_stacked_as_phases(tmp_path):
    """timing_s/gen.kv_resume is inside timing_s/gen (the engine's own account): the phase chart
    keeps its four areas, and a plugin's own phase (timing_s/rerank) still gets one."""
    logged = [dict(r, **{"timing_s/gen.kv_resume": 0.3, "timing_s/rerank": 0.1}) for r in records(0.1)]
    phases = build_figures([read_run(write_run(tmp_path, "a", logged, None))])["phases"].axes[0]
    assert len(phases.collections) == 5  # gen, old_log_prob, update_actor, rerank, other


def test_a_critic_run_stacks_its_phases_in_the_order_the_step_runs_them():
    """values and update_critic (gae) sit where Trainer.train_step runs them, not after the rest."""
    logged = {f"timing_s/{p}": 0.1 for p in ("update_actor", "update_critic", "values", "gen")}
    run = Run("gae", "", [{"step": 1, **logged}])
    assert phase_names([run]) == ["gen", "values", "update_critic", "update_actor"]


def test_three_runs_overlay_with_a_legend_and_missing_metrics_leave_an_empty_axes(tmp_path):
    """Three runs share each axes (three lines, three legend entries); KL logged by one run only is
    one line; phases get an axes per run."""
    paths = [write_run(tmp_path, n, records(s, kl=(n == "a")), None) for n, s in (("a", 0.1), ("b", 0.2), ("c", 0.3))]
    figures = build_figures([read_run(p) for p in paths])
    score = figures["score"]
    assert lines_per_axes(score) == [3, 3]
    assert [t.get_text() for t in score.axes[0].get_legend().get_texts()] == ["a", "b", "c"]
    assert lines_per_axes(figures["kl_entropy"]) == [1, 3]
    assert len(figures["phases"].axes) == 3


def test_runs_with_the_same_values_stay_visible(tmp_path):
    """Two runs that log the same validation scores draw the same points: each run has its own
    dash and hollow marker, so the later line does not hide the earlier one; a long series is
    marked at intervals, not at every point."""
    long = [{"step": s, "score/mean": 0.5} for s in range(1, 101)]
    paths = [write_run(tmp_path, n, records(0.1) + long[5:], None) for n in ("a", "b")]
    lines = build_figures([read_run(p) for p in paths])["score"].axes[0].get_lines()
    assert len({(ln.get_linestyle(), ln.get_marker()) for ln in lines}) == 2
    assert all(ln.get_fillstyle() == "none" for ln in lines)
    assert all(ln.get_markevery() > 1 for ln in lines)


@pytest.mark.parametrize("lrs, scale", [((2e-3, 1e-5, 3e-6), "log"), ((1e-5, 3e-6), "linear")])
def test_learning_rates_of_different_decades_get_a_log_axis(lrs, scale):
    """Runs at 2e-3 and 1e-5 on one linear axis leave the smaller flat on zero: the learning
    rate's axis turns logarithmic once the values span a factor of 10 (a warm-up's 0 is masked)."""
    runs = []
    for i, lr in enumerate(lrs):
        recs = records(1.0)
        for r in recs[1:]:
            r["actor/lr"] = lr
        recs[1]["actor/lr"] = 0.0
        runs.append(Run(f"r{i}", "", recs))
    ax = build_figures(runs)["grad_lr"].axes[1]
    assert ax.get_title() == "learning rate" and ax.get_yscale() == scale


def test_metric_no_run_logged_says_so(tmp_path):
    run = read_run(write_run(tmp_path, "a", records(0.1, kl=False), None))
    kl_axes = build_figures([run])["kl_entropy"].axes[0]
    assert kl_axes.get_lines() == [] and "not logged" in kl_axes.texts[0].get_text()


def test_cli_report_writes_every_png(tmp_path, capsys):
    """Three runs, each cut short mid-line: the command still writes every figure, each a PNG image
    of real size (read back)."""
    paths = [write_run(tmp_path, n, records(0.1), None, tail='{"step": 5, "sc') for n in ("a", "b", "c")]
    assert main(["report", *paths, "--out", str(tmp_path / "fig"), "--steps", "1:"]) == 0
    written = capsys.readouterr().out.split()
    assert sorted(p.rsplit("/", 1)[1] for p in written) == sorted(f"{n}.png" for n in [*AXES, "phases"])
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == PNG_MAGIC
        height, width, _ = matplotlib.image.imread(path).shape
        assert height > 100 and width > 200


def test_missing_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(UserError, match=r"pip install 'minirl\[plot\]'"):
        figure_class()
