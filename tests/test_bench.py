import json
import math
import os
import re
import runpy
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class _Done:
    returncode: int
    stdout: str
    stderr: str


def _bench(script: str, args: list[str], capsys) -> _Done:
    """bench/SCRIPT with these arguments, run as __main__ in this process with its output captured: the
    interpreter's start-up (~7 s of imports on a 2-core CPU) is paid once per test worker, not once per bench.
    argv, sys.path, the working folder and torch's thread count are put back afterwards; only for a bench that
    leaves rlora's modules as it found them (packed_groups.py replaces module functions: a process of its own)."""
    argv, path, cwd, threads = sys.argv, list(sys.path), os.getcwd(), torch.get_num_threads()
    sys.argv = [str(ROOT / "bench" / script), *args]
    sys.path.insert(0, str(ROOT / "bench"))  # bench_common, as when the script runs itself
    os.chdir(ROOT)
    capsys.readouterr()
    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.argv, sys.path[:] = argv, path
        os.chdir(cwd)
        torch.set_num_threads(threads)
    out = capsys.readouterr()
    return _Done(code, out.out, out.err)


def test_sampler_bench_times_plain_generate_and_the_fallback_beside_the_engine(tiny_model_dir, capsys):
    """bench/sampler.py's baseline `hf` is plain generate (its own sampling), `hf-draw` rlora's fallback: both time the
    same work as the engine (the same number of tokens, EOS held off), ragged lengths too."""
    for extra in ([], ["--ragged", "3,6"]):
        done = _bench("sampler.py", ["--model", tiny_model_dir, "--prompts", "2", "--G", "2", "--tokens", "6",
                                     "--repeats", "1", "--sides", "builtin,hf,hf-draw", *extra], capsys)
        assert done.returncode == 0, done.stderr[-2000:]
        rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()
                if line.split() and line.split()[0] in ("builtin", "hf", "hf-draw")}
        assert set(rows) == {"builtin", "hf", "hf-draw"}
        assert len({row[3] for row in rows.values()}) == 1  # the same token count on every side
        assert rows["hf"][5] == "1.00x"


