"""Checkpoints: atomic folders that survive SIGKILL at any moment, exact resume, and bad resumes."""

import hashlib
import json
import os
import random
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_overrides
from rlora.cli import main
from rlora.train.checkpoint import checkpoints, latest_valid, set_aside_after, verify, write_checkpoint


def _fill(step: int, size: int = 50_000):
    def fill(folder):
        save_file({"w": torch.full((size,), float(step))}, str(folder / "weights.safetensors"))
        (folder / "sub").mkdir()
        torch.save({"step": torch.tensor(step), "note": "x" * 1000}, folder / "sub" / "state.pt")
    return fill


def test_write_verify_keep_and_skip_damaged(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        write_checkpoint(root, step, _fill(step), keep=2)
    assert [p.name for p in checkpoints(root)] == ["step-0000002", "step-0000003"]
    assert latest_valid(root).name == "step-0000003" and verify(root / "step-0000003")["step"] == 3
    # a truncated file in the newest checkpoint: it is skipped for the previous one
    path = root / "step-0000003" / "weights.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    assert verify(root / "step-0000003") is None and latest_valid(root).name == "step-0000002"
    # a leftover of an interrupted write is ignored, then cleaned up by the next write
    (root / ".tmp-step-0000004-x").mkdir()
    assert latest_valid(root).name == "step-0000002"
    write_checkpoint(root, 4, _fill(4), keep=2)
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
    assert latest_valid(root).name == "step-0000004"


CHILD = """
import os, sys
from pathlib import Path
import rlora.train.checkpoint as checkpoint

root, step, stop_at = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
first = step + 1

def pause(stage):
    # On the second write (one complete write comes first), announce the stage and wait to be killed there.
    if stage == stop_at and step > first:
        print("at " + stage, flush=True)
        sys.stdin.readline()

def fill(n):
    def write(folder):
        (folder / "weights.bin").write_bytes(n.to_bytes(4, "little") * 200_000)  # 800 kB
        pause("fill")  # one file of two written
        (folder / "sub").mkdir()
        (folder / "sub" / "state.txt").write_text(str(n))
    return write

replace, prune = os.replace, checkpoint.prune
os.replace = lambda *a: (pause("replace"), replace(*a))[1]  # manifest written, not yet moved into place
checkpoint.prune = lambda *a, **k: (pause("prune"), prune(*a, **k))[1]  # moved into place, old ones not pruned
print("ready", flush=True)
while True:
    step += 1
    checkpoint.write_checkpoint(root, step, fill(step), keep=2)
    print("done", step, flush=True)
"""


def _bytes_step(folder) -> int:
    data = (folder / "weights.bin").read_bytes()
    step = int.from_bytes(data[:4], "little")
    assert data == step.to_bytes(4, "little") * 200_000 and int((folder / "sub" / "state.txt").read_text()) == step
    return step


def test_sigkill_at_any_moment_always_leaves_a_valid_checkpoint(tmp_path):
    """A process writes checkpoints in a loop (the same write_checkpoint the trainer uses) and is killed with
    SIGKILL, 24 times: at each stage of a write (mid-fill, before the move into place, before pruning), the
    child waiting there to be killed, and at random moments after a completed write. After every kill the newest
    valid checkpoint holds one consistent step: the last completed write, or the one being pruned after."""
    import subprocess
    import sys

    root = tmp_path / "checkpoints"
    write_checkpoint(root, 1, lambda f: ((f / "weights.bin").write_bytes((1).to_bytes(4, "little") * 200_000),
                                         (f / "sub").mkdir(), (f / "sub" / "state.txt").write_text("1")), keep=2)
    rng = random.Random(0)
    step = 1
    for stage in ("fill", "replace", "prune", "random") * 6:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(step), stage],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        assert child.stdout.readline().split() == ["done", str(step + 1)]  # events, not sleeps, order the kill
        if stage == "random":
            time.sleep(rng.uniform(0.0, 0.05))  # anywhere in the writes that follow
        else:
            assert child.stdout.readline().strip() == f"at {stage}"
        child.kill()
        child.wait()
        child.stdin.close()
        child.stdout.close()
        newest = latest_valid(root)
        assert newest is not None
        new_step = _bytes_step(newest)
        assert verify(newest)["step"] == new_step
        if stage in ("fill", "replace"):  # killed inside the second write: the first one is the newest
            assert new_step == step + 1 and any(p.name.startswith(".tmp-") for p in root.iterdir())
        elif stage == "prune":  # the second write is in place; the pruning it skipped does not matter
            assert new_step == step + 2
        else:
            assert new_step >= step + 1
        step = new_step


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _adapter(out):
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def _as_before_the_policies_list(checkpoint: Path) -> None:
    """trainer.pt as a run of one policy wrote it before every run had a list of policies (one optimizer and one
    scheduler state, under their own keys), with the manifest to match."""
    trainer = torch.load(checkpoint / "trainer.pt", weights_only=True)
    [optimizer], [scheduler] = trainer.pop("optimizers"), trainer.pop("schedulers")
    torch.save(trainer | {"optimizer": optimizer, "scheduler": scheduler}, checkpoint / "trainer.pt")
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["trainer.pt"] = {"bytes": (checkpoint / "trainer.pt").stat().st_size,
                                       "sha256": hashlib.sha256((checkpoint / "trainer.pt").read_bytes()).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("written_by", ["now", "before the policies list"])
def test_resume_continues_exactly(written_by, tiny_model_dir, prompts_file, tmp_path, capsys):
    """4 steps straight == 3 steps (checkpoints at 2 and 3), the step-3 checkpoint lost, resume from 2, on to 4:
    same adapter (<= 1e-6) and the same sampled completions; step 3's log lines appear once. Also from a
    checkpoint in the format of one policy from before (its trainer.pt keys)."""
    common = {"train.checkpoint_every": 2, "train.sample_every": 1, "train.lr": 0.01, "algo.beta": 0.04,
              "eval.after": "false", "algo.name": "dapo"}
    straight = tmp_path / "straight"
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(straight), **common, **{"train.steps": 4})]) == 0
    resumed = tmp_path / "resumed"
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(resumed), **common, **{"train.steps": 3})]) == 0
    assert [p.name for p in checkpoints(resumed / "checkpoints")] == ["step-0000002", "step-0000003"]
    import shutil
    shutil.rmtree(resumed / "checkpoints" / "step-0000003")  # as if killed after step 3 was logged
    if written_by != "now":
        _as_before_the_policies_list(resumed / "checkpoints" / "step-0000002")
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(resumed), **common, **{
        "train.steps": 4, "train.resume": "auto"})]) == 0
    assert "resuming from" in capsys.readouterr().err
    assert [m["step"] for m in _metrics(resumed)] == [1, 2, 3, 4]
    a, b = _adapter(straight), _adapter(resumed)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    samples = [(out / "samples.jsonl").read_text().splitlines() for out in (straight, resumed)]
    completions = [[(json.loads(s)["step"], json.loads(s)["completion"]) for s in rows] for rows in samples]
    assert completions[0] == completions[1]
    assert json.loads((resumed / "eval.json").read_text())["before"] == json.loads((straight / "eval.json").read_text())["before"]


