"""rlora vs TRL GRPOTrainer + peft on identical work, side by side.

    .venv/bin/pip install -e ".[bench]"                       # TRL 1.16 (optional extra)
    .venv/bin/python bench/compare_trl.py timing [--models smollm2,qwen2-0.1b] [--lengths 32,128]
        [--gens 4,16] [--betas 0,0.04] [--steps 3] [--warmup 1] [--repeats 2] [--out FILE.jsonl]
    .venv/bin/python bench/compare_trl.py quality [--budget-s 300 | --steps 16] [--seeds 0,1,2] [--closeness-weight 0.1]

Each run is its own subprocess (so peak RSS is per side); runs alternate rlora, TRL, rlora, TRL. Both sides
get the same model folder and tokenizer, the same chat prompts (reasoning-gym chain_sum), the same reward
functions (bench_common.reward_setup), G, completion length, LoRA rank/alpha/targets, beta, learning rate,
AdamW, loss aggregation, seed, fp32 and thread count; TRL defaults that differ from rlora's are pinned (see
TRL_PINNED). In `timing` mode EOS is suppressed until the length limit on both sides (min_new_tokens), so
both generate and train on exactly the same number of tokens.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

LOSS_AGG_TO_TRL = {"token_mean": "dapo", "seq_mean": "grpo", "constant": "dr_grpo"}
PHASES = ("rollout_s", "reward_s", "ref_s", "old_s", "train_s", "optim_s", "step_s")


@dataclass
class Work:
    """Everything both sides must agree on."""

    model: str = "smollm2"
    completion_len: int = 32
    num_generations: int = 4
    beta: float = 0.0
    prompts_per_step: int = 8  # completions per step = prompts_per_step * num_generations (>= 32)
    micro_batch_size: int = 16
    lr: float = 1e-4
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: str = "all-linear"
    loss_agg: str = "token_mean"
    temperature: float = 1.0
    seed: int = 0
    threads: int = 2
    steps: int = 3  # measured
    warmup: int = 1
    fixed_length: bool = True  # suppress EOS until completion_len (timing mode)
    max_time_s: float | None = None  # quality mode: stop after this much training time
    train_size: int = 512
    output_dir: str = ""
    closeness_weight: float = 0.0  # > 0: both sides add the demo's closeness shaping (bench_common.reward_setup)
    rlora_sampler_dtype: str = "model"  # rlora only: "bfloat16" / "float16_weights": not identical work
    rlora_autocast: str = "auto"  # rlora only: "bfloat16" runs a float32 model's update under bf16 autocast: not identical
    device: str = "cpu"  # "cuda": both sides on the GPU
    dtype: str = "float32"  # model weights and compute ("bfloat16" on GPUs)

    @property
    def total_steps(self) -> int:
        return self.steps + self.warmup


# TRL GRPOConfig values that differ from TRL's defaults, pinned to rlora's behaviour (printed with results);
# bf16 and use_cpu follow Work.dtype and Work.device (trl_pinned)
TRL_PINNED = {
    "fp16": False, "gradient_checkpointing": False, "lr_scheduler_type": "constant",
    "warmup_steps": 0, "weight_decay": 0.0, "optim": "adamw_torch", "adam_beta1": 0.9, "adam_beta2": 0.999,
    "max_grad_norm": 1.0, "epsilon": 0.2, "epsilon_high": 0.2, "scale_rewards": "group", "num_iterations": 1,
    "top_p": 1.0, "top_k": 0, "mask_truncated_completions": False, "disable_dropout": True,
    "report_to": [], "save_strategy": "no", "logging_steps": 1, "log_completions": False,
    "shuffle_dataset": False,  # same prompts per step as rlora (data.shuffle=false)
    "multi_objective_aggregation": "sum_then_normalize",  # weighted rewards summed, then group advantages (as rlora)
}


def trl_pinned(work: Work) -> dict:
    return {**TRL_PINNED, "bf16": work.dtype == "bfloat16", "use_cpu": work.device == "cpu"}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_gpu_mb() -> float | None:
    """Peak memory the process allocated on its GPU (None on CPU runs): weights, activations, caches."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_initialized() else None