def test_step_phases_bench_prints_every_phase(tiny_model_dir, prompts_file, tmp_path, capsys):
    args = [a for a in tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o")) if not a.startswith("train.output_dir")]
    done = _bench("step_phases.py", [*args, "algo.beta=0.04", "--steps", "2", "--warmup", "1"], capsys)
    assert done.returncode == 0, done.stderr
    for phase in ("rollout_s", "ref_s", "old_s", "train_s", "step_s"):
        line = next(l for l in done.stdout.splitlines() if l.startswith(phase))
        assert float(line.split()[1]) >= 0.0
    ref = float(next(l for l in done.stdout.splitlines() if l.startswith("ref_s")).split()[1])
    assert ref > 0.0, "beta > 0 must compute reference log-probs"


def _train_bench(script: str, options: list[str], tiny_model_dir, prompts_file, tmp_path):
    """Run bench/SCRIPT on the tiny model's config (its runs and report.json in tmp_path/bench) -> (process, report)."""
    args = [a for a in tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o")) if not a.startswith("train.output_dir")]
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *options, "--out", str(tmp_path / "bench"),
                           *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    assert done.returncode == 0, done.stderr
    return done, json.loads((tmp_path / "bench" / "report.json").read_text())


@pytest.mark.slow  # 35-70 s of torchrun/subprocess runs: scripts/test.sh --slow
def test_policies_bench_reports_both_sides(tiny_model_dir, prompts_file, tmp_path):
    done, report = _train_bench("policies.py", ["--k", "2", "--steps", "2"], tiny_model_dir, prompts_file, tmp_path)
    two = report["k"]["2"]
    assert two["batched_train_s"] > 0 and two["sequential_train_s"] > 0
    assert two["train_speedup"] == two["sequential_train_s"] / two["batched_train_s"]
    # both sides trained the same steps: one batched run with both policies, two single runs
    assert sorted(p.name for p in (tmp_path / "bench" / "batched-2" / "policies").iterdir()) == ["p0", "p1"]
    assert all((tmp_path / "bench" / f"single-2-{k}" / "adapter").is_dir() for k in range(2))
    assert "K=2: training" in done.stdout


@pytest.mark.slow  # 35-70 s of torchrun/subprocess runs: scripts/test.sh --slow
def test_fsdp_bench_runs_every_layout(tiny_model_dir, prompts_file, tmp_path):
    done, report = _train_bench("fsdp.py", ["--steps", "2", "--repeats", "1"], tiny_model_dir, prompts_file, tmp_path)
    assert list(report["median"]) == ["data_parallel", "fsdp_model", "fsdp_layer", "fsdp_layer_unmerged"]
    assert all(m["rollout_s"] > 0 and m["train_s"] > 0 for m in report["median"].values())
    config = (tmp_path / "bench" / "fsdp_layer_unmerged-0" / "config.yaml").read_text()
    assert "fsdp_gather: layer" in config and "merge_adapter: false" in config
    assert "fsdp_layer_unmerged: step" in done.stdout


def test_molora_tasks_bench_reports_routing_per_task(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "molora"
    done = _bench("molora_tasks.py", ["--model", tiny_model_dir, "--train", "4", "--held-out", "3", "--steps", "2",
                                      "--batch", "4", "--lr", "0.01", "--threads", "1", "--out", str(out)], capsys)
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


@pytest.mark.slow  # 35-70 s of torchrun/subprocess runs: scripts/test.sh --slow
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


def test_episodes_bench_times_both_ways_of_continuing(tiny_model_dir, capsys):
    done = _bench("episodes.py", ["--prompts", "1", "--generations", "2", "--repeats", "1", f"model.path={tiny_model_dir}",
                                  "data.eval_size=2", "rollout.max_new_tokens=6"], capsys)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("continued") for line in lines) and any(line.startswith("history") for line in lines)
    assert float(lines[-1].split()[-1].rstrip("x")) > 0


def test_serve_batching_bench_times_both_ways_of_both_kinds(tiny_model_dir, capsys):
    done = _bench("serve_batching.py", ["--model", str(tiny_model_dir), "--clients", "2", "--data", "2", "--tokens", "8",
                                        "--rank", "2", "--repeats", "1", "--sample-requests", "3", "--samples", "2",
                                        "--prompt-tokens", "5", "--max-tokens", "3", "--snapshot-switch"], capsys)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for way in ("sequential", "batched", "sample sequential", "sample batched", "switch, packs", "switch, merged"):
        [seconds] = [re.match(rf"{way} +([0-9.]+) s ", line) for line in lines if re.match(rf"{way} +[0-9]", line)]
        assert float(seconds.group(1)) > 0, way
    ratios = [line for line in lines if "sequential / batched" in line]
    assert len(ratios) == 2 and all(float(line.split()[-1].rstrip("x")) > 0 for line in ratios)
    [switch] = [line for line in lines if line.startswith("after a snapshot switch, packs / merged copies:")]
    assert float(switch.split()[-3].rstrip("x")) > 0


def test_sft_output_layer_bench_times_both_ways_at_the_same_loss(tiny_model_dir, capsys):
    done = _bench("sft_output_layer.py", ["--model", str(tiny_model_dir), "--rows", "3", "--micro", "2", "--rank", "2",
                                          "--repeats", "1"], capsys)
    assert done.returncode == 0, done.stderr
    lines = {line.split("  ")[0]: line for line in done.stdout.splitlines() if " s   loss " in line}
    assert set(lines) == {"full logits", "labelled positions"}
    losses = [float(line.split("loss")[1].split()[0]) for line in lines.values()]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and losses[0] > 0
    assert float(done.stdout.splitlines()[-1].split()[3].rstrip("x")) > 0  # "labelled / full: 0.82x the time"


def test_packed_groups_bench_times_every_side_on_the_same_gradient(tiny_model_dir):
    # its own process: --force and the sides replace packed_groups' functions for the run
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "packed_groups.py"), "--model", str(tiny_model_dir),
                           "--prompt", "6", "--lengths", "2,9", "--G", "4", "--repeats", "1", "--force", "--dense",
                           "--unshared"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    assert done.returncode == 0, done.stderr
    timed = [line for line in done.stdout.splitlines() if " s  (" in line]
    assert [line[:24].strip() for line in timed] == ["packed groups", "padded (shared prompts)", "packed, dense mask",
                                                     "unshared (each row)"]
    ratios = [line for line in done.stdout.splitlines() if " / padded: " in line]
    assert len(ratios) == 3 and all(float(line.split("cosine ")[1].split(",")[0]) > 1 - 1e-6 for line in ratios)


def test_trl_quality_summarises_reward_quarters_and_seed_medians():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from trl_quality import medians, quarter_means

    assert quarter_means([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]) == (0.5, 6.5)  # two steps per quarter
    assert quarter_means([0.25, 0.5, 1.0]) == (0.25, 1.0)  # fewer than 4 steps: one step each
    assert quarter_means([]) == (None, None)
    # reward_last_quarter None on every run: a number no run has
    rows = [{"side": side, "steps": 12, "accuracy": acc, "reward_first_quarter": acc / 2, "reward_last_quarter": None,
             "train_s": 10.0} for side, acc in (("rlora", 0.5), ("rlora", 0.7), ("rlora", 0.6), ("trl", 0.4))]
    summary = medians(rows)
    assert summary["rlora"]["accuracy"] == 0.6 and summary["rlora"]["reward_first_quarter"] == 0.3
    assert summary["trl"]["accuracy"] == 0.4 and summary["rlora"]["reward_last_quarter"] is None


def test_the_trl_comparison_shapes_both_sides_alike():
    """bench/compare_trl.py --closeness-weight: both sides get the same functions and weights, and the shaping scores
    TRL's message completions as rlora's text ones."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_common import answer_reward, closeness, reward_setup, rlora_rewards
    from rlora.config import RewardSpec
    from rlora.rewards.scoring import resolve_rewards

    assert reward_setup(0.0) == ([answer_reward], [1.0])
    assert reward_setup(0.1) == ([answer_reward, closeness], [1.0, 0.1])  # what TRL's side is given
    resolved = resolve_rewards([RewardSpec(**spec) for spec in rlora_rewards(0.1)], has_task=False)  # rlora's side
    assert [(r.fn, r.weight) for r in resolved] == [(answer_reward, 1.0), (closeness, 0.1)]
    text = ["4 - 9 = -4", "4 - 9 = -5", "4 - 9 = 5"]
    messages = [[{"role": "assistant", "content": c}] for c in text]
    expected = [pytest.approx(0.8, abs=1e-12), 1.0, 0.0]  # 1 - 1/5; exact; the wrong sign
    assert closeness(["q"] * 3, text, answer=["-5"] * 3) == expected
    assert closeness(["q"] * 3, messages, answer=["-5"] * 3) == expected


def test_a_snapshot_switch_way_leaves_the_server_as_it_found_it():
    """bench/serve_batching.py --snapshot-switch: each way samples from a dropped decoder with packs on or off, and
    puts the kept decoder and the packs setting back, also when sampling fails."""
    sys.path.insert(0, str(ROOT / "bench"))
    from types import SimpleNamespace

    from serve_batching import _after_a_snapshot_switch

    seen = []

    def sample(session, bodies):
        seen.append((worker.view, worker.packer.onednn))
        if session == "fails":
            raise RuntimeError("sampling failed")
        return ["ok"]

    worker = SimpleNamespace(view="kept decoder", packer=SimpleNamespace(onednn=True), sample=sample)
    assert _after_a_snapshot_switch(worker, "s", [], packs=False) == ["ok"]
    assert _after_a_snapshot_switch(worker, "s", [], packs=True) == ["ok"]
    with pytest.raises(RuntimeError):
        _after_a_snapshot_switch(worker, "fails", [], packs=False)
    assert seen == [(None, False), (None, True), (None, False)]
    assert worker.view == "kept decoder" and worker.packer.onednn is True
