"""`compare_trl.py quality`: does rlora learn as much per step as TRL? Both sides train SmolLM2 on the demo task
(chain_sum, 2 prompts x 8 samples, temperature 0.7, 48 tokens, lr 2e-4) once per seed, for a fixed number of
optimizer steps (--steps) or a training-time budget (--budget-s); one evaluator (eval_adapters.py) then scores
the base model and every adapter greedily on the same held-out problems.

A seed sets both sides' LoRA init and sampling (rlora: train.seed; TRL: GRPOConfig.seed, which seeds before peft
builds the adapter); the prompts per step do not depend on it (both take the training rows in file order), so
seeds differ only in the randomness of training. Per seed and side: steps, held-out accuracy, and the mean
training reward of the first and last quarter of the steps (how fast the reward rose); then medians over seeds.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

SIDES = ("rlora", "trl")


def quarter_means(rewards: list[float]) -> tuple[float | None, float | None]:
    """Mean per-step reward over the first and the last quarter of the steps (at least one step each)."""
    if not rewards:
        return None, None
    quarter = max(1, len(rewards) // 4)
    return statistics.mean(rewards[:quarter]), statistics.mean(rewards[-quarter:])


def run_row(seed: int, side: str, result: dict, accuracy: float) -> dict:
    first, last = quarter_means(result["rewards"])
    return {"seed": seed, "side": side, "steps": len(result["steps"]), "accuracy": accuracy,
            "reward_first_quarter": first, "reward_last_quarter": last, "rewards": result["rewards"],
            "train_s": sum(s["step_s"] for s in result["steps"])}


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def medians(rows: list[dict]) -> dict[str, dict]:
    """Per side, the median over seeds of each number of run_row (None where no run has it: no steps)."""
    keys = ("steps", "accuracy", "reward_first_quarter", "reward_last_quarter", "train_s")
    return {side: {k: median_or_none([r[k] for r in rows if r["side"] == side and r[k] is not None]) for k in keys}
            for side in SIDES if any(r["side"] == side for r in rows)}


def print_table(rows: list[dict], base: float, limit: str) -> None:
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    print(f"| seed | side | steps ({limit}) | training s | reward mean, first quarter | last quarter "
          f"| held-out accuracy (base {base:.2f}) |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['side']} | {r['steps']} | {r['train_s']:.0f} | {fmt(r['reward_first_quarter'])} "
              f"| {fmt(r['reward_last_quarter'])} | {r['accuracy']:.2f} |")
    for side, m in medians(rows).items():
        print(f"| median | {side} | {m['steps']:g} | {m['train_s']:.0f} | {fmt(m['reward_first_quarter'])} "
              f"| {fmt(m['reward_last_quarter'])} | {m['accuracy']:.2f} |")


def quality_runs(args, work_cls, spawn) -> list[dict]:
    """Run both sides for every seed (rlora, TRL, next seed ...), then evaluate every adapter at once."""
    from eval_adapters import evaluate_adapters
    from rlora.logging.console import quiet_libraries

    quiet_libraries()
    seeds = [int(s) for s in str(args.seeds).split(",")]
    by_steps = args.steps is not None
    limit = f"fixed {args.steps}" if by_steps else f"in {args.budget_s:.0f} s"
    with tempfile.TemporaryDirectory(prefix="trl_quality_") as keep:
        results = {}
        for seed in seeds:
            work = work_cls(model=args.model, completion_len=args.completion_len, num_generations=8,
                            prompts_per_step=args.prompts, micro_batch_size=args.micro_batch_size, lr=args.lr,
                            steps=args.steps if by_steps else 10_000, warmup=0, fixed_length=False,
                            max_time_s=None if by_steps else args.budget_s, threads=args.threads,
                            train_size=args.train_size, temperature=args.temperature, seed=seed,
                            rlora_sampler_dtype=args.rlora_sampler_dtype, closeness_weight=args.closeness_weight)
            for side in SIDES:
                results[seed, side] = spawn(side, work, Path(keep) / f"{side}-seed{seed}")
                print(f"<!-- seed {seed} {side}: {len(results[seed, side]['steps'])} steps done -->", flush=True)
        scores = evaluate_adapters({f"{side}-{seed}": r["adapter"] for (seed, side), r in results.items()},
                                   args.eval_size, args.completion_len, model=args.model)
    rows = [run_row(seed, side, r, scores[f"{side}-{seed}"]) for (seed, side), r in results.items()]
    print_table(rows, scores["base"], limit)
    if args.out:
        Path(args.out).write_text(json.dumps({"base_accuracy": scores["base"], "runs": rows, "medians": medians(rows),
                                              "args": vars(args)}, indent=1))
    return rows
