import subprocess
import sys
from pathlib import Path

from conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]


def test_step_phases_bench_prints_every_phase(tiny_model_dir, prompts_file, tmp_path):
    args = [a for a in tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o")) if not a.startswith("train.output_dir")]
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "step_phases.py"), *args, "algo.beta=0.04",
                           "--steps", "2", "--warmup", "1"], capture_output=True, text=True, cwd=ROOT,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "tests")})
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
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "tests")})
    assert done.returncode == 0, done.stderr
    report = __import__("json").loads((tmp_path / "bench" / "report.json").read_text())
    two = report["k"]["2"]
    assert two["batched_train_s"] > 0 and two["sequential_train_s"] > 0
    assert two["train_speedup"] == two["sequential_train_s"] / two["batched_train_s"]
    # both sides trained the same steps: one batched run with both policies, two single runs
    assert sorted(p.name for p in (tmp_path / "bench" / "batched-2" / "policies").iterdir()) == ["p0", "p1"]
    assert all((tmp_path / "bench" / f"single-2-{k}" / "adapter").is_dir() for k in range(2))
    assert "K=2: training" in done.stdout
