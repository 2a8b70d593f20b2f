"""Seconds per GRPO update (forward and backward of every micro-batch, rlora's own accumulate_policy_gradient) on one
synthetic batch, to compare two checkouts side by side:

    for src in OLD/src NEW/src; do PYTHONPATH=$src .venv/bin/python bench/update_time.py [--lengths 32,32]; done

(OLD a `git worktree add` of the earlier commit; alternate the two a few times, the machine's speed drifts.) P
prompts x G rows of random tokens (bench/packed_groups.py ragged_rollout: completion lengths uniform in [LO, HI],
one row per prompt at HI), SmolLM2 float32 with a random LoRA r16 on all linear layers, every row at the same
sampling temperature. Prints which rlora ran, the median and each timed update after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import rlora
from bench_common import model_folder, random_up_factors
from packed_groups import ragged_rollout, update
from rlora.config import LoraConfig, ModelConfig
from rlora.logging.console import quiet_libraries
from rlora.models import expert_lora
from rlora.models.loading import attach_lora, load_base_model
from rlora.models.precision import trainer_precision


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--G", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=46)
    parser.add_argument("--lengths", default="32,32", help="LO,HI: completion lengths uniform in [LO, HI]")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--autocast", default="off", choices=["off", "bfloat16"],
                        help="train.autocast: the update's passes in the model's float32, or under bf16 autocast")
    parser.add_argument("--expert-lora", default="activations", choices=["activations", "peft"],
                        help="a mixture's expert LoRA: on the activations (rlora, models/expert_lora.py) or peft's "
                             "weight-side ParamWrapper forward")
    args = parser.parse_args()
    lo, hi = (int(x) for x in args.lengths.split(","))
    quiet_libraries()
    folder = model_folder(args.model)
    torch.manual_seed(0)
    model = attach_lora(load_base_model(ModelConfig(path=folder, dtype="float32"), folder), LoraConfig(rank=16, alpha=32))
    random_up_factors(model, seed=1)
    if args.expert_lora == "peft":
        expert_lora.uninstall(model)
    rollout = ragged_rollout(args.prompts, args.G, args.prompt, lo, hi, model.get_base_model().config.vocab_size)
    rollout.temperature_B = torch.full((rollout.num_completions,), args.temperature)
    with trainer_precision(model, args.autocast):
        times = [update(model, rollout)[0] for _ in range(args.repeats + 1)][1:]
    print(f"{rlora.__file__}: {args.prompts} x {args.G} rows, lengths {lo}-{hi}, temperature {args.temperature}, "
          f"autocast {args.autocast}, expert LoRA {args.expert_lora}: "
          f"update median {statistics.median(times):.3f} s ({', '.join(f'{t:.2f}' for t in times)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
