"""Do MoLoRA experts specialise by task? Routing per task before and after training on a two-task mixture.

    flock /tmp/rlora-cpu.lock .venv/bin/python bench/molora_tasks.py [--model smollm2] [--tasks basic_arithmetic,leg_counting]
        [--train 96] [--held-out 48] [--steps 40] [--batch 8] [--lr 2e-3] [--experts 4] [--top-k 2] [--out runs/molora-tasks]

Rows: reasoning-gym problems of the two tasks, mixed, each with its reference answer as the completion
("The answer is X."), rendered with the chat template. Training: `rlora sft`'s own pieces (model loading
with `attach_molora`, the training loop with the routers' auxiliary loss: train/sft.py) on a sequence-routed
MoLoRA; the held-out rows give the eval loss, before and after training. Routing: for each held-out prompt,
each module's router applied to the prompt summary (exactly the gates that module uses for every token of
that sequence in training and sampling), top-k and renormalised as configured. Reported per task, before
training (the fresh routers) and after:
- mean gate per expert (mean over prompts and modules), and per decoder layer (mean over the layer's modules);
- separation: per module, the total variation distance between the two tasks' mean gate vectors
  (0.5 * sum_e |g_A[e] - g_B[e]|: 0 = the tasks are routed alike, 1 = to disjoint experts), averaged over
  the modules; and the share of modules whose most-used expert differs between the tasks;
- within-task baseline: the same mean TV between the even- and odd-numbered held-out prompts of one task
  (averaged over the two tasks).
Writes OUT/report.json (and OUT/run, the run folder with the MoLoRA adapter and metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from bench_common import model_folder, write_jsonl
from rlora.logging.console import quiet_libraries
from rlora.config import SFTConfig
from rlora.data.sft_data import load_sft_data
from rlora.data.tasks import make_task_examples
from rlora.models import molora as ml
from rlora.models.loading import load_tokenizer, trainable_parameters
from rlora.train import sft
from rlora.train.session import seed_everything
from rlora.train.optim import build_optimizer

HELD_OUT_SEED = 1_000_003


def task_rows(task: str, size: int, seed: int) -> list[dict]:
    return [{"prompt": ex.prompt, "completion": f"The answer is {ex.columns['answer']}.", "task": task}
            for ex in make_task_examples(task, {}, size=size, seed=seed)]


def gates_per_module(model, prompts: list[list[int]]) -> tuple[list[str], torch.Tensor]:
    """(module names, gates [M, N, E]): each sequence router's gates for each prompt."""
    config = ml.routing_state(model).config
    summary_ND = ml.prompt_summary(model, prompts)
    names, gates = [], []
    with torch.no_grad():
        for name, module in ml.molora_modules(model):
            names.append(name)
            gates.append(ml.route(module.router_logits(summary_ND), config.top_k, config.renormalize)[0])
    return names, torch.stack(gates)


def layer_of(name: str) -> int:
    return int(name.split(".layers.")[1].split(".")[0])


