"""Frozen lower layers computed once: time of a step's log-prob phases with and without sharing.

    .venv/bin/python bench/frozen_prefix.py [--model smollm2] [--top-layers 8,15] [--prompts 4] [--G 8]
                                            [--tokens 64] [--micro-batch 16] [--repeats 5]

For each adapter depth (LoRA on the top N decoder layers), one rollout is sampled with rlora's engine from
demo prompts, then the log-prob phases of a step with beta > 0 and two updates per rollout are timed:
reference log-probs (adapter off), old log-probs, and the policy forward + backward (twice: num_iterations
= 2), plus, when shared, computing the frozen prefix once. Shared and plain runs alternate (A, B, A, B ...)
on the same rollout so machine drift hits both; reported: medians over the repeats and the ratio
plain / shared. The two paths' log-probs are compared as a check (max |difference|).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from bench_common import model_folder, task_rows
from rlora.algos.advantages import per_token
from rlora.algos.registry import get_algorithm
from rlora.logging.console import quiet_libraries
from rlora.config import AlgoConfig, LoraConfig, ModelConfig
from rlora.data.prompts import render_prompt
from rlora.models.frozen_prefix import FrozenPrefix, first_adapter_layer
from rlora.models.loading import attach_lora, load_base_model, load_tokenizer, trainable_parameters
from rlora.models.adapters import reference_policy
from rlora.rollout.engine import BuiltinGenerator
from rlora.train.update import ScoredRollout, accumulate_policy_gradient, batched_logprobs
from rlora.types import Example, SamplingParams

UPDATES = 2  # policy passes per rollout (algo.num_iterations)


def sample_rollout(model, tokenizer, tok, prompts: int, G: int, tokens: int):
    rows = task_rows("train")[:prompts]
    ids = [render_prompt(tokenizer, Example(r["prompt"], {}), None, True) for r in rows]
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, merge=True)
    params = SamplingParams(max_new_tokens=tokens, min_new_tokens=tokens, temperature=1.0)  # full length: fixed work
    return engine.sample(model, ids, G, params, seed=0)


def logprob_phases(model, rollout, micro_batch: int, shared: int) -> tuple[float, torch.Tensor]:
    """One step's log-prob work -> (seconds, reference log-probs)."""
    algo, cfg = get_algorithm("grpo"), AlgoConfig(beta=0.04, num_iterations=UPDATES)
    start = time.perf_counter()
    prefix = FrozenPrefix(model, rollout, shared, micro_batch) if shared else None
    with reference_policy(model):
        ref = batched_logprobs(model, rollout, micro_batch, prefix=prefix)
    old = batched_logprobs(model, rollout, micro_batch, prefix=prefix)
    advantages_B = torch.linspace(-1, 1, rollout.num_completions)  # every row trained
    mask_BT = rollout.completion_mask_BTc.float()
    scored = ScoredRollout(rollout, per_token(advantages_B, mask_BT), mask_BT, old, ref)
    for _ in range(UPDATES):
        accumulate_policy_gradient(model, algo, cfg, scored, micro_batch, rollout.completion_ids_BTc.shape[1],
                                   prefix=prefix)
        model.zero_grad(set_to_none=True)
    return time.perf_counter() - start, ref


def measure(model_name: str, top_layers: int, args) -> dict:
    folder = model_folder(model_name)
    tokenizer, tok = load_tokenizer(folder)
    model = attach_lora(load_base_model(ModelConfig(path=folder), folder), LoraConfig(rank=16, alpha=32,
                                                                                      top_layers=top_layers))
    model.train()
    frozen = first_adapter_layer(model)
    rollout = sample_rollout(model, tokenizer, tok, args.prompts, args.G, args.tokens)
    logprob_phases(model, rollout, args.micro_batch, frozen)  # warm-up, both paths
    logprob_phases(model, rollout, args.micro_batch, 0)
    times = {"shared": [], "plain": []}
    refs = {}
    for _ in range(args.repeats):
        for mode in ("shared", "plain"):
            seconds, refs[mode] = logprob_phases(model, rollout, args.micro_batch, frozen if mode == "shared" else 0)
            times[mode].append(seconds)
    mask = rollout.completion_mask_BTc.bool()
    return {"top_layers": top_layers, "frozen": frozen, "layers": frozen + top_layers,
            "shared_s": statistics.median(times["shared"]), "plain_s": statistics.median(times["plain"]),
            "spread": {m: (min(t), max(t)) for m, t in times.items()},
            "max_abs_diff": float((refs["shared"][mask] - refs["plain"][mask]).abs().max()),
            "params": sum(p.numel() for p in trainable_parameters(model))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--top-layers", default="8,15", help="adapter depths to measure (comma-separated)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    quiet_libraries()
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.prompts} prompts x {args.G} samples x {args.tokens} tokens, micro-batch {args.micro_batch}, "
          f"beta 0.04, {UPDATES} updates per rollout, {args.repeats} repeats")
    print("| adapter layers (of L) | frozen layers | shared (s) | plain (s) | plain / shared | shared min-max | "
          "plain min-max | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for top in (int(x) for x in args.top_layers.split(",")):
        r = measure(args.model, top, args)
        spread = {m: f"{lo:.2f}-{hi:.2f}" for m, (lo, hi) in r["spread"].items()}
        print(f"| {r['top_layers']} of {r['layers']} | {r['frozen']} | {r['shared_s']:.2f} | {r['plain_s']:.2f} | "
              f"**{r['plain_s'] / r['shared_s']:.2f}x** | {spread['shared']} | {spread['plain']} | "
              f"{r['max_abs_diff']:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
