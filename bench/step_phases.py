"""Per-phase time of a GRPO step for a given config: rollout, reward, reference log-probs, old log-probs,
train (forward + backward + optimiser), as medians over the measured steps after warm-up.

    .venv/bin/python bench/step_phases.py [CONFIG.yaml] [key=value ...] [--steps 5] [--warmup 1]

With no config it measures the embedded demo config. Evaluation is switched off; the run folder goes to a
temporary directory unless train.output_dir is given.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from rlora.logging.console import quiet_libraries
from rlora.config import load_config
from rlora.errors import UserError
from rlora.train.grpo import run_grpo

PHASES = ("rollout_s", "reward_s", "ref_s", "old_s", "train_s", "optim_s", "step_s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("items", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    parser.add_argument("--steps", type=int, default=5, help="measured steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=1, help="steps run first and not counted")
    args = parser.parse_args()
    quiet_libraries()
    config_path = args.items[0] if args.items and "=" not in args.items[0] else None
    overrides = [i for i in args.items if "=" in i]
    total = args.steps + args.warmup
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"train.output_dir={Path(tmp) / 'run'}", "eval.before=false", "eval.after=false",
                     "train.sample_every=0", *overrides, f"train.steps={total}"]
        try:
            cfg = load_config(config_path, overrides)
            run_grpo(cfg)
        except UserError as err:
            print(f"step_phases: error: {err}", file=sys.stderr)
            return 2
        rows = [json.loads(line) for line in (Path(cfg.train.output_dir) / "metrics.jsonl").read_text().splitlines()]
    measured = rows[args.warmup:]
    print(f"# GRPO step phases: {cfg.model.path}, P={cfg.train.prompts_per_step} G={cfg.rollout.num_generations} "
          f"max_new_tokens={cfg.rollout.max_new_tokens} beta={cfg.algo.beta} mu={cfg.algo.num_iterations}")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"{len(measured)} measured steps after {args.warmup} warm-up")
    print(f"{'phase':<10} {'median s':>9} {'min s':>8} {'max s':>8} {'share':>6}  (share: phase median / step median)")
    step_median = statistics.median(r["step_s"] for r in measured)
    for phase in PHASES:
        values = [r[phase] for r in measured]
        med = statistics.median(values)
        print(f"{phase:<10} {med:9.3f} {min(values):8.3f} {max(values):8.3f} {med / step_median:6.1%}")
    tokens = statistics.median(r["gen_tokens"] / r["rollout_s"] for r in measured)
    print(f"sampling throughput: {tokens:.1f} completion tokens/s (tokens up to EOS, median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