def routing_report(model, prompts_by_task: dict[str, list[list[int]]]) -> dict:
    per_task = {task: gates_per_module(model, prompts) for task, prompts in prompts_by_task.items()}
    names = next(iter(per_task.values()))[0]
    mean_ME = {task: gates.mean(1) for task, (_, gates) in per_task.items()}  # per module, over prompts
    layers = sorted({layer_of(n) for n in names})
    report = {"mean_gate_per_expert": {t: [round(float(g), 4) for g in m.mean(0)] for t, m in mean_ME.items()},
              "per_layer": {t: {str(layer): [round(float(g), 4) for g in m[[layer_of(n) == layer for n in names]].mean(0)]
                                for layer in layers} for t, m in mean_ME.items()}}
    first, second = (mean_ME[t] for t in prompts_by_task)
    tv_M = 0.5 * (first - second).abs().sum(-1)
    report["separation_tv_mean"] = round(float(tv_M.mean()), 4)
    report["separation_tv_max"] = round(float(tv_M.max()), 4)
    report["top_expert_differs_frac"] = round(float((first.argmax(-1) != second.argmax(-1)).float().mean()), 4)
    # the same TV between the even- and odd-numbered prompts of one task (averaged over both tasks): how far
    # apart two groups of prompts are routed when the task is the same
    halves = [0.5 * (g[:, 0::2].mean(1) - g[:, 1::2].mean(1)).abs().sum(-1).mean() for _, g in per_task.values()]
    report["within_task_tv_mean"] = round(float(sum(halves) / len(halves)), 4)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tasks", default="basic_arithmetic,leg_counting")
    parser.add_argument("--train", type=int, default=96, help="training rows per task")
    parser.add_argument("--held-out", type=int, default=48, help="held-out rows per task")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--balance-coef", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/molora-tasks")
    args = parser.parse_args()
    quiet_libraries()
    tasks = args.tasks.split(",")
    if len(tasks) != 2:
        raise SystemExit("--tasks: give two reasoning-gym task names")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train = [row for task in tasks for row in task_rows(task, args.train, 0)]
    random.Random(0).shuffle(train)
    held = [row for task in tasks for row in task_rows(task, args.held_out, HELD_OUT_SEED)]
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(held, out / "held_out.jsonl")
    cfg = SFTConfig.model_validate({
        "model": {"path": model_folder(args.model)},
        "data": {"path": str(out / "train.jsonl"), "eval_path": str(out / "held_out.jsonl")},
        "molora": {"num_experts": args.experts, "top_k": args.top_k, "router": "sequence", "rank": 8,
                   "balance_coef": args.balance_coef},
        "train": {"steps": args.steps, "batch_size": args.batch, "micro_batch_size": args.batch, "lr": args.lr,
                  "max_length": 256, "output_dir": str(out / "run"), "overwrite": True, "threads": args.threads,
                  "eval_every": 0},
    })
    torch.set_num_threads(args.threads)
    run_dir, _ = sft.check_inputs(cfg)  # (the folder, a checkpoint to resume: none here)
    seed_everything(cfg.train.seed)
    tokenizer, tok = load_tokenizer(cfg.model.path)
    data = load_sft_data(cfg.data, tokenizer, tok.eos_ids[0], cfg.train.max_length)
    if len(data.eval) != len(held):
        raise SystemExit(f"{len(held) - len(data.eval)} held-out rows were dropped: raise max_length")
    prompts_by_task = {task: [sft.prompt_ids(r) for r, row in zip(data.eval, held) if row["task"] == task]
                       for task in tasks}
    model = sft.load_model(cfg, cfg.model.path)
    model.train()
    before = routing_report(model, prompts_by_task)
    model.eval()
    eval_loss_before = sft.mean_loss(model, data.eval, cfg.train.micro_batch_size, tok.pad_id)
    model.train()
    params = trainable_parameters(model)
    optimizer, scheduler = build_optimizer(params, cfg.train, args.steps)
    run_dir.create()
    summary = {"eval_loss": None}
    t0 = time.perf_counter()
    sft.train_loop(cfg, run_dir, model, params, optimizer, scheduler, data, tok.pad_id, args.steps, summary)
    train_s = time.perf_counter() - t0
    sft.save_outputs(cfg, run_dir, model, tokenizer)
    after = routing_report(model, prompts_by_task)
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    report = {"model": args.model, "tasks": tasks, "train_rows": len(data.train), "held_out_rows": len(data.eval),
              "steps": args.steps, "batch": args.batch, "lr": args.lr, "molora": cfg.molora.model_dump(),
              "train_s": round(train_s, 1), "first_loss": metrics[0]["loss"], "last_loss": metrics[-1]["loss"],
              "eval_loss_before": eval_loss_before, "eval_loss_after": summary.get("eval_loss"),
              "before": before, "after": after}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    losses = ("train_s", "first_loss", "last_loss", "eval_loss_before", "eval_loss_after")
    print(json.dumps({k: report[k] for k in losses}))
    for label in ("before", "after"):
        r = report[label]
        print(f"{label}: separation TV mean {r['separation_tv_mean']} (max {r['separation_tv_max']}), "
              f"top expert differs in {r['top_expert_differs_frac']:.0%} of modules; within-task TV mean "
              f"{r['within_task_tv_mean']}")
        for task in tasks:
            print(f"  {task:18s} mean gate per expert {r['mean_gate_per_expert'][task]}")


if __name__ == "__main__":
    main()
