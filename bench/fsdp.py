"""What sharding the base costs: `rlora train` under torchrun with the base whole on every rank (data parallel),
sharded and gathered whole for sampling (train.fsdp, fsdp_gather=model), and sharded and streamed layer by
layer through the sampler (fsdp_gather=layer, with the LoRA merged into fresh weights per layer and pass, and
applied unmerged). Same config, same seeds: all four sample and train the same rows.

    flock /tmp/rlora-cpu.lock .venv/bin/python bench/fsdp.py [--nproc 2] [--steps 4] [--repeats 3] [key=value ...]

Default config: the demo (SmolLM2-135M) with evaluation off and 2 prompts x 4 samples per rank per step. Reported
per layout: the median over steps (the first left out) of each step phase, medians over repeats, and the
ratio of its sampling time (rollout_s) and step time to data parallel's. Repeats run the layouts in turn.
On a CPU with gloo the all-gathers are memory copies between processes: the ratios say what the extra
work costs here, not what NCCL on GPUs costs.
"""

from __future__ import annotations

import os
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench_common import STEP_PHASES, output_folder, run_parser, step_phases

COMMON = ["eval.before=false", "eval.after=false", "train.sample_every=0", "log.plot=false", "train.overwrite=true",
          "train.prompts_per_step=2", "train.threads=1"]
LAYOUTS = {
    "data_parallel": [],
    "fsdp_model": ["train.fsdp=true"],
    "fsdp_layer": ["train.fsdp=true", "train.fsdp_gather=layer"],
    "fsdp_layer_unmerged": ["train.fsdp=true", "train.fsdp_gather=layer", "rollout.merge_adapter=false"],
}


def run(nproc: int, args: list[str], out: Path) -> dict:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    done = subprocess.run([*launcher, "-m", "rlora", "train", *args, f"train.output_dir={out}", *COMMON],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"bench/fsdp.py: a run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return step_phases([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])


def main() -> None:
    parser = run_parser(__doc__, steps=4, repeats=3)
    parser.add_argument("--nproc", type=int, default=2)
    args, overrides = parser.parse_known_args()
    folder = output_folder(args.out, "rlora-fsdp-")
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    for repeat in range(args.repeats):
        for name, layout in LAYOUTS.items():
            phases = run(args.nproc, [*overrides, *layout, f"train.steps={args.steps}"], folder / f"{name}-{repeat}")
            runs[name].append(phases)
            print(f"repeat {repeat} {name}: " + "  ".join(f"{k} {v:.2f}" for k, v in phases.items()), flush=True)
    median = {name: {k: statistics.median(r[k] for r in rs) for k in STEP_PHASES} for name, rs in runs.items()}
    base = median["data_parallel"]
    for name, m in median.items():
        print(f"{name:>20}: step {m['step_s']:.2f} s ({m['step_s'] / base['step_s']:.2f}x)  sampling "
              f"{m['rollout_s']:.2f} s ({m['rollout_s'] / base['rollout_s']:.2f}x)  ref {m['ref_s']:.2f}  "
              f"train {m['train_s']:.2f}")
    report = {"nproc": args.nproc, "steps": args.steps, "repeats": args.repeats, "overrides": overrides,
              "median": median, "runs": runs}
    (folder / "report.json").write_text(json.dumps(report, indent=1))
    print(f"report: {folder / 'report.json'}")


if __name__ == "__main__":
    main()
