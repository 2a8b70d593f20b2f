"""log.* sinks end to end on the tiny model: TensorBoard event files and the W&B offline run hold what
metrics.jsonl holds, the Parquet completions are the rows the steps produced, resume shows every step once,
and a missing package is one line before anything loads."""

import glob
import json
import shutil
import struct
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import rlora.train.grpo as grpo
from conftest import tiny_overrides
from rlora.cli import main
from rlora.config import load_config
from rlora.train.sinks import Sinks, completions_table, numeric_scalars
from rlora.train.outputs import RunDir

ALL_SINKS = {"log.tensorboard": "true", "log.wandb": "true", "log.completions_format": "parquet"}


@pytest.fixture()
def step_rows(monkeypatch):
    """The completion rows each real grpo_step returned, by step (a spy: the step itself runs unchanged)."""
    produced = {}
    real_step = grpo.grpo_step

    def recording_step(s, step, *args):
        metrics, rows = real_step(s, step, *args)
        produced[step + 1] = rows
        return metrics, rows

    monkeypatch.setattr(grpo, "grpo_step", recording_step)
    return produced


def _train(capsys, *args, **overrides):
    code = main(["train", *tiny_overrides(*args, **overrides)])
    err = capsys.readouterr().err
    assert code == 0, err
    return err


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _tensorboard(out: Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _tensorboard_steps(out: Path) -> dict[str, list[int]]:
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _wandb_records(path: str):
    """Records of a .wandb file: the LevelDB log format (7-byte header, 32 KiB blocks, chunked records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, chunk = Path(path).read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def _wandb_history(path: str) -> dict[int, dict]:
    history = {}
    for record in _wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return history


def test_every_sink_holds_what_the_run_logged(tiny_model_dir, prompts_file, tmp_path, capsys, step_rows):
    out = tmp_path / "run"
    _train(capsys, tiny_model_dir, prompts_file, str(out), **ALL_SINKS, **{"eval.after": "false"})
    metrics = _metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]

    # TensorBoard: every finite number of every metrics.jsonl line, at its step (float32 in the event file)
    scalars = _tensorboard(out)
    assert set(scalars) == {key for row in metrics for key in numeric_scalars(row)}
    for row in metrics:
        for key, value in numeric_scalars(row).items():
            assert scalars[key][row["step"]] == pytest.approx(value, rel=1e-6, abs=1e-12), key
    assert "kl" not in scalars  # null without algo.beta: not a number, not logged

    # W&B offline: one run folder, named by the id rlora kept, whose history is metrics.jsonl
    [run_file] = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    run_id = (out / "wandb" / "run-id").read_text().strip()
    assert run_file.endswith(f"-{run_id}/run-{run_id}.wandb")
    history = _wandb_history(run_file)
    assert sorted(history) == [1, 2]
    for row in metrics:
        assert history[row["step"]] == pytest.approx(numeric_scalars(row), rel=1e-9)

    # Parquet: one file per step, together exactly the rows the steps returned; no samples.jsonl
    assert sorted(p.name for p in (out / "completions").iterdir()) == ["step-000001.parquet", "step-000002.parquet"]
    table = pq.read_table(out / "completions")
    assert table.to_pylist() == step_rows[1] + step_rows[2]
    assert len(table) == 2 * 2 * 4 and str(table.schema.field("reward/count_a").type) == "double"
    assert not (out / "samples.jsonl").exists()


def test_resume_shows_every_step_once(tiny_model_dir, prompts_file, tmp_path, capsys, step_rows):
    """2 steps with checkpoints, the step-2 checkpoint lost (as if killed after step 2 was logged), resumed
    from step 1: step 2 runs again, and each sink holds it once, with the values of the resumed run."""
    out = tmp_path / "run"
    common = {**ALL_SINKS, "train.checkpoint_every": 1, "eval.before": "false", "eval.after": "false"}
    _train(capsys, tiny_model_dir, prompts_file, str(out), **common)
    first_step_s = _metrics(out)[1]["step_s"]
    shutil.rmtree(out / "checkpoints" / "step-0000002")
    err = _train(capsys, tiny_model_dir, prompts_file, str(out), **common, **{"train.resume": "auto"})
    assert "resuming from" in err
    metrics = _metrics(out)
    assert [m["step"] for m in metrics] == [1, 2] and metrics[1]["step_s"] != first_step_s

    assert all(steps == [1, 2] for steps in _tensorboard_steps(out).values())
    assert _tensorboard(out)["step_s"][2] == pytest.approx(metrics[1]["step_s"], rel=1e-6)

    run_files = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")))
    run_id = (out / "wandb" / "run-id").read_text().strip()
    assert len(run_files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in run_files)  # one W&B run
    # the first attempt logged steps 1 and 2, the resumed one step 2 only (folder names need not sort by time:
    # two attempts within one second get the same timestamp)
    assert sorted(sorted(_wandb_history(f)) for f in run_files) == [[1, 2], [2]]

    assert pq.read_table(out / "completions").to_pylist() == step_rows[1] + step_rows[2]


@pytest.mark.parametrize("package, option", [("tensorboard", "log.tensorboard"), ("wandb", "log.wandb")])
def test_missing_package_is_one_line(package, option, tiny_model_dir, prompts_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)  # what `import package` sees when it is not installed
    code = main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"), **{option: "true"})])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlora: error:")]
    assert code == 2 and len(lines) == 1, err
    assert f"{option}=true needs the '{package}' package" in lines[0] and "pip install -e .[track]" in lines[0]
    assert not (tmp_path / "o").exists(), "checked before the run folder or the model"


def test_other_ranks_write_nothing(tmp_path, tiny_model_dir, prompts_file):
    out = tmp_path / "run"
    out.mkdir()
    cfg = load_config(None, tiny_overrides(tiny_model_dir, prompts_file, str(out), **ALL_SINKS))
    sinks = Sinks(cfg, RunDir(str(out), writer=False))
    sinks.log_metrics(1, {"step": 1, "reward_mean": 0.5})
    sinks.log_completions(1, [{"step": 1, "prompt": "p", "completion": "c"}])
    sinks.close()
    assert list(out.iterdir()) == []


def test_completion_columns_keep_their_types_when_a_step_has_only_nulls():
    rows = [{"step": 3, "prompt": "p", "completion": "c", "reward": None, "advantage": 0, "temperature": 1.0,
             "retries": 0, "reward/x": None}]
    types = {f.name: str(f.type) for f in completions_table(rows).schema}
    assert types == {"step": "int64", "prompt": "string", "completion": "string", "reward": "double",
                     "advantage": "double", "temperature": "double", "retries": "int64", "reward/x": "double"}


def test_overwrite_clears_the_log_outputs(tmp_path):
    for name in ("tensorboard", "wandb", "completions", "plots", "mine"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text("x")
    RunDir(str(tmp_path), overwrite=True).create()
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]
