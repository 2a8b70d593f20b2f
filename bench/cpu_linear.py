"""The sampler's linear layers on a CPU: x @ W^T (F.linear) against W @ x^T (rollout/decoder.py sampler_linear),
per layer shape and for whole sampling calls, side by side in one run (alternating, medians).

    .venv/bin/python bench/cpu_linear.py [--model smollm2] [--prompts 2] [--G 8] [--tokens 48] [--repeats 3]

The sampling calls use the demo's shape by default (2 prompts x 8 samples, 48 new tokens, a rank-16 LoRA on
every linear layer with random B, merged), each side with the same seed.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from bench_common import model_folder
from rlora.cli import _quiet_libraries
from rlora.rollout import decoder
from rlora.rollout.engine import BuiltinGenerator
from rlora.types import SamplingParams
from sampler import build


def _ms(fn, repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _as_f_linear(x, weight, bias):
    return F.linear(x, weight, bias)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    _quiet_libraries()
    tokenizer, tok, model = build(args.model, "float32")
    config = model.config
    print(f"# {args.model} on {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    shapes = {"q/k/v": (config.hidden_size * 2, config.hidden_size), "gate/up": (2 * config.intermediate_size,
              config.hidden_size), "down": (config.hidden_size, config.intermediate_size),
              "output layer": (config.vocab_size, config.hidden_size)}
    print("layer          rows   x@W^T ms   W@x^T ms   ratio")
    for name, (out, inp) in shapes.items():
        weight = torch.randn(out, inp) * 0.02
        for rows in (16, 4, 1):
            x = torch.randn(rows, inp)
            a, b = _ms(lambda: F.linear(x, weight)), _ms(lambda: decoder.sampler_linear(x, weight, None))
            print(f"{name:<14}{rows:>5}{a:>11.3f}{b:>11.3f}{b / a:>8.2f}")
    folder = model_folder(args.model)
    prompts = [tokenizer(f"What is {i} + {2 * i}?")["input_ids"] for i in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0)
    generator = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    chosen = decoder.sampler_linear
    sides = {"x@W^T": _as_f_linear, "W@x^T": chosen}
    times = {side: [] for side in sides}
    tokens = {}
    for _ in range(args.repeats):
        for side, linear in sides.items():
            decoder.sampler_linear = linear
            try:
                t0 = time.perf_counter()
                rollout = generator.sample(model, prompts, args.G, params, 1)
                times[side].append(time.perf_counter() - t0)
            finally:
                decoder.sampler_linear = chosen
            tokens[side] = rollout.completion_ids_BTc
    a, b = (statistics.median(times[side]) for side in sides)
    print(f"sampling calls ({folder}, {args.prompts} x {args.G}, {args.tokens} tokens, median of {args.repeats}): "
          f"x@W^T {a:.2f} s, W@x^T {b:.2f} s, ratio {b / a:.2f}; same tokens: "
          f"{torch.equal(tokens['x@W^T'], tokens['W@x^T'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
