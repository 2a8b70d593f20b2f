"""A decode step's products on a CPU, four ways: x @ W^T (F.linear: MKL, the float32 sampler before oneDNN packs),
W @ x^T, fbgemm's float16-weight product (rollout/packed.py, `rollout.sampler_dtype: float16_weights`) and oneDNN's
float32 product from a weight packed once (rollout/packed.py OneDnnPacks, the float32 sampler's default on x86), per
layer shape of a model, side by side (medians); and whether a row's result equals the product of that row alone.
W @ x^T is faster for a few rows on AVX2-only CPUs but made 1-rank and 2-rank runs sample differently
(docs/benchmarks.md, 2026-11-26), so the sampler does not use it.

    .venv/bin/python bench/cpu_linear.py [--model smollm2]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from bench_common import model_folder
from rlora.rollout.packed import OneDnnPacks, onednn_packs_available, packed_fp16_available


def _ms(fn, repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _weight_major(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight @ x.t()).t()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(model_folder(args.model))
    H, F_ = config.hidden_size, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    qkv = H + 2 * H // heads * kv
    print(f"# {args.model} shapes on {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    fp16 = packed_fp16_available()
    onednn = OneDnnPacks(torch.float32) if onednn_packs_available(torch.float32) else None
    print("layer                 rows   x@W^T ms   W@x^T ms   ratio  fp16-w ms   ratio  oneDNN ms   ratio   row result "
          "independent of the row count")
    shapes = {"q/k/v": (qkv, H), "gate/up": (2 * F_, H), "down": (H, F_), "output layer": (config.vocab_size, H)}
    g = torch.Generator().manual_seed(0)
    for name, (out, inp) in shapes.items():
        weight = torch.randn(out, inp, generator=g) * 0.02
        x32 = torch.randn(32, inp, generator=g)
        for rows in (32, 16, 4, 1):
            x = x32[:rows]
            a, b = _ms(lambda: F.linear(x, weight)), _ms(lambda: _weight_major(x, weight))
            same = [torch.equal(f(x, weight)[0], f(x32[:1], weight)[0]) for f in (F.linear, _weight_major)]
            c, same_c = float("nan"), None
            if fp16:
                packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
                c = _ms(lambda: torch.ops.quantized.linear_dynamic_fp16(x, packed))
                same_c = torch.equal(torch.ops.quantized.linear_dynamic_fp16(x, packed)[0],
                                     torch.ops.quantized.linear_dynamic_fp16(x32[:1], packed)[0])
            d, same_d = float("nan"), None
            if onednn is not None:
                packed_d = onednn.pack(weight, None)
                d = _ms(lambda: onednn.linear(x, packed_d))
                same_d = torch.equal(onednn.linear(x, packed_d)[0], onednn.linear(x32[:1], packed_d)[0])
            print(f"{name + f' ({out}x{inp})':<22}{rows:>5}{a:>11.3f}{b:>11.3f}{b / a:>8.2f}{c:>11.3f}{c / a:>8.2f}"
                  f"{d:>11.3f}{d / a:>8.2f}   x@W^T {same[0]}, W@x^T {same[1]}, fp16-w {same_c}, oneDNN {same_d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
