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
