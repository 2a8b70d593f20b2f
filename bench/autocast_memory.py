"""What the GRPO update keeps for backward with and without train.autocast=bfloat16, on a bfloat16 base with
float32 LoRA adapters (peft's layout), in the same process:

    .venv/bin/python bench/autocast_memory.py [--model smollm2] [--rows 16] [--prompt 46] [--completion 48]

One micro-batch of random tokens (rows x (prompt + completion)), LoRA r16/alpha32 on all linear layers with
random non-zero B, beta 0.04 (the reference pass too), through rlora's own update (accumulate_policy_gradient).
Reported per setting: the bytes of the distinct tensors the autograd graph saved for backward (counted through
torch.autograd.graph.saved_tensors_hooks: what activation memory the update holds at its peak, independent of
the allocator), the GPU's peak allocated memory where the model is on a GPU, the loss, and the gradient's cosine
and norm ratio against the model's own precision. Runs anywhere (on a CPU without native bf16 slowly).
"""

from __future__ import annotations

import argparse

import torch

from bench_common import model_folder, random_up_factors
from rlora.algos.advantages import per_token
from rlora.algos.registry import get_algorithm
from rlora.logging.console import quiet_libraries
from rlora.config import AlgoConfig, LoraConfig, ModelConfig
from rlora.models.adapters import reference_policy
from rlora.models.loading import attach_lora, load_base_model, trainable_parameters
from rlora.models.precision import SavedForBackward, trainer_precision
from rlora.train.update import ScoredRollout, accumulate_policy_gradient, batched_logprobs
from rlora.types import Rollout


def random_rollout(rows: int, prompt: int, completion: int, vocab: int) -> Rollout:
    g = torch.Generator().manual_seed(0)
    return Rollout(prompt_ids_BTp=torch.randint(0, vocab, (rows, prompt), generator=g),
                   prompt_mask_BTp=torch.ones(rows, prompt, dtype=torch.long),
                   completion_ids_BTc=torch.randint(0, vocab, (rows, completion), generator=g),
                   completion_mask_BTc=torch.ones(rows, completion, dtype=torch.long),
                   completions=[""] * rows, finish_reasons=["length"] * rows, temperature_B=torch.ones(rows))


def update(model, rollout: Rollout, autocast: str) -> tuple[float, torch.Tensor, int, float | None]:
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rows = rollout.num_completions
    advantages = per_token(torch.linspace(-1, 1, rows), rollout.completion_mask_BTc)
    with trainer_precision(model, autocast):
        with reference_policy(model):
            ref = batched_logprobs(model, rollout, rows)
        scored = ScoredRollout(rollout, advantages, rollout.completion_mask_BTc, None, ref)
        with SavedForBackward() as kept:
            metrics = accumulate_policy_gradient(model, get_algorithm("grpo"), AlgoConfig(beta=0.04), scored, rows,
                                                 rollout.completion_ids_BTc.shape[1])
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return metrics["loss"], torch.cat([p.grad.flatten().double() for p in trainable_parameters(model)]), kept.bytes, peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, qwen2-0.1b, qwen2.5-0.5b or a model folder")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=46)
    parser.add_argument("--completion", type=int, default=48)
    args = parser.parse_args()
    quiet_libraries()
    folder = model_folder(args.model)
    torch.manual_seed(0)  # peft draws the LoRA A factors from torch's global generator
    model = attach_lora(load_base_model(ModelConfig(path=folder, dtype="bfloat16", device=args.device), folder),
                        LoraConfig(rank=16, alpha=32))
    random_up_factors(model, seed=1)
    vocab = model.get_base_model().config.vocab_size
    rollout = random_rollout(args.rows, args.prompt, args.completion, vocab)
    device = next(model.parameters()).device
    print(f"# {args.model} bfloat16 base, float32 LoRA r16 all-linear, {args.rows} rows x ({args.prompt} + "
          f"{args.completion}) tokens, one micro-batch, beta 0.04, {device}")
    print(f"{'train.autocast':<15} {'kept for backward MiB':>22} {'GPU peak MiB':>13} {'loss':>12} {'grad cosine':>12} "
          f"{'grad norm ratio':>16}")
    results = {setting: update(model, rollout, setting) for setting in ("off", "bfloat16")}
    base_grad = results["off"][1]
    for setting, (loss, grad, kept, peak) in results.items():
        cosine = float(grad @ base_grad / (grad.norm() * base_grad.norm()))  # float64: a float32 sum over ~5M drifts ~1e-3
        peak_text = "-" if peak is None else f"{peak:.0f}"
        print(f"{setting:<15} {kept / 2**20:>22.1f} {peak_text:>13} {loss:>12.6f} {cosine:>12.6f} "
              f"{float(grad.norm() / base_grad.norm()):>16.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
