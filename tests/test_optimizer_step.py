"""One optimizer step for every recipe: `rlora sft` and `rlora rm` skip an update whose gradient is not finite,
as `rlora train` does (they used to step on it and write NaN into the adapter)."""

import json

import pytest
import torch

from rlora.cli import main
from test_rm import PAIRS, rm_config
from test_sft import REPETITIVE, sft_config, write_jsonl


@pytest.mark.parametrize("command", ["sft", "rm"])
def test_a_non_finite_gradient_skips_the_update(command, tiny_model_dir, tmp_path, monkeypatch):
    """Step 2's gradient gets a NaN after its backward pass: its update is skipped (the trainable parameters
    before step 3 equal those before step 2, bit for bit), step 3 trains again, and the adapter stays finite."""
    import importlib

    module = importlib.import_module(f"rlora.train.{command}")
    original = module.backward_batch
    before_step: list[dict] = []

    def poisoned(model, *args, **kwargs):
        before_step.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
        out = original(model, *args, **kwargs)
        if len(before_step) == 2:
            next(p for p in model.parameters() if p.requires_grad and p.grad is not None).grad[0] = float("nan")
        return out

    monkeypatch.setattr(module, "backward_batch", poisoned)
    if command == "sft":
        config = sft_config(tmp_path, tiny_model_dir, write_jsonl(tmp_path / "rows.jsonl", REPETITIVE), steps=4)
    else:
        config = rm_config(tmp_path, tiny_model_dir, write_jsonl(tmp_path / "pairs.jsonl", PAIRS), steps=4)
    assert main([command, config]) == 0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped_update"] for m in metrics] == [0, 1, 0, 0]
    assert len(before_step) == 4
    for name, value in before_step[1].items():
        assert torch.equal(before_step[2][name], value), name  # the skipped step changed nothing
    assert any(not torch.equal(before_step[3][n], v) for n, v in before_step[2].items())  # step 3 trained
    assert all(torch.isfinite(v).all() for v in before_step[3].values())
