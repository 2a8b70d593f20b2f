"""What the sampler's host-side checks (stop strings, on_token callbacks, think phases) cost per decode step as
rows grow long: HostHooks.seen for B rows at every token of a T-token generation, one stop string per row that
is never written (so every token is checked).

    .venv/bin/python bench/host_hooks.py [--rows 64] [--tokens 4096]

Prints the time per step over the first and the last 100 tokens: a check that reads only the new tokens costs
the same at the end as at the start."""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoTokenizer

from bench_common import model_folder
from rlora.rollout.decode_loop import HostHooks, RowsOnDevice
from rlora.rollout.stops import StopStrings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    B, T = args.rows, args.tokens
    tokenizer = AutoTokenizer.from_pretrained(model_folder("smollm2"))
    rows = RowsOnDevice.empty(B, T, 0, torch.device("cpu"))
    rows.tokens_BT.random_(0, 1000, generator=torch.Generator().manual_seed(0))
    host = HostHooks(None, StopStrings(tokenizer, [("@@never written@@",)] * B), None, None)
    rows_A, seconds = torch.arange(B), []
    for t in range(T):
        start = time.perf_counter()
        host.seen(rows_A, torch.full((B,), t), rows)
        seconds.append(time.perf_counter() - start)
    first, last = (sum(part) / len(part) * 1e3 for part in (seconds[:100], seconds[-100:]))
    print(f"HostHooks.seen, {B} rows x {T} tokens: {first:.2f} ms per step over the first 100 tokens, {last:.2f} ms "
          f"over the last 100; {sum(seconds):.1f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
