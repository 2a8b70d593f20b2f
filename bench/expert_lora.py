"""A mixture's expert LoRA on the activations (rlora, models/expert_lora.py) against peft's weight-side forward,
side by side in one process:

    .venv/bin/python bench/expert_lora.py [--model qwen3-moe-0.1b] [--rows 16] [--tokens 96] [--repeats 5]

One forward and backward of the whole model (float32, LoRA r16 on all linear layers: peft's all-linear puts it on
the fused experts and the router too) over random tokens, the two ways alternating in each round after a warm-up
of each. Prints the median seconds of each, and the bytes the forward saves for the backward (autograd's saved
tensors, each storage once, parameters left out: where peft's W + s * B @ A of every expert is held for each layer).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_common import model_folder, random_up_factors
from rlora.config import LoraConfig, ModelConfig
from rlora.logging.console import quiet_libraries
from rlora.models import expert_lora
from rlora.models.loading import attach_lora, load_base_model

WAYS = ("activations", "peft")


def forward_backward(model, ids_BT: torch.Tensor) -> tuple[float, int]:
    """Seconds of one forward and backward, and the bytes the forward saved for the backward: each storage once
    (views of one tensor share it), the model's own parameters left out (they are held anyway)."""
    held = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in held:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids_BT).logits
    logits.float().logsumexp(-1).mean().backward()
    return time.perf_counter() - start, sum(storages.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-moe-0.1b")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    quiet_libraries()
    folder = model_folder(args.model)
    torch.manual_seed(0)
    model = attach_lora(load_base_model(ModelConfig(path=folder, dtype="float32"), folder), LoraConfig(rank=16, alpha=32))
    random_up_factors(model, seed=1)
    if expert_lora.install(model) == 0:
        raise SystemExit(f"{args.model}: no experts module with peft's LoRA of a layout rlora computes on activations")
    ids_BT = torch.randint(0, model.get_base_model().config.vocab_size, (args.rows, args.tokens),
                           generator=torch.Generator().manual_seed(0))
    seconds = {way: [] for way in WAYS}
    saved = {}
    for round_ in range(args.repeats + 1):
        for way in WAYS:
            (expert_lora.install if way == "activations" else expert_lora.uninstall)(model)
            took, saved[way] = forward_backward(model, ids_BT)
            if round_:  # the first round warms up both
                seconds[way].append(took)
    print(f"{args.model}, {args.rows} rows x {args.tokens} tokens, forward + backward, {torch.get_num_threads()} threads")
    for way in WAYS:
        print(f"  {way:11s} median {statistics.median(seconds[way]):.3f} s "
              f"({', '.join(f'{t:.2f}' for t in seconds[way])}); saved for the backward {saved[way] / 2**20:.0f} MiB")
    ratio = statistics.median(seconds["activations"]) / statistics.median(seconds["peft"])
    print(f"  activations / peft: {ratio:.2f}x the time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
