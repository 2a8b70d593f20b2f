"""K policies on one base in one run against K sequential single-policy runs, on the same work.

    flock /tmp/rlora-cpu.lock .venv/bin/python bench/policies.py [--k 2 4 8] [--steps 5] [--repeats 1] [key=value ...]

Each K trains K policies with the learning rates 1e-4 x (1, 2, ..., K) and seeds 0..K-1 (a learning-rate and seed
sweep) for --steps steps of the config (default: the demo, `rlora train` with no arguments; evaluation off):
- sequential: K `rlora train` processes one after another, policy k with train.lr and train.seed of its own;
- batched: one `rlora train` process with a `policies:` section listing the K policies.
Both sides sample the same prompts per step and train the same number of completions; with float32 sampling
(rollout.sampler_dtype=model) policy k even draws the same completions on both sides (tests/test_policies.py).
Reported per K: training time (summary.json's train_s, summed over the sequential runs), wall-clock of the
processes (model loading and data preparation included), the speed-up of the batched run in both, and the
median step phases. Each repeat runs batched then sequential; medians over repeats.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_common import output_folder, run_parser, step_phases

COMMON = ["eval.before=false", "eval.after=false", "train.sample_every=0", "log.plot=false", "train.overwrite=true"]


def lr_of(k: int) -> float:
    return 1e-4 * (k + 1)


def run(args: list[str], out: Path) -> dict:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "rlora", "train", *args, f"train.output_dir={out}", *COMMON],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"bench/policies.py: a run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": wall, "train_s": summary["train_s"], "steps": len(rows), "rows": rows}


def one_repeat(K: int, steps: int, overrides: list[str], folder: Path) -> dict:
    policies = "policies=[" + ", ".join(f"{{name: p{k}, lr: {lr_of(k)}, seed: {k}}}" for k in range(K)) + "]"
    batched = run([*overrides, f"train.steps={steps}", policies], folder / f"batched-{K}")
    sequential = [run([*overrides, f"train.steps={steps}", f"train.lr={lr_of(k)}", f"train.seed={k}"],
                      folder / f"single-{K}-{k}") for k in range(K)]
    return {
        "batched_train_s": batched["train_s"], "batched_wall_s": batched["wall_s"],
        "sequential_train_s": sum(r["train_s"] for r in sequential), "sequential_wall_s": sum(r["wall_s"] for r in sequential),
        "batched_phases": step_phases(batched["rows"]),
        "single_phases": {key: statistics.median(step_phases(r["rows"])[key] for r in sequential)
                          for key in step_phases(sequential[0]["rows"])},
    }


def main() -> None:
    parser = run_parser(__doc__, steps=5, repeats=1)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    args, overrides = parser.parse_known_args()
    folder = output_folder(args.out, "rlora-policies-")
    report = {"overrides": overrides, "steps": args.steps, "repeats": args.repeats, "k": {}}
    for K in args.k:
        repeats = [one_repeat(K, args.steps, overrides, folder) for _ in range(args.repeats)]
        median = {key: statistics.median(r[key] for r in repeats) for key in
                  ("batched_train_s", "batched_wall_s", "sequential_train_s", "sequential_wall_s")}
        median["train_speedup"] = median["sequential_train_s"] / median["batched_train_s"]
        median["wall_speedup"] = median["sequential_wall_s"] / median["batched_wall_s"]
        report["k"][K] = {**median, "repeats": repeats}
        print(f"K={K}: training {median['sequential_train_s']:.1f} s sequential vs {median['batched_train_s']:.1f} s "
              f"batched ({median['train_speedup']:.2f}x); wall-clock {median['sequential_wall_s']:.1f} s vs "
              f"{median['batched_wall_s']:.1f} s ({median['wall_speedup']:.2f}x)", flush=True)
        for label, key in (("batched step", "batched_phases"), ("single step", "single_phases")):
            p = repeats[0][key]
            print(f"  {label}: " + "  ".join(f"{name} {value:.2f}" for name, value in p.items()), flush=True)
    (folder / "report.json").write_text(json.dumps(report, indent=1))
    print(f"report: {folder / 'report.json'}")


if __name__ == "__main__":
    main()
