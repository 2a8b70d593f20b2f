import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]


def test_step_phases_bench_prints_every_phase(tiny_model_dir, prompts_file, tmp_path):
    args = [a for a in tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o")) if not a.startswith("train.output_dir")]
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "step_phases.py"), *args, "algo.beta=0.04",
                           "--steps", "2", "--warmup", "1"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    assert done.returncode == 0, done.stderr
    for phase in ("rollout_s", "ref_s", "old_s", "train_s", "step_s"):
        line = next(l for l in done.stdout.splitlines() if l.startswith(phase))
        assert float(line.split()[1]) >= 0.0
    ref = float(next(l for l in done.stdout.splitlines() if l.startswith("ref_s")).split()[1])
    assert ref > 0.0, "beta > 0 must compute reference log-probs"


def test_policies_bench_reports_both_sides(tiny_model_dir, prompts_file, tmp_path):
    args = [a for a in tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o")) if not a.startswith("train.output_dir")]
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "policies.py"), "--k", "2", "--steps", "2", "--out",
                           str(tmp_path / "bench"), *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "bench" / "report.json").read_text())
    two = report["k"]["2"]
    assert two["batched_train_s"] > 0 and two["sequential_train_s"] > 0
    assert two["train_speedup"] == two["sequential_train_s"] / two["batched_train_s"]
    # both sides trained the same steps: one batched run with both policies, two single runs
    assert sorted(p.name for p in (tmp_path / "bench" / "batched-2" / "policies").iterdir()) == ["p0", "p1"]
    assert all((tmp_path / "bench" / f"single-2-{k}" / "adapter").is_dir() for k in range(2))
    assert "K=2: training" in done.stdout

def test_molora_tasks_bench_reports_routing_per_task(tiny_model_dir, tmp_path):
    out = tmp_path / "molora"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "molora_tasks.py"), "--model", tiny_model_dir,
                           "--train", "4", "--held-out", "3", "--steps", "2", "--batch", "4", "--lr", "0.01",
                           "--threads", "1", "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["tasks"] == ["basic_arithmetic", "leg_counting"] and report["held_out_rows"] == 6
    assert math.isfinite(report["eval_loss_before"]) and math.isfinite(report["eval_loss_after"])
    for label in ("before", "after"):
        r = report[label]
        for task in report["tasks"]:
            gates = r["mean_gate_per_expert"][task]
            assert len(gates) == 4 and abs(sum(gates) - 1.0) < 1e-3  # each prompt's gates sum to 1
            assert sorted(r["per_layer"][task]) == ["0", "1"]
        assert 0.0 <= r["separation_tv_mean"] <= r["separation_tv_max"] <= 1.0
        assert 0.0 <= r["top_expert_differs_frac"] <= 1.0 and 0.0 <= r["within_task_tv_mean"] <= 1.0
    assert report["before"]["mean_gate_per_expert"] != report["after"]["mean_gate_per_expert"], "routers trained"


def test_molora_tasks_gates_are_top_k_per_prompt(tiny_model_dir):
    sys.path.insert(0, str(ROOT / "bench"))
    from molora_tasks import gates_per_module, routing_report

    from rlora.config import ModelConfig, MoLoRAConfig
    from rlora.models import molora as ml
    from rlora.models.loading import load_base_model

    model = load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir)
    ml.attach_molora(model, MoLoRAConfig(num_experts=4, top_k=2, router="sequence", rank=4))
    prompts = [[5, 6, 7], [8, 9], [30, 31, 32, 33], [40]]
    names, gates_MNE = gates_per_module(model, prompts)
    assert gates_MNE.shape == (len(names), 4, 4)
    assert torch.allclose(gates_MNE.sum(-1), torch.ones(len(names), 4))
    assert ((gates_MNE > 0).sum(-1) == 2).all()
    same = routing_report(model, {"a": prompts, "b": prompts})  # one task under two names: routed alike
    assert same["separation_tv_max"] == 0.0 and same["top_expert_differs_frac"] == 0.0
    assert 0.0 < same["within_task_tv_mean"] <= 1.0  # prompts 0, 2 vs 1, 3 are routed differently
