"""train.fsdp on CPU (gloo): 2 ranks with the base's decoder layers sharded == 2 ranks without (which
tests/test_distributed.py compares with 1 rank); the combinations it refuses are one line each."""

import json

import pytest
from safetensors.torch import load_file

from conftest import tiny_overrides
from rlora.cli import main
from rlora.config import load_config
from rlora.errors import UserError
from rlora.train.distributed import World
from rlora.train.fsdp import check_fsdp
from test_distributed import _run


def test_sharded_base_trains_and_samples_like_data_parallel(tiny_model_dir, prompts_file, tmp_path):
    """Rank 0's only group is flat (flat_for_zero, no KL): it trains no row while rank 1 trains four, so rank 0
    pads with zero passes. Also on: the frozen layer 0 computed once (top_layers=1, old log-probs for 2
    iterations), gradient checkpointing, evaluation before/after (rank 0, on the gathered base), checkpoints:
    the sharded run stops after 2 steps and resumes for the 3rd; the unsharded one runs 3 straight."""
    common = {"rewards": "[{fn: rewards_for_tests.flat_for_zero}]", "data.shuffle": "false", "lora.top_layers": 1,
              "algo.num_iterations": 2, "train.gradient_checkpointing": "true", "train.checkpoint_every": 1,
              "train.micro_batch_size": 2, "train.lr": 0.05, "train.threads": 1}
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    for out, steps, extra in ((plain, 3, {}), (sharded, 2, {"train.fsdp": "true"}),
                              (sharded, 3, {"train.fsdp": "true", "train.resume": "auto"})):
        args = tiny_overrides(tiny_model_dir, prompts_file, str(out), **common, **extra, **{"train.steps": steps})
        done = _run(2, args)
        assert done.returncode == 0, done.stderr[-3000:]
        sharded_note = "train.fsdp: 2 decoder layers sharded over 2 ranks" in done.stderr
        assert sharded_note == (out == sharded), done.stderr[-3000:]
    assert "resuming from" in done.stderr
    one, two = (load_file(str(out / "adapter" / "adapter_model.safetensors")) for out in (plain, sharded))
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
    assert any(float(v.abs().max()) > 0 for k, v in two.items() if "lora_B" in k)  # the adapter did move
    samples = {out: [(json.loads(s)["prompt"], json.loads(s)["completion"])
                     for s in (out / "samples.jsonl").read_text().splitlines()] for out in (plain, sharded)}
    assert samples[plain] == samples[sharded] and len(samples[sharded]) == 3 * 2 * 4
    rows = [json.loads(line) for line in (sharded / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["trained_frac"] == 0.5
    assert all(r["adapter_rank_divergence"] == 0.0 for r in rows)
    evals = {out: json.loads((out / "eval.json").read_text()) for out in (plain, sharded)}
    assert evals[plain] == evals[sharded]


def test_fsdp_in_one_process_is_one_line(tiny_model_dir, prompts_file, tmp_path, capsys):
    code = main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"), **{"train.fsdp": "true"})])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "rlora: error: train.fsdp shards the base across" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("override, message", [
    ("model.quantization=4bit", "does not shard a quantized base"),
    ("algo.dynamic_sampling=true", "algo.dynamic_sampling and algo.adaptive resample per rank"),
    ("algo.adaptive.enabled=true", "algo.dynamic_sampling and algo.adaptive resample per rank"),
    ("rewards=[{fn: reward_model, args: {path: rm}}]", "does not support rewards fn: reward_model"),
])
def test_unsupported_combinations_are_refused(override, message):
    cfg = load_config(None, ["train.fsdp=true", override])
    with pytest.raises(UserError, match=message):
        check_fsdp(cfg, World(0, 2))
    check_fsdp(load_config(None, ["train.fsdp=true"]), World(1, 2))  # the switch alone is fine under torchrun
