"""Checkpoint folders that are either complete or absent.

A checkpoint is written into a temporary folder; every file is fsynced, a manifest with each file's size
and SHA-256 is written last, the folder is renamed to `step-NNNNNNN` and the parent fsynced. A kill at
any moment leaves either no new folder (only a `.tmp-` one, ignored and cleaned up later) or a complete
one; `latest_valid` additionally re-checks sizes and hashes, so a checkpoint damaged afterwards (a
truncated file) is skipped in favour of the previous one. Only the last `keep` checkpoints are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from rlora.train.outputs import fsync_path

MANIFEST = "manifest.json"
_NAME = re.compile(r"^step-(\d{7})$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_checkpoint(root: Path, step: int, fill: Callable[[Path], None], keep: int) -> Path:
    """fill(folder) writes the checkpoint's files; -> the final folder root/step-NNNNNNN."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{checkpoint_name(step)}-", dir=root))
    try:
        fill(tmp)
        files = _files(tmp)
        manifest = {"step": step, "files": {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                                            for p in files}}
        for path in files:
            fsync_path(path)
        with open(tmp / MANIFEST, "w", encoding="utf-8") as handle:
            json.dump(manifest, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        for folder in {p.parent for p in files} | {tmp}:
            fsync_path(folder)
        target = root / checkpoint_name(step)
        if target.exists():  # the same step again (a resumed run re-saving): keep the old one until the swap
            shutil.rmtree(target.rename(root / f".old-{checkpoint_name(step)}-{os.getpid()}"))
        os.replace(tmp, target)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(root, keep)
    return target


def verify(folder: Path) -> dict | None:
    """The manifest if every listed file is present with its size and hash (and nothing is missing), else None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        for name, meta in files.items():
            path = folder / name
            if path.stat().st_size != meta["bytes"] or _sha256(path) != meta["sha256"]:
                return None
        return manifest
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoints(root: Path) -> list[Path]:
    """Completed checkpoint folders (by name), oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)), key=lambda p: p.name)


def latest_valid(root: Path) -> Path | None:
    for folder in reversed(checkpoints(root)):
        if verify(folder) is not None:
            return folder
    return None


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints; remove older ones and leftovers of interrupted writes (a run
    folder has one writer, and this runs after its own write completed)."""
    for folder in checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(folder, ignore_errors=True)
    for leftover in root.iterdir():
        if leftover.name.startswith((".tmp-", ".old-")):
            shutil.rmtree(leftover, ignore_errors=True)
