"""Where a run's numbers go besides metrics.jsonl (always written) and the console: TensorBoard, Weights &
Biases, and the table of sample completions (samples.jsonl or Parquet). All of it is chosen by `log.*`.

Only the writing rank (rank 0, RunDir.writer) opens anything; on other ranks every call does nothing.
A sink whose package is missing fails in `check_sinks`, before any model loads, with one line.

Resume (train.resume) after checkpoint step K, in the same output folder:
- TensorBoard opens a new event file with purge_step=K+1, so TensorBoard drops the points of steps > K
  that the interrupted attempt had logged: every step shows once, with the values of the run that went on.
- W&B continues the same run id (kept in OUTPUT/wandb/run-id) with resume="allow". Offline, each attempt
  is its own offline-run-* folder of that id, and `wandb sync` uploads them into one run; online, W&B
  ignores points at steps it already holds, so steps K+1.. of the interrupted attempt keep their values.
- Parquet step files after K are removed, as grpo.start drops the lines of metrics.jsonl/samples.jsonl.
"""

from __future__ import annotations

import importlib
import math
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from rlora.errors import UserError, first_line
from rlora.logging.console import info
from rlora.train.outputs import RunDir

if TYPE_CHECKING:
    from rlora.config import LogConfig, RLConfig

TRACK_FIX = "pip install -e .[track]"
TENSORBOARD_DIR, WANDB_DIR, COMPLETIONS_DIR, SAMPLES_FILE = "tensorboard", "wandb", "completions", "samples.jsonl"
WANDB_RUN_ID = "run-id"


def check_sinks(log: LogConfig) -> None:
    """Each enabled sink's package imports (else a one-line UserError naming the fix)."""
    if log.tensorboard:
        _need("tensorboard", "log.tensorboard=true", TRACK_FIX)
    if log.wandb:
        _need("wandb", "log.wandb=true", TRACK_FIX)
    if log.completions_format == "parquet":
        _need("pyarrow", "log.completions_format=parquet", "pip install pyarrow")


def _need(module: str, option: str, fix: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError:
        raise UserError(f"{option} needs the '{module}' package, which is not installed: run `{fix}` "
                        f"(or turn the option off)") from None


def numeric_scalars(metrics: dict) -> dict[str, float]:
    """The finite numbers of a metrics row: what metrics.jsonl holds as numbers (no lists, text, nulls, step)."""
    return {key: float(value) for key, value in metrics.items()
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value)}


class Sinks:
    """The run's optional sinks, built once the run folder exists (after grpo.start)."""

    def __init__(self, cfg: RLConfig, run_dir: RunDir, first_step: int = 0):
        self.metric_sinks: list = []
        self.completions = None
        if not run_dir.writer:
            return
        try:
            if cfg.log.tensorboard:
                self.metric_sinks.append(TensorBoardSink(run_dir.path / TENSORBOARD_DIR, first_step))
            if cfg.log.wandb:
                self.metric_sinks.append(WandbSink(cfg, run_dir.path, first_step))
        except BaseException:
            self.close(failed=True)  # e.g. W&B could not start: do not leave TensorBoard's writer open
            raise
        parquet = cfg.log.completions_format == "parquet"
        self.completions = ParquetCompletions(run_dir.path / COMPLETIONS_DIR, first_step) if parquet else JsonlCompletions(run_dir)

    def log_metrics(self, step: int, metrics: dict) -> None:
        scalars = numeric_scalars(metrics)
        for sink in self.metric_sinks:
            sink.log(step, scalars)

    def log_completions(self, step: int, rows: list[dict]) -> None:
        if self.completions is not None and rows:
            self.completions.log(step, rows)

    def close(self, failed: bool = False) -> None:
        """Best effort: every step was already flushed, so a sink that fails to close loses nothing."""
        for sink in self.metric_sinks:
            try:
                sink.close(failed)
            except Exception as err:  # must not hide the error that stopped a failed run
                info(f"could not close the {sink.name} log: {first_line(err)}")
        self.metric_sinks = []