@pytest.mark.parametrize("case", ["missing", "damaged", "other settings", "pickle", "folder without checkpoint"])
def test_bad_resume_is_one_line_exit_2(case, tiny_model_dir, prompts_file, tmp_path, capsys):
    run = tmp_path / "run"
    base = {"train.checkpoint_every": 1, "train.steps": 1, "eval.before": "false", "eval.after": "false"}
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(run), **base)]) == 0
    capsys.readouterr()
    ckpt = run / "checkpoints" / "step-0000001"
    marker = tmp_path / "unpickling-ran-code"
    extra, message = {"train.resume": str(ckpt), "train.steps": 2}, None
    if case == "missing":
        extra["train.resume"], message = str(tmp_path / "nope"), "no checkpoint folder"
    elif case == "damaged":
        (ckpt / "trainer.pt").write_bytes(b"garbage")
        message = "not a complete checkpoint"
    elif case == "other settings":
        extra["lora.rank"], message = 8, "different lora.rank"
    elif case == "pickle":
        torch.save({"optimizer": _Evil(marker)}, ckpt / "trainer.pt")  # a pickle that would run code when loaded
        manifest = json.loads((ckpt / "manifest.json").read_text())
        from rlora.train.checkpoint import _sha256
        manifest["files"]["trainer.pt"] = {"bytes": (ckpt / "trainer.pt").stat().st_size, "sha256": _sha256(ckpt / "trainer.pt")}
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
        message = "refused to load"
    else:
        (run / "checkpoints").rename(tmp_path / "elsewhere")
        extra["train.resume"], message = "auto", "holds a run but no checkpoint to resume from"
    code = main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(run), **{**base, **extra})])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlora: error:")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not marker.exists(), "the pickled payload must never run"


