"""`rlora plot RUN_DIR [RUN_DIR ...] [-o OUT]`: PNG figures of metrics.jsonl against the step.

One run: RUN_DIR/plots/<metric>.png for each metric, plus overview.png with all of them in one grid.
Several runs: the same figures with the runs overlaid in each axes (legend: folder names), in -o OUT.
A run of several policies (RUN_DIR/policies/NAME/metrics.jsonl) stands for its policies, overlaid as training
draws them (legend: NAME; RUN/NAME beside other runs).
Drawn with matplotlib's Agg canvas directly (no pyplot): no display, no global figure state.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from rlora.errors import UserError, first_line
from rlora.logging.console import info

METRICS_FILE = "metrics.jsonl"
POLICIES_FOLDER = "policies"  # train/policies.py (not imported: it pulls in torch, and the CLI imports this module)
# metrics.jsonl key -> axes title: what `rlora train` logs, and what `rlora sft` / `rlora rm` log
RL_METRICS = {
    "reward_mean": "reward (mean)",
    "kl": "KL to the reference",
    "entropy": "entropy (nats per token)",
    "completion_len_mean": "completion length (tokens, mean)",
    "clip_frac": "clip fraction",
    "step_s": "step time (s)",
}
SUPERVISED_METRICS = {
    "loss": "loss (training)",
    "eval_loss": "loss (held-out)",
    "accuracy": "pair accuracy (training)",
    "eval_accuracy": "pair accuracy (held-out)",
    "reward_gap": "reward gap, chosen - rejected (training)",
    "step_s": "step time (s)",
}
METRICS = RL_METRICS | SUPERVISED_METRICS


@dataclass
class RunMetrics:
    label: str
    rows: list[dict]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric; steps where it is null (e.g. kl without algo.beta) are left out."""
        points = [(row["step"], float(row[key])) for row in self.rows
                  if isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool)]
        return [step for step, _ in points], [value for _, value in points]


@dataclass
class PlotResult:
    files: list[Path]
    skipped: list[str]  # metrics with no value in any run


def read_metrics(run: str) -> list[dict]:
    """The step rows of RUN/metrics.jsonl; UserError when there are none to plot."""
    folder = Path(run)
    if not folder.is_dir():
        raise UserError(f"run folder not found: {run}")
    path = folder / METRICS_FILE
    if not path.is_file():
        raise UserError(f"{path} not found: not the output folder of `rlora train`")
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from None
    rows = [row for row in map(_parse_row, lines) if row is not None]
    if not rows:
        raise UserError(f"{path} holds no complete step line (empty, or cut off before the first step ended)")
    return rows


def _parse_row(line: str) -> dict | None:
    """A metrics row; None for a blank or torn line (a kill in the middle of an append) or one without a step."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def _labels(runs: list[str]) -> list[str]:
    """Folder names; the paths as given where two folders share a name (a/run, b/run)."""
    names = [Path(run).resolve().name for run in runs]
    return names if len(set(names)) == len(names) else list(runs)


def _policy_folders(run: str) -> list[Path]:
    """The policies of a run of several (RUN/policies/NAME/metrics.jsonl), in the config's order (the colours
    training gave them), else by name; [] for any other folder. The run's own metrics.jsonl holds only the
    NAME/reward_mean columns of such a run, which no panel names, so its policies' files are what to draw."""
    root = Path(run) / POLICIES_FOLDER
    if not root.is_dir():
        return []
    found = {p.name: p for p in sorted(root.iterdir()) if (p / METRICS_FILE).is_file()}
    order = [name for name in _configured_policies(Path(run)) if name in found]
    return [found[name] for name in order + sorted(set(found) - set(order))]


def _configured_policies(run: Path) -> list[str]:
    """The policy names in RUN/config.yaml's `policies:`; [] when it is missing or unreadable (order only)."""
    try:
        config = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
        return [str(p["name"]) for p in config.get("policies") or []]
    except (OSError, ValueError, yaml.YAMLError, AttributeError, TypeError, KeyError):
        return []


