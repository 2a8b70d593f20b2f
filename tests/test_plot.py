"""`rlora plot`: PNG figures from metrics.jsonl, overlays of several runs, the automatic plots at the end of
`rlora train`, and bad input as one line with exit code 2."""

import json
from pathlib import Path

import pytest
from matplotlib.image import imread

from conftest import tiny_overrides
from rlora.cli import main
from rlora.plot import RL_METRICS, RunMetrics, _figure, plot_after_run, plot_runs, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(folder: Path, rows: list[dict], tail: str = "") -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return folder


def _rows(n: int, scale: float = 1.0) -> list[dict]:
    """Steps as rlora train logs them; kl is null (no algo.beta) and clip_frac absent, so both are skipped."""
    return [{"step": i, "reward_mean": scale * i / n, "kl": None, "entropy": 2.0 - i / n, "completion_len_mean": 10.0 + i,
             "step_s": 0.5, "reward/count_a": 0.1} for i in range(1, n + 1)]


def _assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    height, width, _channels = imread(path).shape
    assert height > 100 and width > 100, path


def test_one_run_one_png_per_metric_and_an_overview(tmp_path):
    run = _write_run(tmp_path / "run", _rows(5), tail='{"step": 6, "reward_me')  # a kill in the middle of an append
    result = plot_runs([str(run)])
    names = sorted(p.name for p in result.files)
    assert names == ["completion_len_mean.png", "entropy.png", "overview.png", "reward_mean.png", "step_s.png"]
    assert all(p.parent == run / "plots" for p in result.files)
    for path in result.files:
        _assert_png(path)
    assert result.skipped == ["kl", "clip_frac"]
    assert [r["step"] for r in read_metrics(str(run))] == [1, 2, 3, 4, 5]  # the torn line is left out


