"""`python -m minirl report RUN [RUN ...] [--out DIR]`: PNG figures of runs' curves against step.

One file per topic, one line per run; phase times stack per step, one axes per run. A metric no
run logged leaves its axes saying so, so every figure keeps its layout. matplotlib (the `plot`
extra) is imported only here, through its object-oriented API: no pyplot state, no display.
"""

from __future__ import annotations

import os

from minirl.errors import UserError
from minirl.observe.runs.read import Run

# file name -> (axes title, metric key) per axes
LINE_FIGURES = {
    "score": (("train score (mean)", "score/mean"), ("validation score (greedy)", "val/score/mean")),
    "response_length": (
        ("response length, mean (tokens)", "response_length/mean"),
        ("response length, max (tokens)", "response_length/max"),
        ("clip ratio (hit max_response_length)", "response_length/clip_ratio"),
    ),
    "kl_entropy": (("KL loss", "actor/kl_loss"), ("entropy", "actor/entropy")),
    "grad_lr": (("grad norm (before clipping)", "actor/grad_norm"), ("learning rate", "actor/lr")),
    "throughput": (
        ("gen throughput (response tok/s/GPU)", "perf/gen_throughput_per_gpu"),
        ("prev logprob throughput (tok/s/GPU)", "perf/old_log_prob_throughput_per_gpu"),
        ("step throughput (tok/s, all GPUs)", "perf/throughput"),
    ),
}
# axes on a log scale when their positive values span a factor of LOG_SPAN or more (learning
# rates of 2e-3 and 1e-5 on one linear axis put the smaller one flat on zero)
LOG_SCALE_KEYS = ("actor/lr",)
LOG_SPAN = 10.0
# the step's phases in the order they run (Trainer.train_step); other timing_s/* keys follow
PHASES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights")
AXES_INCHES = (4.2, 3.0)
DPI = 90
MARKERS_BELOW = 30  # points per line under which every point gets a marker, else about MARKS_PER_LINE
MARKS_PER_LINE = 15
# Runs often draw the same values (a validation score two runs share), so each run has its own dash
# and hollow marker: a later line never hides an earlier one.
LINE_STYLES = ("-", "--", ":", "-.")
MARKER_SHAPES = ("o", "s", "^", "v", "D", "x")


def figure_class():
    """matplotlib's Figure, or a UserError naming the extra to install."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise UserError("minirl report needs matplotlib: pip install 'minirl[plot]'") from exc
    return Figure


def build_figures(runs: list[Run]) -> dict:
    """name -> matplotlib Figure, one per LINE_FIGURES entry plus 'phases'."""
    figures = {name: line_figure(runs, panels) for name, panels in LINE_FIGURES.items()}
    figures["phases"] = phases_figure(runs)
    return figures


def write_report(runs: list[Run], out_dir: str) -> list[str]:
    """Writes <out_dir>/<name>.png for every figure; returns the paths."""
    figures = build_figures(runs)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {out_dir}: cannot create it ({exc}); choose a writable directory") from None
    paths = {name: os.path.join(out_dir, f"{name}.png") for name in figures}
    for name, fig in figures.items():
        fig.savefig(paths[name], dpi=DPI)
    return list(paths.values())


def new_figure(n_axes: int):
    width, height = AXES_INCHES
    fig = figure_class()(figsize=(width * n_axes, height), layout="constrained")
    return fig, fig.subplots(1, n_axes, squeeze=False)[0]


def line_figure(runs: list[Run], panels: tuple[tuple[str, str], ...]):
    fig, axes = new_figure(len(panels))
    for ax, (title, key) in zip(axes, panels):
        _style(ax, title)
        drawn = [_plot_run(ax, run, key, i) for i, run in enumerate(runs)]
        if key in LOG_SCALE_KEYS and _spans_decades(runs, key):
            ax.set_yscale("log", nonpositive="mask")  # a warm-up's 0 is left out, not drawn at -inf
        if any(drawn):
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, f"{key}\nnot logged", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    return fig


def _spans_decades(runs: list[Run], key: str) -> bool:
    positive = [v for run in runs for v in run.series(key)[1] if v > 0]
    return bool(positive) and max(positive) >= LOG_SPAN * min(positive)


def _style(ax, title: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers


def _plot_run(ax, run: Run, key: str, index: int) -> bool:
    steps, values = run.series(key)
    if not steps:
        return False
    every = 1 if len(steps) < MARKERS_BELOW else max(1, len(steps) // MARKS_PER_LINE)
    style = dict(linestyle=LINE_STYLES[index % len(LINE_STYLES)], marker=MARKER_SHAPES[index % len(MARKER_SHAPES)])
    ax.plot(steps, values, label=run.name, markevery=every, markersize=4, fillstyle="none", linewidth=1.2, **style)
    return True


def phase_names(runs: list[Run]) -> list[str]:
    """PHASES, then any other timing_s/* key a run logged (a plugin's phase), in a fixed order;
    not the parts of a phase (timing_s/gen.kv_resume: inside gen already)."""
    seen = {k[len("timing_s/") :] for run in runs for r in run.records for k in r if k.startswith("timing_s/")}
    seen = {name for name in seen if "." not in name}
    extra = sorted(seen - set(PHASES) - {"step"})
    return [p for p in PHASES if p in seen] + extra


def phase_stack(run: Run, names: list[str]) -> tuple[list[int], list[list[float]]]:
    """(steps, one series per phase plus 'other': the step's time outside the named phases)."""
    records = [r for r in run.records if r.get("timing_s/step") is not None]
    series = [[float(r.get(f"timing_s/{n}") or 0.0) for r in records] for n in names]
    other = [max(0.0, float(r["timing_s/step"]) - sum(s[i] for s in series)) for i, r in enumerate(records)]
    return [r["step"] for r in records], series + [other]


def phases_figure(runs: list[Run]):
    """Seconds per step, stacked by phase; one axes per run, same y scale."""
    names = phase_names(runs)
    fig, axes = new_figure(len(runs))
    for ax in axes[1:]:
        ax.sharey(axes[0])
    colors = [f"C{i}" for i in range(len(names) + 1)]
    for ax, run in zip(axes, runs):
        _style(ax, f"{run.name}: phase time per step (s)")
        steps, stack = phase_stack(run, names)
        if steps:
            ax.stackplot(steps, *stack, labels=names + ["other"], colors=colors)
        else:
            ax.text(0.5, 0.5, "timing_s/step\nnot logged", ha="center", va="center", transform=ax.transAxes)
    if any(ax.collections for ax in axes):  # one legend beside the axes, not over the stacks
        fig.legend(
            *next(ax for ax in axes if ax.collections).get_legend_handles_labels(),
            loc="outside right upper",
            fontsize=7,
        )
    return fig
