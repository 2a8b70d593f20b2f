"""What rlora publishes atomically (written under tempfile's owner-only 0600/0700, then renamed into place) gets the
permissions a plain open()/mkdir() gives under the process's umask: a merged model or adapter was readable by its
owner only, so a server under another uid could not load it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from rlora.train.checkpoint import write_checkpoint
from rlora.train.outputs import RunDir


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_files_and_folders_written_atomically_follow_the_umask(umask, tmp_path):
    run = RunDir(str(tmp_path / "run"))
    run.path.mkdir()
    run.write_text("config.yaml", "a: 1\n")
    run.write_json("summary.json", {"status": "completed"})

    def fill(folder: Path) -> None:
        (folder / "adapter_model.safetensors").write_bytes(b"\0" * 8)

    def fill_nested(folder: Path) -> None:  # a checkpoint holds folders (e.g. each policy's adapter)
        fill(folder)
        (folder / "nested").mkdir()
        (folder / "nested" / "x.json").write_text("{}")

    adapter = run.write_folder("adapter", fill)
    checkpoint = write_checkpoint(run.path / "checkpoints", 1, fill_nested, keep=2)
    files = [run.path / "config.yaml", run.path / "summary.json", adapter / "adapter_model.safetensors",
             checkpoint / "adapter_model.safetensors", checkpoint / "nested" / "x.json", checkpoint / "manifest.json"]
    folders = [adapter, checkpoint, checkpoint / "nested"]
    assert {p.name: oct(_mode(p)) for p in files} == {p.name: oct(0o666 & ~umask) for p in files}
    assert {str(p): oct(_mode(p)) for p in folders} == {str(p): oct(0o777 & ~umask) for p in folders}
    assert os.umask(umask) == umask  # reading the umask put it back