def test_two_runs_are_overlaid_with_their_folder_names(tmp_path, capsys):
    a = _write_run(tmp_path / "lr-1e-4", _rows(4))
    b = _write_run(tmp_path / "lr-1e-3", _rows(6, scale=2.0) + [{"step": 7, "reward_mean": 1.0, "clip_frac": 0.1}])
    out = tmp_path / "compare"
    assert main(["plot", str(a), str(b), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "no run has values of kl: skipped" in err and "6 figures" in err  # 5 metrics + overview
    for name in [f"{key}.png" for key in RL_METRICS if key != "kl"] + ["overview.png"]:
        _assert_png(out / name)
    # the axes the figures were drawn from: one line per run holding a metric, labelled by folder
    runs = [RunMetrics(p.name, read_metrics(str(p))) for p in (a, b)]
    [reward_ax] = _figure(["reward_mean"], runs).axes
    assert [t.get_text() for t in reward_ax.get_legend().get_texts()] == ["lr-1e-4", "lr-1e-3"]
    assert [len(line.get_xdata()) for line in reward_ax.get_lines()] == [4, 7]
    [clip_ax] = _figure(["clip_frac"], runs).axes
    assert [line.get_label() for line in clip_ax.get_lines()] == ["lr-1e-3"]


def test_train_writes_plots_and_its_metrics_replot(tiny_model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, prompts_file, str(out), **{"eval.before": "false", "eval.after": "false"})
    args.remove("log.plot=false")  # the test overrides turn figures off; here the default (on) is checked
    assert main(["train", *args]) == 0
    assert "plots: " in capsys.readouterr().err
    for key in ("reward_mean", "entropy", "completion_len_mean", "clip_frac", "step_s"):
        _assert_png(out / "plots" / f"{key}.png")
    _assert_png(out / "plots" / "overview.png")
    assert main(["plot", str(out), "-o", str(tmp_path / "again")]) == 0
    assert "no run has values of kl" in capsys.readouterr().err  # algo.beta=0: kl is null in every step
    _assert_png(tmp_path / "again" / "overview.png")


def test_log_plot_false_writes_no_plots(tiny_model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, prompts_file, str(out), **{
        "log.plot": "false", "train.steps": 1, "eval.before": "false", "eval.after": "false"})
    assert main(["train", *args]) == 0
    assert not (out / "plots").exists()


def test_a_plotting_failure_is_a_notice(tmp_path, capsys):
    run = _write_run(tmp_path / "run", [])
    plot_after_run(run)  # must not raise: the run it belongs to is already saved
    err = capsys.readouterr().err
    assert "could not plot the metrics" in err and f"rlora plot {run}" in " ".join(err.split())


BAD_INPUTS = [
    ("missing folder", lambda t: [str(t / "nope")], "run folder not found"),
    ("no metrics.jsonl", lambda t: [str(_mkdir(t / "empty"))], "metrics.jsonl not found"),
    ("empty metrics.jsonl", lambda t: [str(_write_run(t / "r", []))], "holds no complete step line"),
    ("only a torn line", lambda t: [str(_write_run(t / "r", [], tail='{"step": 1, "rew'))], "holds no complete step"),
    ("no plottable metric", lambda t: [str(_write_run(t / "r", [{"step": 1, "grad_norm": 0.1}]))], "no metric to plot"),
    ("several runs without -o", lambda t: [str(_write_run(t / "a", _rows(2))), str(_write_run(t / "b", _rows(2)))],
     "say where with -o OUT"),
    ("the same run twice", lambda t: [str(_write_run(t / "a", _rows(2))), str(t / "a") + "/", "-o", str(t / "o")],
     "is given twice"),
    ("runs of two kinds", lambda t: [str(_write_run(t / "rl", _rows(2))),
                                     str(_write_run(t / "sft", [{"step": 1, "loss": 1.0}])), "-o", str(t / "o")],
     "rl is a run of rlora train and sft one of rlora sft or rm: overlay runs of one kind"),
    ("output is a file", lambda t: [str(_write_run(t / "r", _rows(2))), "-o", str(_touch(t / "f.png"))],
     "exists and is a file"),
]


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _touch(path: Path) -> Path:
    path.write_text("")
    return path


@pytest.mark.parametrize("name, make_args, message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_one_line_exit_2(name, make_args, message, tmp_path, capsys):
    code = main(["plot", *make_args(tmp_path)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlora: error:")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


# ---- each panel draws the column it names ----------------------------------------------------------------

# panel title -> the metrics.jsonl column it names, written out here (not read from rlora.plot.METRICS)
TITLE_COLUMN = {
    "reward (mean)": "reward_mean", "KL to the reference": "kl", "entropy (nats per token)": "entropy",
    "completion length (tokens, mean)": "completion_len_mean", "clip fraction": "clip_frac", "step time (s)": "step_s",
}


def _distinct_rows(n: int, offset: float) -> list[dict]:
    """Every column in its own range of values (and each run in its own, by offset), plus columns that are not
    plotted; kl is null at step 2 and clip_frac absent at step 3, so a panel's steps depend on its column too."""
    rows = []
    for i in range(1, n + 1):
        row = {"step": i, "reward_mean": offset + 0.1 * i, "kl": None if i == 2 else offset + 10 + i ** 2,
               "entropy": offset + 100 - i, "completion_len_mean": offset + 1000 + 3 * i, "step_s": offset + 5000 + i % 3,
               "loss": offset - i, "grad_norm": offset + 7 * i, "reward/count_a": offset + 0.25}
        if i != 3:
            row["clip_frac"] = offset + 0.5 / i
        rows.append(row)
    return rows


def _column(rows: list[dict], column: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the steps where the column holds a number."""
    kept = [row for row in rows if row.get(column) is not None]
    return [row["step"] for row in kept], [row[column] for row in kept]


@pytest.mark.parametrize("rows, figures", [
    # rlora sft: training and held-out loss (held-out at some steps only)
    ([{"step": 1, "loss": 1.7, "grad_norm": 3.7, "step_s": 11.0}, {"step": 2, "loss": 1.5, "step_s": 1.5, "eval_loss": 1.3}],
     ["loss", "eval_loss", "step_s"]),
    # rlora rm: losses, pair accuracies and the reward gap
    ([{"step": 1, "loss": 0.69, "accuracy": 0.0, "reward_gap": 0.0, "step_s": 1.6},
      {"step": 2, "loss": 0.68, "accuracy": 1.0, "reward_gap": 0.002, "step_s": 1.6, "eval_loss": 0.69, "eval_accuracy": 1.0}],
     ["loss", "eval_loss", "accuracy", "eval_accuracy", "reward_gap", "step_s"])])
def test_sft_and_rm_runs_plot_their_losses_and_accuracies(rows, figures, tmp_path, capsys):
    """An sft or rm run drew only its step time (and noted that it had no clip fraction)."""
    run = _write_run(tmp_path / "run", rows)
    assert main(["plot", str(run)]) == 0
    err = capsys.readouterr().err
    assert "note:" not in err and f"{len(figures) + 1} figures" in err, err
    assert sorted(p.name for p in (run / "plots").iterdir()) == sorted(f"{key}.png" for key in figures + ["overview"])
    [loss_ax] = _figure(["loss"], [RunMetrics("run", read_metrics(str(run)))]).axes
    assert loss_ax.get_title() == "loss (training)" and list(loss_ax.get_lines()[0].get_ydata()) == [r["loss"] for r in rows]


def test_each_panel_plots_the_column_its_title_names(tmp_path, monkeypatch):
    from rlora import plot

    runs = {"first": _distinct_rows(5, 0.0), "second": _distinct_rows(4, 20_000.0)}
    folders = [str(_write_run(tmp_path / label, rows)) for label, rows in runs.items()]
    drawn = []

    def keep_figure(fig, path):  # the figures plot_runs writes, read back from their axes below (PNGs: tests above)
        drawn.append((path.name, fig))
        return path

    monkeypatch.setattr(plot, "_save", keep_figure)
    plot_runs(folders, output=str(tmp_path / "plots"))
    assert sorted(name for name, _ in drawn) == sorted([f"{c}.png" for c in TITLE_COLUMN.values()] + ["overview.png"])
    for name, fig in drawn:
        titles = [ax.get_title() for ax in fig.axes]
        if name == "overview.png":
            assert sorted(titles) == sorted(TITLE_COLUMN)  # every panel, each once
        else:
            assert [TITLE_COLUMN[t] for t in titles] == [name.removesuffix(".png")]  # the file is named for it
        for ax in fig.axes:
            column = TITLE_COLUMN[ax.get_title()]
            assert ax.get_ylabel() == column
            lines = ax.get_lines()
            assert [line.get_label() for line in lines] == list(runs)
            for line in lines:
                steps, values = _column(runs[line.get_label()], column)
                assert list(line.get_xdata()) == steps, (name, column, line.get_label())
                assert list(line.get_ydata()) == pytest.approx(values, rel=1e-12), (name, column, line.get_label())


# ---- a run of several policies: its policies' metrics, as training draws them --------------------------------

def _write_policies_run(folder: Path, policies: dict[str, list[dict]]) -> Path:
    """A run of several policies as `rlora train` leaves it: the run's metrics.jsonl holds only NAME/ columns
    (and the shared step time); each policy's own metrics.jsonl holds its columns under the plain names."""
    steps = len(next(iter(policies.values())))
    _write_run(folder, [{"step": i, "step_s": 0.5, **{f"{name}/reward_mean": rows[i - 1]["reward_mean"]
                                                         for name, rows in policies.items()}}
                        for i in range(1, steps + 1)])
    for name, rows in policies.items():
        _write_run(folder / "policies" / name, rows)
    # the config's order is the order (and colours) training gave them, here not the alphabetical one
    (folder / "config.yaml").write_text("policies:\n" + "".join(f"- name: {name}\n" for name in policies))
    return folder


def _reward_lines(monkeypatch, runs: list[str], output: str | None = None) -> dict[str, list[float]]:
    """{legend label: y values} of the reward panel of overview.png, as plot_runs draws it."""
    from rlora import plot

    drawn = {}
    monkeypatch.setattr(plot, "_save", lambda fig, path: drawn.setdefault(path.name, fig) and path)
    plot_runs(runs, output)
    [ax] = [ax for ax in drawn["overview.png"].axes if ax.get_ylabel() == "reward_mean"]
    return {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}


def test_a_run_of_several_policies_plots_each_policy(tmp_path, monkeypatch, capsys):
    policies = {"zeta": _rows(3, scale=1.0), "alpha": _rows(3, scale=3.0)}
    run = _write_policies_run(tmp_path / "polrun", policies)
    lines = _reward_lines(monkeypatch, [str(run)])
    assert lines == {name: pytest.approx([r["reward_mean"] for r in rows]) for name, rows in policies.items()}
    assert list(lines) == ["zeta", "alpha"]  # the config's order, labelled as training labels them
    monkeypatch.undo()
    assert main(["plot", str(run)]) == 0
    err = capsys.readouterr().err
    assert "reward_mean: skipped" not in err and "entropy: skipped" not in err, err
    _assert_png(run / "plots" / "reward_mean.png")


def test_overlaying_a_run_of_several_policies_keeps_its_policies(tmp_path, monkeypatch):
    single = _write_run(tmp_path / "run1", _rows(4))
    multi = _write_policies_run(tmp_path / "polrun", {"a": _rows(2, scale=2.0), "b": _rows(2, scale=5.0)})
    lines = _reward_lines(monkeypatch, [str(single), str(multi)], output=str(tmp_path / "cmp"))
    assert list(lines) == ["run1", "polrun/a", "polrun/b"]
    assert lines["polrun/b"] == pytest.approx([2.5, 5.0])


def test_training_plots_of_several_policies_match_rlora_plot(tmp_path, monkeypatch):
    """plot_after_run is given the policies' folders (train/grpo.py); `rlora plot RUN` draws the same series."""
    run = _write_policies_run(tmp_path / "polrun", {"a": _rows(2), "b": _rows(2, scale=4.0)})
    from_cli = _reward_lines(monkeypatch, [str(run)])
    from_training = _reward_lines(monkeypatch, [str(run / "policies" / n) for n in ("a", "b")], str(run / "plots"))
    assert from_cli == from_training
