"""`rlora sft` and `rlora rm` checkpoints: a run killed after its last checkpoint and resumed ends where the run
straight through ends (sft: LoRA with dropout, so the RNG states matter, MoLoRA, every parameter with
train.full_finetune; rm: the reward adapter and score head), and a resume with other settings, of the other command or
into a folder without a checkpoint is one line with exit code 2 before the model loads."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_rm import PAIRS, rm_config
from test_sft import REPETITIVE, _error, sft_config, write_jsonl

from rlora.cli import main
from rlora.train.checkpoint import checkpoints

ROWS = REPETITIVE + [{"prompt": f"Say {w}.", "completion": f"{w} {w} {w}"} for w in ("yes", "no", "maybe", "so")]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out, kind: str) -> dict[str, torch.Tensor]:
    if kind == "full":
        return load_file(str(out / "model" / "model.safetensors"))
    name = "molora_model.safetensors" if kind == "molora" else "adapter_model.safetensors"
    return load_file(str(out / "adapter" / name))


KINDS = {
    "lora": ["lora.dropout=0.2"],  # dropout draws from the RNG: a resume that lost its state would differ
    "molora": ['molora={"num_experts": 2, "top_k": 1, "rank": 2, "router_init_std": 0.3}', "lora.rank=16"],
    "full": ["train.full_finetune=true", "lora.rank=16"],
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_resumed_sft_run_ends_where_the_straight_run_ends(kind, tiny_model_dir, tmp_path, capsys):
    """5 steps straight == 4 steps (checkpoints at 2 and 4), the step-4 checkpoint lost, resume from 2, on to 5: the
    same weights (<= 1e-6), the same per-step losses and held-out losses, step 3-4's log lines once."""
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    common = [*KINDS[kind], "data.eval_size=2", "train.eval_every=2", "train.checkpoint_every=2"]

    def run(out, steps, *extra):
        config = sft_config(tmp_path, tiny_model_dir, data, steps=steps, output_dir=str(out))
        return main(["sft", config, *common, *extra])

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run(straight, 5) == 0, capsys.readouterr().err
    assert run(resumed, 4) == 0, capsys.readouterr().err
    assert [p.name for p in checkpoints(resumed / "checkpoints")] == ["step-0000002", "step-0000004"]
    shutil.rmtree(resumed / "checkpoints" / "step-0000004")  # as if killed after step 4 was logged
    capsys.readouterr()
    assert run(resumed, 5, "train.resume=auto") == 0
    assert "resuming from" in capsys.readouterr().err
    a, b = _weights(straight, kind), _weights(resumed, kind)
    assert a.keys() == b.keys()
    assert max(float((a[k].float() - b[k].float()).abs().max()) for k in a) <= 1e-6
    rows = {out: _metrics(out) for out in (straight, resumed)}
    assert [r["step"] for r in rows[resumed]] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in rows[resumed] if "eval_loss" in r] == [2, 4, 5]
    for x, y in zip(rows[straight], rows[resumed], strict=True):
        assert x.keys() == y.keys()
        for key in x.keys() - {"step_s"}:
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-9), (x["step"], key)
    # the end of the run is a checkpoint too (5 is not a multiple of 2), so more steps extend it
    assert [p.name for p in checkpoints(resumed / "checkpoints")] == ["step-0000004", "step-0000005"]
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["status"] == "completed"


