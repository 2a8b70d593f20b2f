"""How a run ends (train/lifecycle.py), the same for `rlora train`, `sft` and `rm`: whatever stops the steps,
the adapter learnt so far is saved and summary.json says why, then the error reaches the command line."""

from __future__ import annotations

import json
import os
import signal

import pytest
from conftest import tiny_overrides
from test_rm import PAIRS, rm_config
from test_sft import REPETITIVE, sft_config, write_jsonl

from rlora.cli import main
from rlora.errors import Terminated, UserError
from rlora.train import grpo, supervised
from rlora.train.lifecycle import kept_on_stop, stop_status
from rlora.train.outputs import RunDir
from rlora.train.step_batch import RewardFailure


def test_the_status_names_what_stopped_the_run():
    assert stop_status(KeyboardInterrupt()) == "interrupted"
    assert stop_status(Terminated()) == "terminated"
    assert stop_status(RewardFailure("5 of 8 rewards failed")) == "stopped: reward failures"
    assert stop_status(UserError("disk full")) == "failed: UserError: disk full"


def test_a_stopped_body_saves_writes_the_summary_and_reraises(tmp_path):
    run_dir = RunDir(str(tmp_path / "run"))
    run_dir.create()
    calls, summary = [], {"status": "completed", "steps": 0}
    with pytest.raises(ValueError, match="boom"):
        with kept_on_stop(run_dir, summary, lambda: calls.append("save"), before_save=lambda: calls.append("close")):
            summary["steps"] = 3
            raise ValueError("boom")
    assert calls == ["close", "save"]  # sinks closed before the adapter is written
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == {"status": "failed: ValueError: boom",
                                                                          "steps": 3}


def test_a_failing_save_does_not_hide_the_original_error(tmp_path, capsys):
    run_dir = RunDir(str(tmp_path / "run"))
    run_dir.create()

    def full_disk() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(KeyboardInterrupt):
        with kept_on_stop(run_dir, {"status": "completed"}, full_disk):
            raise KeyboardInterrupt
    assert "could not save what was learnt after the run stopped" in capsys.readouterr().err
    assert not (tmp_path / "run" / "summary.json").exists()


def _interrupt_at_second(monkeypatch, module, name: str) -> None:
    """module.name raises KeyboardInterrupt on its second call (the first step completes)."""
    real, calls = getattr(module, name), []

    def once_then_interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, once_then_interrupt)


@pytest.mark.parametrize("command", ["train", "sft", "rm"])
def test_an_interrupted_run_keeps_its_adapter_and_says_so(command, tiny_model_dir, prompts_file, tmp_path, monkeypatch,
                                                         capsys):
    run = tmp_path / "run"
    if command == "train":
        _interrupt_at_second(monkeypatch, grpo, "grpo_step")
        argv = ["train", *tiny_overrides(tiny_model_dir, prompts_file, str(run), **{"train.steps": 3,
                                                                                   "eval.before": "false"})]
        saved = run / "adapter" / "adapter_model.safetensors"
    else:
        _interrupt_at_second(monkeypatch, supervised, "optimizer_step")
        data = write_jsonl(tmp_path / "rows.jsonl", REPETITIVE if command == "sft" else PAIRS)
        argv = [command, (sft_config if command == "sft" else rm_config)(tmp_path, tiny_model_dir, data, steps=3)]
        saved = run / ("adapter/adapter_model.safetensors" if command == "sft" else "reward_model")
    assert main(argv) == 130
    assert "rlora: interrupted (a run that had started training saved its adapter" in capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert summary["last_metrics"]["step"] == 1  # the step that completed
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    assert saved.exists()


def test_a_terminated_run_keeps_its_adapter_and_exits_143(tiny_model_dir, prompts_file, tmp_path, monkeypatch, capsys):
    """SIGTERM (kill, timeout, a scheduler) stops a run as Ctrl-C does: a real signal, sent to this process in the
    second step, saves the adapter and summary.json; the exit code is 128 + 15, and the handler main() installed is
    gone afterwards."""
    real_step, calls = grpo.grpo_step, []

    def second_step_is_terminated(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(grpo, "grpo_step", second_step_is_terminated)
    before = signal.getsignal(signal.SIGTERM)
    run = tmp_path / "run"
    argv = ["train", *tiny_overrides(tiny_model_dir, prompts_file, str(run), **{"train.steps": 3, "eval.before": "false"})]
    assert main(argv) == 143
    assert "rlora: terminated (SIGTERM) (a run that had started training saved its adapter" in capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "terminated" and summary["last_metrics"]["step"] == 1
    assert (run / "adapter" / "adapter_model.safetensors").exists()
    assert signal.getsignal(signal.SIGTERM) is before
