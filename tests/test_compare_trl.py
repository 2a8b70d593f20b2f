"""The TRL comparison harness end to end on the tiny model, one step per side (slow: needs TRL installed)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_both_sides_do_the_same_work(tiny_model_dir, tmp_path):
    pytest.importorskip("trl")
    sys.path.insert(0, str(ROOT / "bench"))
    from compare_trl import Work, compare_one

    work = Work(model=tiny_model_dir, completion_len=8, num_generations=4, beta=0.04, prompts_per_step=2,
                micro_batch_size=4, steps=1, warmup=0, train_size=64)
    summary = compare_one(work, repeats=1)
    rlora, trl = summary["rlora"]["same_work"], summary["trl"]["same_work"]
    assert rlora == trl
    assert rlora["prompts"] == 2 and rlora["completions"] == 8 and rlora["completion_tokens"] == 8 * 8
    assert rlora["lora_params"] > 0 and rlora["prompt_tokens"] > 0
    assert summary["rlora"]["trained_frac"] == 1.0  # beta > 0: the KL term gives every row a gradient, none skipped
    for side in ("rlora", "trl"):
        assert summary[side]["step_s"] > 0 and summary[side]["rollout_s"] > 0 and summary[side]["ref_s"] > 0
        assert summary[side]["peak_rss_mb"] > 100


def test_cli_prints_a_table_row(tiny_model_dir):
    pytest.importorskip("trl")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "compare_trl.py"), "timing", "--models", tiny_model_dir,
                           "--lengths", "8", "--gens", "4", "--betas", "0", "--steps", "1", "--warmup", "0",
                           "--repeats", "1", "--micro-batch-size", "8", "--train-size", "64"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(f"| {tiny_model_dir} |")]
    assert len(rows) == 1 and "work differs" not in done.stdout


def test_one_update_has_trl_gradient(tiny_model_dir):
    """rlora's GRPO update (the demo's settings) and TRL's compute_loss on one identical batch with completions of
    different lengths: the same advantages, loss and LoRA gradient (bench/trl_grad_parity.py)."""
    pytest.importorskip("trl")
    sys.path.insert(0, str(ROOT / "bench"))
    from trl_grad_parity import parity_report

    report = parity_report(tiny_model_dir, seed=0, lora_b_std=0.01)
    assert len(set(report["completion_lengths"])) > 1  # token mean and sequence mean would differ
    assert report["advantages_max_abs_diff"] < 1e-5
    assert report["loss_rlora"] == pytest.approx(report["loss_trl"], abs=1e-6)
    assert report["loss_rlora"] == pytest.approx(report["loss_expected"], abs=1e-6)
    for kind in ("lora_A", "lora_B"):
        grad = report["grad"][kind]
        assert grad["norm_trl"] > 0
        assert grad["cosine"] > 1 - 1e-6
        assert grad["norm_ratio_rlora_over_trl"] == pytest.approx(1.0, abs=1e-5)