def test_bad_sft_resumes_are_one_line(tiny_model_dir, prompts_file, tmp_path, capsys):
    from conftest import tiny_overrides

    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    config = sft_config(tmp_path, tiny_model_dir, data, steps=2, checkpoint_every=1)
    out = tmp_path / "run"
    assert main(["sft", config, "data.eval_size=2"]) == 0
    capsys.readouterr()
    err = _error(["sft", config, "data.eval_size=2", "train.resume=auto", "train.batch_size=2"], capsys)
    assert "different train.batch_size (4 there, 2 now)" in err and "except seed, batch_size, group_window" in err
    assert "different lora.rank" in _error(["sft", config, "data.eval_size=2", "train.resume=auto", "lora.rank=8"],
                                           capsys)
    # held-out rows come out of data.path: another eval_size trains other rows
    assert "different data.eval_size (2 there, 0 now)" in _error(["sft", config, "train.resume=auto"], capsys)
    assert "beyond the run's 1 steps (give it more: train.steps, or train.epochs)" in _error(
        ["sft", config, "data.eval_size=2", "train.resume=auto", "train.steps=1"], capsys)
    assert "no checkpoint folder" in _error(["sft", config, f"train.resume={tmp_path / 'nope'}"], capsys)
    assert "set train.output_dir to that run's folder" in _error(
        ["sft", config, "train.resume=auto", "train.output_dir=null"], capsys)
    rl = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "rl"),
                        **{"train.resume": str(out / "checkpoints" / "step-0000002")})
    assert "was written by rlora sft, not rlora train: resume it with rlora sft" in _error(["train", *rl], capsys)
    # a resume at the last step trains nothing and keeps the run as it was, its summary too
    summary = json.loads((out / "summary.json").read_text())
    before = _metrics(out)
    assert main(["sft", config, "data.eval_size=2", "train.resume=auto"]) == 0
    assert _metrics(out) == before
    after = json.loads((out / "summary.json").read_text())
    assert after["eval_loss"] == summary["eval_loss"] is not None and after["last_metrics"] == summary["last_metrics"]
    assert after["steps"] == 2
    shutil.rmtree(out / "checkpoints")
    capsys.readouterr()
    assert "holds a run but no checkpoint" in _error(["sft", config, "train.resume=auto"], capsys)


def test_a_resumed_rm_run_ends_where_the_straight_run_ends(tiny_model_dir, tmp_path, capsys):
    """rlora rm: 5 steps straight == 4 steps (checkpoints at 2 and 4), the step-4 checkpoint lost, resume from 2: the
    same reward adapter and score head, the same losses, accuracies and held-out metrics; an sft checkpoint and
    another margin are refused."""
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    common = ["lora.dropout=0.2", "data.eval_size=2", "train.eval_every=2", "train.checkpoint_every=2",
              "train.head_init_std=0.1"]

    def run(out, steps, *extra):
        return main(["rm", rm_config(tmp_path, tiny_model_dir, data, steps=steps, output_dir=str(out)), *common, *extra])

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run(straight, 5) == 0 and run(resumed, 4) == 0, capsys.readouterr().err
    assert {"adapter_config.json", "adapter_model.safetensors", "reward_model.json", "score_head.safetensors"} <= {
        p.name for p in (resumed / "checkpoints" / "step-0000002" / "reward_model").iterdir()}
    shutil.rmtree(resumed / "checkpoints" / "step-0000004")
    capsys.readouterr()
    assert "different train.margin (0.0 there, 0.5 now)" in _error(
        ["rm", rm_config(tmp_path, tiny_model_dir, data, steps=5, output_dir=str(resumed)), *common,
         "train.resume=auto", "train.margin=0.5"], capsys)
    assert run(resumed, 5, "train.resume=auto") == 0
    assert "resuming from" in capsys.readouterr().err
    for name in ("adapter_model.safetensors", "score_head.safetensors"):
        a, b = (load_file(str(out / "reward_model" / name)) for out in (straight, resumed))
        assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6, name
    rows = {out: _metrics(out) for out in (straight, resumed)}
    assert [r["step"] for r in rows[resumed]] == [1, 2, 3, 4, 5]
    for x, y in zip(rows[straight], rows[resumed], strict=True):
        assert x.keys() == y.keys()
        for key in x.keys() - {"step_s"}:
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-9), (x["step"], key)
    sft_data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    sft_run = tmp_path / "sft"
    assert main(["sft", sft_config(tmp_path, tiny_model_dir, sft_data, steps=1, checkpoint_every=1,
                                   output_dir=str(sft_run))]) == 0
    capsys.readouterr()
    assert "was written by rlora sft, not rlora rm" in _error(
        ["rm", rm_config(tmp_path, tiny_model_dir, data, steps=2, output_dir=str(tmp_path / "rm2")),
         f"train.resume={sft_run / 'checkpoints' / 'step-0000001'}"], capsys)