def test_resume_auto_without_an_output_folder_is_one_line(tmp_path, capsys, monkeypatch):
    """train.resume=auto continues the run in train.output_dir; without one a new timestamped folder would be chosen
    and the run would start afresh without a word: refused, nothing written."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "train.resume=auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "set train.output_dir to that run's folder" in err, err
    assert list(tmp_path.iterdir()) == []


class _Evil:
    """Unpickling this calls open(marker, 'w'): a stand-in for arbitrary code in a malicious checkpoint."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_full_disk_while_checkpointing_keeps_the_previous_checkpoint(tiny_model_dir, prompts_file, tmp_path, capsys,
                                                                       monkeypatch):
    from rlora.models.adapters import PeftLora

    calls = []

    def save_then_fill_the_disk(adapter, folder, policy=0):  # the disk fills while the second checkpoint is written
        if "checkpoints" in Path(folder).parts:
            calls.append(folder)
            if len(calls) > 1:
                raise OSError(28, "No space left on device")
        real_save(adapter, folder, policy)

    real_save = PeftLora.save
    monkeypatch.setattr(PeftLora, "save", save_then_fill_the_disk)
    run = tmp_path / "run"
    code = main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(run), **{
        "train.checkpoint_every": 1, "train.steps": 3, "eval.before": "false", "eval.after": "false"})])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlora: error:")]
    assert code == 2 and len(lines) == 1 and "No space left on device" in lines[0] and "step 2" in lines[0], err
    assert [p.name for p in checkpoints(run / "checkpoints")] == ["step-0000001"]
    assert latest_valid(run / "checkpoints").name == "step-0000001"
    assert not any(p.name.startswith(".tmp-") for p in (run / "checkpoints").iterdir())
    assert json.loads((run / "summary.json").read_text())["status"].startswith("failed: UserError")


def test_prune_never_removes_the_only_valid_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    write_checkpoint(root, 10, _fill(10), keep=1)
    write_checkpoint(root, 20, _fill(20), keep=1)
    damaged = root / "step-0000020" / "weights.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    write_checkpoint(root, 15, _fill(15), keep=1)  # e.g. after resuming from an older checkpoint
    assert latest_valid(root) is not None and verify(latest_valid(root)) is not None


def test_resaving_a_step_that_fails_keeps_the_old_one(tmp_path, monkeypatch):
    import rlora.train.checkpoint as checkpoint

    root = tmp_path / "checkpoints"
    write_checkpoint(root, 5, _fill(5), keep=2)
    real_replace = os.replace

    def fail_on_swap(src, dst):
        if str(dst).endswith("step-0000005"):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", fail_on_swap)
    with pytest.raises(OSError):
        write_checkpoint(root, 5, _fill(5), keep=2)
    monkeypatch.setattr(checkpoint.os, "replace", real_replace)
    assert latest_valid(root).name == "step-0000005"  # set aside before the swap, put back when listed


def test_torn_log_line_is_dropped_on_resume(tmp_path):
    from rlora.train.outputs import RunDir

    run = RunDir(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    run.drop_steps_after(2, ("metrics.jsonl",))
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'


def test_max_time_stops_after_the_step_that_passes_it(tiny_model_dir, prompts_file, tmp_path, capsys):
    """A limit shorter than one step: the run stops after step 1 (and says '1 step', not '1 steps')."""
    out = tmp_path / "run"
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(out), **{
        "train.steps": 3, "train.max_time_s": 0.001, "eval.before": "false", "eval.after": "false"})]) == 0
    assert "train.max_time_s=0.001 reached after 1 step\n" in capsys.readouterr().err
    assert [m["step"] for m in _metrics(out)] == [1]