class TensorBoardSink:
    name = "TensorBoard"

    def __init__(self, folder: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter  # optional extra [track]

        # on resume, purge_step hides what an interrupted attempt logged after the checkpoint
        self.writer = SummaryWriter(str(folder), purge_step=first_step + 1 if first_step else None)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()  # a crash loses at most the step being written

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbSink:
    name = "W&B"

    def __init__(self, cfg: RLConfig, run_path: Path, first_step: int):
        import wandb  # optional extra [track]

        log = cfg.log
        try:
            self.run = wandb.init(
                project=log.wandb_project, mode=log.wandb_mode, dir=str(run_path), name=run_path.name,
                id=_wandb_run_id(run_path / WANDB_DIR, resumed=first_step > 0), resume="allow",
                config=cfg.model_dump(mode="json"), reinit="create_new",
                # console="off": W&B would otherwise wrap stdout/stderr under rlora's progress bar
                settings=wandb.Settings(silent=True, console="off"))
        except Exception as err:  # no login for online mode, a service that does not start, ...
            raise UserError(f"could not start W&B (log.wandb_mode={log.wandb_mode}): {first_line(err)}") from None

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def _wandb_run_id(folder: Path, resumed: bool) -> str:
    """A new id for a new run; a resumed run keeps the id of the run it continues, so W&B shows one run."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / WANDB_RUN_ID
    if resumed and path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)
    path.write_text(run_id + "\n")
    return run_id


class JsonlCompletions:
    """samples.jsonl: one line per completion (the format before log.completions_format existed)."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir

    def log(self, step: int, rows: list[dict]) -> None:
        for row in rows:
            self.run_dir.append_jsonl(SAMPLES_FILE, row)


class ParquetCompletions:
    """One file per logged step, completions/step-000005.parquet: a write costs that step's rows only (one
    growing file would be rewritten whole every time), and `pyarrow.parquet.read_table(OUTPUT/completions)`
    reads them all as one table (the zero-padded names keep step order)."""

    def __init__(self, folder: Path, first_step: int):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        for path in folder.glob("step-*.parquet"):
            step = _file_step(path)
            if step is not None and step > first_step:  # written after the checkpoint this run resumes from
                path.unlink()

    def log(self, step: int, rows: list[dict]) -> None:
        target = self.folder / f"step-{step:06d}.parquet"
        tmp = self.folder / f".{target.name}.tmp"  # a leading dot: parquet readers skip it
        with open(tmp, "wb") as handle:
            import pyarrow.parquet as pq  # only with log.completions_format=parquet (check_sinks said if it is missing)

            pq.write_table(completions_table(rows), handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)


def _file_step(path: Path) -> int | None:
    try:
        return int(path.stem.removeprefix("step-"))
    except ValueError:
        return None


INT_COLUMNS, TEXT_COLUMNS = ("step", "retries"), ("prompt", "completion")


def completions_table(rows: list[dict]):
    """Rows -> a pyarrow table whose column types do not depend on the values of one step."""
    import pyarrow as pa  # only with log.completions_format=parquet (check_sinks said if it is missing)

    table = pa.Table.from_pylist(rows)
    fields = [pa.field(name, _column_type(name, kind)) for name, kind in zip(table.column_names, table.schema.types)]
    return table.cast(pa.schema(fields))


def _column_type(name: str, inferred):
    import pyarrow as pa  # only with log.completions_format=parquet (check_sinks said if it is missing)

    if name in INT_COLUMNS:
        return pa.int64()
    if name in TEXT_COLUMNS:
        return pa.string()
    # a reward that failed for a whole step is all null, a whole-number one infers as int: float64 in
    # every file, so the step files read back as one table
    if pa.types.is_null(inferred) or pa.types.is_integer(inferred) or pa.types.is_floating(inferred):
        return pa.float64()
    return inferred