def _expand(runs: list[str]) -> list[tuple[str, str]]:
    """(folder, label) of each series: a run, or each policy of a run of several, labelled NAME as training
    labels them when it is the only run, RUN/NAME beside other runs."""
    series = []
    for run, label in zip(runs, _labels(runs)):
        policies = _policy_folders(run) if Path(run).is_dir() else []
        series += [(str(p), p.name if len(runs) == 1 else f"{label}/{p.name}") for p in policies] or [(run, label)]
    return series


def plot_runs(runs: list[str], output: str | None = None) -> PlotResult:
    """Write one PNG per metric and overview.png; returns the files and the metrics no run has."""
    if not runs:
        raise UserError("give at least one run folder")
    if len(runs) > 1 and output is None:
        raise UserError(f"{len(runs)} runs are overlaid into one set of figures: say where with -o OUT")
    resolved = [Path(run).resolve() for run in runs]
    twice = next((run for run, path in zip(runs, resolved) if resolved.count(path) > 1), None)
    if twice is not None:  # two identical curves under two labels would read as two runs that agree
        raise UserError(f"{twice} is given twice: name each run once")
    loaded = [RunMetrics(label, read_metrics(folder)) for folder, label in _expand(runs)]
    # runs of rlora train log reward_mean every step; sft and rm runs their losses (an RL run's loss is not drawn)
    rl = [bool(run.series("reward_mean")[0]) for run in loaded]
    if any(rl) and not all(rl):  # one set of panels would drop the other kind's curves
        raise UserError(f"{loaded[rl.index(True)].label} is a run of rlora train and {loaded[rl.index(False)].label} "
                        "one of rlora sft or rm: overlay runs of one kind")
    wanted = RL_METRICS if any(rl) else SUPERVISED_METRICS
    present = [key for key in wanted if any(run.series(key)[0] for run in loaded)]
    if not present:
        raise UserError(f"no metric to plot ({', '.join(METRICS)}) in {', '.join(runs)}")
    out = _output_folder(Path(output) if output else Path(runs[0]) / "plots")
    files = [_save(_figure([key], loaded), out / f"{key}.png") for key in present]
    files.append(_save(_figure(present, loaded), out / "overview.png"))
    # an RL metric missing is worth a note (e.g. kl without algo.beta); an sft run simply has no pair accuracy
    return PlotResult(files, [key for key in wanted if key not in present] if wanted is RL_METRICS else [])


def _output_folder(folder: Path) -> Path:
    if folder.exists() and not folder.is_dir():
        raise UserError(f"plot output '{folder}' exists and is a file")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create the plot folder '{folder}': {err.strerror or err}") from None
    return folder


def _figure(keys: list[str], runs: list[RunMetrics]):
    """One axes per metric (a grid of up to 3 columns), every run drawn in its own colour in each."""
    # matplotlib (~1 s): only a plot imports it (the command line imports this module at start-up)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    cols = min(len(keys), 3)
    rows = math.ceil(len(keys) / cols)
    fig = Figure(figsize=(4.8 * cols, 3.4 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    for index, key in enumerate(keys):
        ax = fig.add_subplot(rows, cols, index + 1)
        for number, run in enumerate(runs):
            steps, values = run.series(key)
            if steps:  # a fixed colour per run, so a run missing from one axes does not shift the others
                ax.plot(steps, values, color=f"C{number % 10}", label=run.label, marker="." if len(steps) <= 30 else None)
        ax.set_title(METRICS[key])
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        if len(runs) > 1:  # several runs, or the policies of one
            ax.legend(fontsize="small")
    return fig


def _save(fig, path: Path) -> Path:
    """Atomic: a figure is either the old one or the whole new one, never half a PNG."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write {path}: {err.strerror or err}") from None
    return path


def plot_after_run(run_path: Path, runs: list[Path] | None = None) -> None:
    """End of `rlora train` with log.plot: the run is already saved, so a failure here is only a notice.
    runs: folders whose metrics to overlay into run_path/plots (default: the run's own)."""
    try:
        result = plot_runs([str(r) for r in runs or [run_path]], output=str(run_path / "plots"))
    except Exception as err:
        info(f"could not plot the metrics ({first_line(err)}); the run is saved: try `rlora plot {run_path}`")
        return
    info(f"plots: {result.files[0].parent}")