def test_eval_size_of_a_data_file_without_held_out_prompts_does_not_block_a_resume(tmp_path):
    """data.eval_size counts rows of data.eval_path (or a task's held-out draws): with a data.path and no eval_path
    it selects nothing, so a resume may leave it at its default; with an eval_path it is compared."""
    from rlora.config import load_config, to_yaml
    from rlora.errors import UserError
    from rlora.train.resume import check_same_run

    def checkpoint(*overrides):
        cfg = load_config(None, ["data.task=null", "data.path=rows.jsonl", *overrides])
        (tmp_path / "state.json").write_text(json.dumps({"step": 1, "config": to_yaml(cfg)}))

    checkpoint("data.eval_size=4")
    assert check_same_run(load_config(None, ["data.task=null", "data.path=rows.jsonl"]), tmp_path)["step"] == 1
    checkpoint("data.eval_size=4", "data.eval_path=held.jsonl")
    with pytest.raises(UserError, match="different data.eval_size"):
        check_same_run(load_config(None, ["data.task=null", "data.path=rows.jsonl", "data.eval_path=held.jsonl"]),
                       tmp_path)


def test_a_second_resume_from_the_same_checkpoint_keeps_both_abandoned_trajectories(tmp_path):
    """A resume from step 5 sets step 10 aside; the resumed run writes its own step 10; a second resume from step 5
    used to delete the first trajectory's copy to make room for the second's."""
    def folder(name: str, holds: str) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "holds.txt").write_text(holds)

    folder("step-0000005", "shared")
    folder("step-0000010", "first")
    assert [p.name for p in set_aside_after(tmp_path, 5)] == ["abandoned-step-0000010"]
    folder("step-0000010", "second")
    assert [p.name for p in set_aside_after(tmp_path, 5)] == ["abandoned-2-step-0000010"]
    folder("step-0000010", "third")
    assert [p.name for p in set_aside_after(tmp_path, 5)] == ["abandoned-3-step-0000010"]
    held = {p.name: (p / "holds.txt").read_text() for p in tmp_path.iterdir()}
    assert held == {"step-0000005": "shared", "abandoned-step-0000010": "first",
                    "abandoned-2-step-0000010": "second", "abandoned-3-step-0000010": "third"}
    assert [p.name for p in checkpoints(tmp_path)] == ["step-0000005"]  # resume=auto never takes a set-aside one


def test_resume_takes_step_n_for_the_zero_padded_folder_and_a_missing_one_lists_what_is_there(tmp_path):
    """Checkpoints are written as step-0000002; train.resume=.../step-2 was refused with a message that asked for
    exactly that form."""
    from rlora.config import load_config
    from rlora.errors import UserError
    from rlora.train.resume import find_checkpoint

    root = tmp_path / "checkpoints"
    (root / "step-0000002").mkdir(parents=True)  # no files: found, then refused as incomplete
    (root / "step-0000004").mkdir()
    with pytest.raises(UserError, match=r"'.*step-2' is not a complete checkpoint"):
        find_checkpoint(load_config(None, [f"train.resume={root / 'step-2'}"]))
    with pytest.raises(UserError, match=r"no checkpoint folder at '.*step-3' \(.*holds step-0000002, step-0000004\)"):
        find_checkpoint(load_config(None, [f"train.resume={root / 'step-3'}"]))


def test_weight_packs_may_change_on_resume_other_rollout_settings_may_not(tmp_path):
    """rollout.weight_packs changes only which kernel computes the sampler's products (e.g. switched off after a run
    ran out of memory holding them): a resume may change it; rollout.temperature decides the samples: refused."""
    from rlora.config import load_config, to_yaml
    from rlora.errors import UserError
    from rlora.train.resume import check_same_run

    (tmp_path / "state.json").write_text(json.dumps({"step": 1, "config": to_yaml(load_config(None, []))}))
    assert check_same_run(load_config(None, ["rollout.weight_packs=false"]), tmp_path)["step"] == 1
    with pytest.raises(UserError, match="different rollout.temperature"):
        check_same_run(load_config(None, ["rollout.weight_packs=false", "rollout.temperature=0.5"]), tmp_path)
