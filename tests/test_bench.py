import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_role_memory_bench_holds_one_base_against_four(tiny_model_dir, tmp_path):
    out = tmp_path / "roles.json"
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))  # this checkout's rlora
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "role_memory.py"), "--model", tiny_model_dir,
                           "--repeats", "1", "--rows", "4", "--prompt-tokens", "6", "--completion-tokens", "5",
                           "--rank", "4", "--json", str(out)], capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())
    one, separate = summary["one_base"], summary["separate"]
    for run in (one, separate):
        assert 0 < run["peak_rss_before_load_mb"] <= run["peak_rss_after_load_mb"] <= run["peak_rss_after_work_mb"]
    # every role on one base: one model object, each base weight once; separate: four bases
    assert (one["models"], one["base_copies"]) == (1, 1.0)
    assert (separate["models"], separate["base_copies"]) == (4, 4.0)
    # the same work: the reference log-probs and reward scores come from the same weights and tokens
    assert one["ref_logp_sum"] == pytest.approx(separate["ref_logp_sum"], rel=1e-5)
    assert one["reward_sum"] == pytest.approx(separate["reward_sum"], rel=1e-4, abs=1e-6)
    assert one["reward_sum"] != 0.0, "a head of zeros would score every sequence 0 in both layouts"
    assert summary["ratio"]["peak_rss_after_work_mb"] == pytest.approx(
        one["peak_rss_after_work_mb"] / separate["peak_rss_after_work_mb"])
    assert "peak_rss_after_load" in done.stdout
