"""The run folder. Every file is written atomically (temporary name, fsync, rename), so a crash or a
kill never leaves a half-written config, adapter or summary; metrics.jsonl grows one whole line per step."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from rlora.errors import UserError
from rlora.system import as_if_created


# what train.overwrite=true clears: these exact names (files or, for the log.* outputs, folders) ...
RUN_FILES = {"config.yaml", "metrics.jsonl", "samples.jsonl", "eval.json", "eval_before.jsonl", "eval_after.jsonl",
             "summary.json", "tensorboard", "wandb", "completions", "plots", "model", "policies"}
# ... and names starting with these
RUN_FOLDER_PREFIXES = ("adapter", ".adapter", "checkpoints", ".model", "reward_model", ".reward_model")


def finite_or_none(obj: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def to_json(obj: Any, indent: int | None = None) -> str:
    return json.dumps(finite_or_none(obj), indent=indent, default=str, allow_nan=False)


def default_output_dir(prefix: str = "train") -> str:
    return str(Path("runs") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}")


def _step_of(line: str) -> int | None:
    """The step of a JSONL log line; None for a blank or torn line (a kill in the middle of an append)."""
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return None


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder: so that renames inside it are on disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_parent_writable(path: Path, what: str) -> None:
    """The nearest existing folder above `path` can be written (so creating `path` later cannot fail on that)."""
    parent = path.resolve().parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise UserError(f"cannot write {what} '{path}': no write permission in {parent}")


_TRAINING_OUTPUTS = ("metrics.jsonl", "adapter", "checkpoints", "summary.json")


def check_eval_output(folder: Path, overwrite: bool) -> None:
    """An evaluation (`rlora eval --output`) writes into a new folder, or over an earlier evaluation with
    --overwrite; never into a training run (its adapter and logs stay untouched)."""
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output '{folder}' exists and is a file")
    if folder.is_dir() and any(folder.iterdir()):
        if any((folder / name).exists() for name in _TRAINING_OUTPUTS):
            raise UserError(f"--output '{folder}' holds a training run: write the evaluation to another folder")
        if not overwrite:
            raise UserError(f"--output '{folder}' already holds files: choose another folder or pass --overwrite")
    check_parent_writable(folder, "--output")


def check_merge_output(output: str, overwrite: bool) -> None:
    """`rlora merge` writes a whole model into a new or empty folder (or, with --overwrite, a used one)."""
    target = Path(output)
    if target.exists() and not target.is_dir():
        raise UserError(f"output folder '{output}' exists and is a file")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise UserError(f"output folder '{output}' already holds files: choose another or pass --overwrite")


class RunDir:
    def __init__(self, path: str, overwrite: bool = False, writer: bool = True):
        self.path = Path(path)
        self.overwrite = overwrite
        self.writer = writer  # False on data-parallel ranks other than 0: every write is skipped

    def check_writable(self) -> None:
        """Before any work: refuse to mix a new run into an existing one."""
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"train.output_dir '{self.path}' exists and is a file")
        if self.holds_files() and not self.overwrite:
            raise UserError(
                f"train.output_dir '{self.path}' already holds files: choose a new folder or set train.overwrite=true"
            )
        check_parent_writable(self.path, "train.output_dir")

    def holds_files(self) -> bool:
        return self.path.is_dir() and any(self.path.iterdir())

    def create(self) -> None:
        """Make the folder; with overwrite, first remove the outputs of an earlier run (and nothing else)."""
        if not self.writer:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        if self.overwrite:
            for child in self.path.iterdir():
                if child.name in RUN_FILES or child.name.startswith(RUN_FOLDER_PREFIXES):
                    shutil.rmtree(child) if child.is_dir() else child.unlink()

    def holds_checkpoint(self, checkpoint: Path) -> bool:
        """The checkpoint belongs to this run folder (a resume continues here rather than starting anew)."""
        return checkpoint.resolve().parent.parent == self.path.resolve()

    def drop_steps_after(self, step: int, names: tuple[str, ...]) -> None:
        """Remove JSONL lines of steps after `step` (logged by a run that died before its next checkpoint)."""
        for name in names if self.writer else ():
            path = self.path / name
            if path.is_file():
                lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
                kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
                if len(kept) != len(lines):
                    self.write_text(name, "".join(kept))

    def write_text(self, name: str, text: str) -> None:
        if not self.writer:
            return
        target = self.path / name
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=self.path)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            as_if_created(tmp)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def write_json(self, name: str, obj: Any) -> None:
        self.write_text(name, to_json(obj, indent=2) + "\n")

    def append_jsonl(self, name: str, obj: Any) -> None:
        if not self.writer:
            return
        with open(self.path / name, "a", encoding="utf-8") as handle:
            handle.write(to_json(obj) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def write_folder(self, name: str, fill: Callable[[Path], None]) -> Path:
        """Fill a temporary folder, then swap it in place of `name` (the old one is removed after)."""
        target = self.path / name
        if not self.writer:
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=self.path))
        try:
            fill(tmp)
            for child in tmp.iterdir():
                with open(child, "rb") as handle:
                    os.fsync(handle.fileno())
            old = None
            if target.exists():
                old = self.path / f".{name}.old-{os.getpid()}"
                os.replace(target, old)
            as_if_created(tmp)
            os.replace(tmp, target)
            fsync_path(self.path)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target
