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

from rlora.system import as_if_created
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
        old = None
        if target.exists():  # the same step again (a resumed run re-saving): set the old one aside until the swap
            old = target.rename(root / f".old-{checkpoint_name(step)}")
            fsync_path(root)
        as_if_created(tmp)
        os.replace(tmp, target)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    prune(root, keep, written=target)
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
    """Completed checkpoint folders (by name), oldest first. A checkpoint set aside for a re-save of its
    step (`.old-step-N`) whose replacement never arrived (killed in between) is put back first."""
    if not root.is_dir():
        return []
    for aside in root.glob(".old-step-*"):
        original = root / aside.name.removeprefix(".old-")
        if _NAME.match(original.name) and not original.exists():
            aside.rename(original)
    return sorted((p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)), key=lambda p: p.name)


def latest_valid(root: Path) -> Path | None:
    for folder in reversed(checkpoints(root)):
        if verify(folder) is not None:
            return folder
    return None


def _complete(folder: Path) -> bool:
    """Manifest present and every file of the size it lists (cheaper than verify: no hashing)."""
    try:
        files = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
        return all((folder / name).stat().st_size == meta["bytes"] for name, meta in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def prune(root: Path, keep: int, written: Path | None = None) -> None:
    """Keep the newest `keep` complete checkpoints (and the one just written); remove older complete ones,
    incomplete ones older than the newest complete one, and leftovers of interrupted writes. A run folder
    has one writer, and this runs after its own write completed."""
    folders = checkpoints(root)
    complete = [f for f in folders if _complete(f)]
    keep_set = set(complete[-keep:]) | ({written} if written is not None else set())
    newest_complete = complete[-1].name if complete else None
    for folder in folders:
        stale = folder in complete or (newest_complete is not None and folder.name < newest_complete)
        if folder not in keep_set and stale:
            shutil.rmtree(folder, ignore_errors=True)
    for leftover in root.glob(".tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def set_aside_after(root: Path, step: int) -> list[Path]:
    """Checkpoints of steps after `step` belong to the trajectory a resume from `step` replaces: rename them
    to `abandoned-step-N` (kept for the user, ignored by resume=auto), or `abandoned-K-step-N` where an earlier
    resume already set a step N aside (a second resume from the same checkpoint keeps both). -> the new names."""
    moved = []
    for folder in checkpoints(root):
        if int(_NAME.match(folder.name).group(1)) > step:
            target = root / f"abandoned-{folder.name}"
            tries = 2
            while target.exists():
                target, tries = root / f"abandoned-{tries}-{folder.name}", tries + 1
            moved.append(folder.rename(target))
    return moved
