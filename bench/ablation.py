"""Algorithm ablation on the demo task at equal wall-clock: each algorithm trains the demo config for the same
training-time budget (train.max_time_s), then the same 100 held-out problems are evaluated greedily.

    .venv/bin/python bench/ablation.py [--algos grpo,dr_grpo,dapo,adaptive_grpo] [--budget-s 100] [--seeds 0]
                                       [key=value ...]

Each run is its own process (one after another, never in parallel: these machines have 2 cores). Reported
per run: steps reached, held-out accuracy after training, the mean fraction of zero-variance groups in the
batch that was trained (frac_groups_zero_std) and at first sampling (frac_zero_var_first), sampling rounds
and resamples per step. The accuracy before training is the same for every run (same model, same greedy
evaluation) and is measured once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_one(algo: str, seed: int, budget_s: float, eval_before: bool, overrides: list[str], folder: Path) -> dict:
    out = folder / f"{algo}-seed{seed}"
    cmd = [sys.executable, "-m", "rlora", "train", f"algo.name={algo}", f"train.seed={seed}", "train.steps=100000",
           f"train.max_time_s={budget_s}", f"eval.before={str(eval_before).lower()}", "train.sample_every=0",
           f"train.output_dir={out}", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"ablation: {algo} seed {seed} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = json.loads((out / "eval.json").read_text())
    summary = json.loads((out / "summary.json").read_text())

    def mean(key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.fmean(values) if values else None

    return {"algo": algo, "seed": seed, "steps": len(rows), "train_s": summary["train_s"],
            "before": evals["before"]["accuracy"] if evals.get("before") else None,
            "after": evals["after"]["accuracy"], "zero_std_trained": mean("frac_groups_zero_std"),
            "zero_var_first": mean("frac_zero_var_first"), "rounds": mean("sampling_rounds"),
            "resamples": mean("resamples"), "groups": sum(r.get("groups_sampled", 0) for r in rows)}


def fmt(value, spec=".2f") -> str:
    return "-" if value is None else format(value, spec)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="key=value applied to every run")
    parser.add_argument("--algos", default="grpo,dr_grpo,dapo,adaptive_grpo")
    parser.add_argument("--budget-s", type=float, default=100.0, help="training time per run (seconds)")
    parser.add_argument("--seeds", default="0", help="comma-separated train.seed values")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
            for j, algo in enumerate(args.algos.split(",")):
                result = run_one(algo, seed, args.budget_s, i == 0 and j == 0, args.overrides, Path(tmp))
                results.append(result)
                print(json.dumps(result), flush=True)
    before = next(r["before"] for r in results if r["before"] is not None)
    print(f"\n# demo task, {args.budget_s:.0f} s of training each, held-out accuracy before training {before:.2f}")
    print("| algorithm | seed | steps | groups sampled | held-out after | zero-var groups at sampling | "
          "zero-var groups trained | sampling rounds/step | resamples/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['algo']} | {r['seed']} | {r['steps']} | {r['groups']} | {r['after']:.2f} | "
              f"{fmt(r['zero_var_first'])} | {fmt(r['zero_std_trained'])} | {fmt(r['rounds'])} | {fmt(r['resamples'])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