# --------------------------------------------------------------------------- rlora side
def run_rlora(work: Work) -> dict:
    from bench_common import model_folder, rlora_rewards, task_rows, write_jsonl
    from rlora.config import load_config
    from rlora.train.grpo import run_grpo

    data = write_jsonl(task_rows("train", work.train_size), Path(work.output_dir) / "prompts.jsonl")
    overrides = {
        "model.path": model_folder(work.model), "model.device": work.device, "model.dtype": work.dtype,
        "data.task": None, "data.path": str(data), "data.eval_size": 0,
        "data.shuffle": False,  # both sides take the prompts in file order, so each step sees the same prompts
        "rewards": rlora_rewards(work.closeness_weight), "lora.rank": work.lora_rank,
        "lora.alpha": work.lora_alpha, "lora.target_modules": work.lora_targets,
        "rollout.num_generations": work.num_generations, "rollout.max_new_tokens": work.completion_len,
        "rollout.min_new_tokens": work.completion_len if work.fixed_length else 0,
        "rollout.temperature": work.temperature, "algo.beta": work.beta, "algo.loss_agg": work.loss_agg,
        "rollout.sampler_dtype": work.rlora_sampler_dtype,
        "algo.sampler_is_cap": None if work.rlora_sampler_dtype == "model" else 2.0,
        "train.autocast": work.rlora_autocast,
        "train.steps": work.total_steps, "train.prompts_per_step": work.prompts_per_step,
        "train.micro_batch_size": work.micro_batch_size, "train.lr": work.lr, "train.seed": work.seed,
        "train.threads": work.threads, "train.output_dir": str(Path(work.output_dir) / "rlora"),
        "train.sample_every": 0, "train.max_time_s": work.max_time_s, "eval.before": False, "eval.after": False,
    }
    cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
    summary = run_grpo(cfg)
    rows = [json.loads(line) for line in (Path(cfg.train.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return {
        "steps": [{k: r[k] for k in PHASES} for r in rows],
        "prompts": len(rows) * work.prompts_per_step,
        "completions": len(rows) * work.prompts_per_step * work.num_generations,
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "completion_tokens": sum(r["gen_tokens"] for r in rows),
        "lora_params": summary["adapter_params"],
        "reward_mean": statistics.mean(r["reward_mean"] for r in rows),
        "rewards": [r["reward_mean"] for r in rows],  # per optimizer step
        # rows whose forward and backward ran: rlora skips those with an exactly zero gradient (all-equal group, beta 0)
        "trained_frac": [r.get("trained_frac", 0.0) for r in rows],
        "adapter": str(Path(cfg.train.output_dir) / "adapter"),
    }


# --------------------------------------------------------------------------- TRL side
class PhaseClock:
    """Per-optimizer-step phase times of a TRL run, from wrapped trainer methods and callbacks."""

    def __init__(self):
        self.current = dict.fromkeys(PHASES, 0.0)
        self.steps: list[dict] = []
        self.step_start = time.perf_counter()
        self.prepare_s = 0.0

    def add(self, phase: str, seconds: float) -> None:
        self.current[phase] += seconds

    def end_step(self) -> None:
        now = time.perf_counter()
        self.current["step_s"] = now - self.step_start
        self.steps.append(self.current)
        self.current = dict.fromkeys(PHASES, 0.0)
        self.step_start = now


def _wrap(obj, name: str, on_done) -> None:
    import torch

    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = original(*args, **kwargs)
        if torch.cuda.is_initialized():  # GPU work is asynchronous: end the phase when its kernels end
            torch.cuda.synchronize()
        on_done(time.perf_counter() - start)
        return out

    setattr(obj, name, wrapper)


def instrument_trl(trainer, clock: PhaseClock) -> None:
    import torch
    from transformers import TrainerCallback

    lora_layers = [m for m in trainer.model.modules() if hasattr(m, "lora_A") and hasattr(m, "disable_adapters")]

    def logps_done(seconds):
        if not torch.is_grad_enabled():  # no-grad passes happen while scoring: reference or old log-probs
            clock.add("ref_s" if lora_layers and lora_layers[0].disable_adapters else "old_s", seconds)

    _wrap(trainer, "_generate", lambda s: clock.add("rollout_s", s))
    _wrap(trainer, "_calculate_rewards", lambda s: clock.add("reward_s", s))
    _wrap(trainer, "_get_per_token_logps_and_entropies", logps_done)
    _wrap(trainer, "_prepare_inputs", lambda s: setattr(clock, "prepare_s", clock.prepare_s + s))
    # training_step = _prepare_inputs (generation, scoring, ref) + forward/backward: train_s is the difference
    _wrap(trainer, "training_step", lambda s: clock.add("train_s", s))

    class StepTimes(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.step_start = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.t_optim = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            clock.add("optim_s", time.perf_counter() - self.t_optim)

        def on_step_end(self, args, state, control, **kwargs):
            clock.current["train_s"] -= clock.prepare_s
            clock.prepare_s = 0.0
            clock.end_step()

    trainer.add_callback(StepTimes())


class TimeBudget:
    """Stop TRL after max_time_s of training, like rlora's train.max_time_s."""

    def __init__(self, max_time_s: float):
        from transformers import TrainerCallback

        budget = max_time_s

        class Stop(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                self.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                if time.perf_counter() - self.t0 >= budget:
                    control.should_training_stop = True

        self.callback = Stop()


def run_trl(work: Work) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from bench_common import model_folder, reward_setup, task_rows

    torch.set_num_threads(work.threads)
    folder = model_folder(work.model)
    completions_per_step = work.prompts_per_step * work.num_generations
    reward_funcs, reward_weights = reward_setup(work.closeness_weight)
    args = GRPOConfig(
        output_dir=str(Path(work.output_dir) / "trl"), per_device_train_batch_size=work.micro_batch_size,
        gradient_accumulation_steps=completions_per_step // work.micro_batch_size,
        num_generations=work.num_generations, max_completion_length=work.completion_len,
        temperature=work.temperature, learning_rate=work.lr, beta=work.beta, reward_weights=reward_weights,
        loss_type=LOSS_AGG_TO_TRL[work.loss_agg], seed=work.seed, max_steps=work.total_steps,
        generation_kwargs={"min_new_tokens": work.completion_len} if work.fixed_length else None,
        **trl_pinned(work),
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, work.dtype))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    lora = LoraConfig(r=work.lora_rank, lora_alpha=work.lora_alpha, target_modules=work.lora_targets,
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=args,
                          train_dataset=Dataset.from_list(task_rows("train", work.train_size)),
                          processing_class=tokenizer, peft_config=lora)
    clock = PhaseClock()
    instrument_trl(trainer, clock)
    if work.max_time_s:
        trainer.add_callback(TimeBudget(work.max_time_s).callback)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    steps_run = len(clock.steps)
    mean_len = [h.get("completions/mean_length", 0.0) for h in logs]
    num_tokens = [h["num_tokens"] for h in logs if "num_tokens" in h]  # cumulative prompt + completion tokens
    completion_tokens = round(sum(mean_len) * completions_per_step)
    adapter = Path(work.output_dir) / "trl-adapter"
    trainer.model.save_pretrained(str(adapter))
    return {
        "steps": clock.steps,
        "prompts": steps_run * work.prompts_per_step,
        "completions": steps_run * completions_per_step,
        "prompt_tokens": int(num_tokens[-1]) - completion_tokens if num_tokens else None,
        "completion_tokens": completion_tokens,
        "lora_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "reward_mean": statistics.mean(h["reward"] for h in logs) if logs else None,
        "rewards": [h["reward"] for h in logs],  # per optimizer step (logging_steps=1)
        "adapter": str(adapter),
        "trl_pinned": trl_pinned(work),
    }


# --------------------------------------------------------------------------- driver
def worker(side: str, work: Work, out: Path) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    from rlora.logging.console import quiet_libraries

    quiet_libraries()
    start = time.perf_counter()
    result = (run_rlora if side == "rlora" else run_trl)(work)
    result |= {"side": side, "work": asdict(work), "wall_s": time.perf_counter() - start, "peak_rss_mb": peak_rss_mb(),
               "peak_gpu_mb": peak_gpu_mb()}
    out.write_text(json.dumps(result))


def spawn(side: str, work: Work, folder: Path | None = None) -> dict:
    """Run one side in a fresh process; its outputs go to `folder` (default: a temporary folder)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = folder or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        work = Work(**{**asdict(work), "output_dir": str(folder)})
        out = folder / "result.json"
        path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(work.threads)}
        done = subprocess.run([sys.executable, __file__, "worker", side, json.dumps(asdict(work)), str(out)],
                              env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{side} run failed:\n{done.stderr[-3000:]}")
        result = json.loads(out.read_text())
    if work.max_time_s is None and len(result["steps"]) != work.total_steps:
        raise RuntimeError(f"{side} ran {len(result['steps'])} of {work.total_steps} steps (too few prompts? "
                           "raise --train-size)")
    return result


def median_phases(result: dict, warmup: int) -> dict:
    measured = result["steps"][warmup:] or result["steps"]
    return {p: statistics.median(s[p] for s in measured) for p in PHASES}


def compare_one(work: Work, repeats: int) -> dict:
    """A, B, A, B ...: per pair the ratio rlora/TRL of median step time; medians over pairs."""
    runs = {"rlora": [], "trl": []}
    for _ in range(repeats):
        for side in ("rlora", "trl"):
            runs[side].append(spawn(side, work))
    pairs = [median_phases(a, work.warmup)["step_s"] / median_phases(b, work.warmup)["step_s"]
             for a, b in zip(runs["rlora"], runs["trl"])]
    summary = {"work": asdict(work), "ratio_step_pairs": pairs, "ratio_step_median": statistics.median(pairs)}
    for side, results in runs.items():
        phases = [median_phases(r, work.warmup) for r in results]
        summary[side] = {
            **{p: statistics.median(x[p] for x in phases) for p in PHASES},
            "step_s_min": min(x["step_s"] for x in phases), "step_s_max": max(x["step_s"] for x in phases),
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in results),
            "peak_gpu_mb": statistics.median(r["peak_gpu_mb"] or 0.0 for r in results),
            "tokens_per_s_sampling": statistics.median(
                r["completion_tokens"] / max(sum(s["rollout_s"] for s in r["steps"]), 1e-9) for r in results),
            "same_work": {k: results[0][k] for k in ("prompts", "completions", "prompt_tokens", "completion_tokens", "lora_params")},
        }
    summary["rlora"]["trained_frac"] = statistics.median(f for r in runs["rlora"] for f in r["trained_frac"][work.warmup:])
    summary["ratio_peak_rss"] = summary["rlora"]["peak_rss_mb"] / summary["trl"]["peak_rss_mb"]
    if work.device != "cpu":
        summary["ratio_peak_gpu"] = summary["rlora"]["peak_gpu_mb"] / summary["trl"]["peak_gpu_mb"]
    summary["ratio_sampling_speed"] = summary["rlora"]["tokens_per_s_sampling"] / summary["trl"]["tokens_per_s_sampling"]
    return summary


def print_timing_row(s: dict) -> None:
    w, a, b = s["work"], s["rlora"], s["trl"]
    sampler = w.get("rlora_sampler_dtype", "model")
    model = w["model"] + (f" (rlora: {sampler} sampler)" if sampler != "model" else "")
    model += f" (rlora: update under {w['rlora_autocast']} autocast)" if w.get("rlora_autocast", "auto") == "bfloat16" else ""
    on_gpu = w.get("device", "cpu") != "cpu"
    memory = "peak_gpu_mb" if on_gpu else "peak_rss_mb"
    model += f" ({w['device']}, {w['dtype']})" if on_gpu else ""
    trained = a.get("trained_frac", 1.0)  # results from before it was recorded: every row counted as trained
    skipped = f" (rlora trained {trained:.0%} of rows: zero-gradient rows skipped)" if trained < 1 else ""
    print(f"| {model} | {w['completion_len']} | {w['num_generations']} | {w['beta']} | "
          f"{a['step_s']:.2f} ({a['step_s_min']:.2f}-{a['step_s_max']:.2f}) | "
          f"{b['step_s']:.2f} ({b['step_s_min']:.2f}-{b['step_s_max']:.2f}) | {s['ratio_step_median']:.2f}{skipped} | "
          f"{a['rollout_s']:.2f} / {b['rollout_s']:.2f} | {a['ref_s']:.2f} / {b['ref_s']:.2f} | "
          f"{a['train_s']:.2f} / {b['train_s']:.2f} | {a['optim_s']:.3f} / {b['optim_s']:.3f} | "
          f"{a[memory]:.0f} / {b[memory]:.0f} | {s['ratio_sampling_speed']:.2f} |", flush=True)


TIMING_HEADER = (
    "| model | T | G | beta | rlora step s (min-max) | TRL step s (min-max) | ratio | rollout s rlora / TRL | "
    "ref s | train fwd+bwd s | optimizer s | peak memory MB (CPU: RSS; GPU: allocated) | sampling speed ratio |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def timing(args) -> None:
    print(TIMING_HEADER, flush=True)
    for model, length, gens, beta in itertools.product(args.models.split(","), [int(x) for x in args.lengths.split(",")],
                                                       [int(x) for x in args.gens.split(",")],
                                                       [float(x) for x in args.betas.split(",")]):
        prompts = max(1, -(-32 // gens))  # at least 32 completions per step
        work = Work(model=model, completion_len=length, num_generations=gens, beta=beta, prompts_per_step=prompts,
                    micro_batch_size=args.micro_batch_size, steps=args.steps, warmup=args.warmup, threads=args.threads,
                    train_size=args.train_size, rlora_sampler_dtype=args.rlora_sampler_dtype, device=args.device,
                    dtype=args.dtype, rlora_autocast=args.rlora_autocast)
        summary = compare_one(work, args.repeats)
        if summary["rlora"]["same_work"] != summary["trl"]["same_work"]:
            print(f"<!-- work differs: rlora {summary['rlora']['same_work']} TRL {summary['trl']['same_work']} -->")
        print_timing_row(summary)
        if args.out:
            with open(args.out, "a") as handle:
                handle.write(json.dumps(summary) + "\n")


def quality(args) -> None:
    """Both sides train the demo task, per seed, for --steps optimizer steps or a --budget-s of training time;
    one evaluator scores every adapter (bench/trl_quality.py)."""
    from trl_quality import quality_runs

    quality_runs(args, Work, spawn)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("timing", help="per-phase step time and peak memory, A/B alternating")
    for option, default in (("--models", "smollm2,qwen2-0.1b"), ("--lengths", "32,128"), ("--gens", "4,16"),
                            ("--betas", "0,0.04"), ("--steps", 3), ("--warmup", 1), ("--repeats", 2),
                            ("--micro-batch-size", 16), ("--threads", 2), ("--train-size", 512)):
        t.add_argument(option, type=type(default), default=default)
    t.add_argument("--out", help="append one JSON summary per configuration")
    t.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    t.add_argument("--rlora-sampler-dtype", default="model", choices=["model", "bfloat16", "float16_weights"],
                   help="rlora's sampler: bfloat16 / float16_weights are not identical work (flagged in the output)")
    t.add_argument("--rlora-autocast", default="auto", choices=["auto", "off", "bfloat16"],
                   help="rlora's train.autocast (auto: bf16 for a bf16 model where native); bfloat16 with a float32 "
                   "model is not identical work (flagged in the output)")
    q = sub.add_parser("quality", help="held-out accuracy after equal steps or equal wall-clock training, per seed")
    q.add_argument("--budget-s", type=float, default=300, help="training time per side (unless --steps)")
    q.add_argument("--steps", type=int, default=None, help="optimizer steps per side instead of a time budget")
    q.add_argument("--seeds", default="0", help="comma-separated: each seed trains both sides (LoRA init, sampling)")
    q.add_argument("--out", help="write every run's numbers as JSON")
    q.add_argument("--model", default="smollm2")
    for option, default in (("--completion-len", 48), ("--temperature", 0.7), ("--prompts", 2), ("--micro-batch-size", 16),
                            ("--lr", 2e-4), ("--eval-size", 100), ("--train-size", 1000), ("--threads", 2)):
        q.add_argument(option, type=type(default), default=default)
    q.add_argument("--rlora-sampler-dtype", default="model", choices=["model", "bfloat16", "float16_weights"],
                   help="bfloat16: rlora samples from bf16 copies with truncated IS (the demo's setting)")
    q.add_argument("--closeness-weight", type=float, default=0.0, help="both sides add the closeness shaping at this "
                   "weight beside the exact answer (the demo's: 0.1)")
    w = sub.add_parser("worker", help="internal: run one side")
    w.add_argument("side", choices=["rlora", "trl"])
    w.add_argument("work")
    w.add_argument("out")
    args = parser.parse_args()
    if args.mode == "worker":
        worker(args.side, Work(**json.loads(args.work)), Path(args.out))
    elif args.mode == "timing":
        timing(args)
    else:
        quality(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
