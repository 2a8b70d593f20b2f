"""The GRPO update's forward and backward with each prompt's rows packed (train.pack_groups, models/packed_groups.py)
against shared prompts' padded rows, on one batch, alternating in one process:

    .venv/bin/python bench/packed_groups.py [--model smollm2] [--prompts 2] [--G 8] [--prompt 46]
        [--lengths 5,48] [--repeats 5] [--device auto] [--dtype float32] [--force | --capacity N] [--dense]
        [--unshared]

P prompts x G rows of random tokens; each row's completion length uniform in [LO, HI], one row of each prompt
at HI (a row that ran to the length limit, as in the demo's steps). LoRA r16/alpha32 on all linear layers with
random non-zero B (float32 adapters on a float32 or bfloat16 base), GRPO (beta 0) through rlora's own update
(accumulate_policy_gradient). Reported: seconds per update (median, min-max over the repeats), what autograd keeps
for the backward (the distinct storages saved: the update's activation memory, independent of the allocator), the
ratio packed / padded, and how far the two layouts' log-probs and gradients are apart (max |diff|, cosine).
The packed layout is the estimate's choice (bins of `cheapest_capacity` completion tokens per sequence); --force
packs even where the estimate prefers the padded pass, --capacity N packs in bins of N tokens (N at least a prompt's
rows' total: one sequence per prompt). A packed pass attends by the layout's structure (models/packed_attention.py);
--dense adds a third side that attends with the dense [Ns, Ns] mask instead (what a pass under gradient
checkpointing does; its own estimate picks its bins); --unshared one that runs every row's prompt (train.share_prompts
off: what a sliding-window model's passes ran before its rows within the window were shared and packed).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from bench_common import model_folder, random_up_factors
from rlora.algos.advantages import per_token
from rlora.algos.registry import get_algorithm
from rlora.batching import trim
from rlora.config import AlgoConfig, LoraConfig, ModelConfig
from rlora.logging.console import quiet_libraries
from rlora.models import packed_groups
from rlora.models.loading import attach_lora, load_base_model, model_device, trainable_parameters
from rlora.models.logprobs import completion_logprobs
from rlora.models.packed_groups import plan_packing, set_group_packing
from rlora.models.precision import SavedForBackward
from rlora.models.shared_prompts import prompt_groups, set_prompt_sharing
from rlora.train.update import ScoredRollout, accumulate_policy_gradient
from rlora.types import Rollout


def ragged_rollout(prompts: int, G: int, prompt_len: int, lo: int, hi: int, vocab: int) -> Rollout:
    g = torch.Generator().manual_seed(0)
    rows = prompts * G
    lengths_B = torch.randint(lo, hi + 1, (rows,), generator=g)
    lengths_B[::G] = hi
    return Rollout(
        prompt_ids_BTp=torch.randint(0, vocab, (prompts, prompt_len), generator=g).repeat_interleave(G, 0),
        prompt_mask_BTp=torch.ones(rows, prompt_len, dtype=torch.long),
        completion_ids_BTc=torch.randint(0, vocab, (rows, hi), generator=g),
        completion_mask_BTc=(torch.arange(hi)[None] < lengths_B[:, None]).long(),
        completions=[""] * rows, finish_reasons=["stop"] * rows, temperature_B=torch.ones(rows))


def update(model, rollout: Rollout) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    rows = rollout.num_completions
    advantages = per_token(torch.linspace(-1, 1, rows), rollout.completion_mask_BTc)
    scored = ScoredRollout(rollout, advantages, rollout.completion_mask_BTc, None, None)
    start = time.perf_counter()
    accumulate_policy_gradient(model, get_algorithm("grpo"), AlgoConfig(beta=0.0), scored, rows,
                               rollout.completion_ids_BTc.shape[1])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, torch.cat([p.grad.flatten().double() for p in trainable_parameters(model)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="smollm2, qwen2-0.1b, qwen2.5-0.5b, gemma3-270m or a model folder")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the base's dtype")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=46)
    parser.add_argument("--lengths", default="5,48", help="LO,HI: completion lengths uniform in [LO, HI]")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--force", action="store_true",
                        help="pack even where the arithmetic estimate (packing_pays) would not, to check the estimate")
    parser.add_argument("--capacity", type=int, default=None,
                        help="pack in bins of this many completion tokens, whatever the estimate says")
    parser.add_argument("--dense", action="store_true",
                        help="also time packed passes that attend with a dense mask (the attention before 2026-11-28)")
    parser.add_argument("--unshared", action="store_true", help="also time passes that share no prompt")
    args = parser.parse_args()
    lo, hi = (int(x) for x in args.lengths.split(","))
    quiet_libraries()
    folder = model_folder(args.model)
    torch.manual_seed(0)  # peft draws the LoRA A factors from torch's global generator
    model = attach_lora(load_base_model(ModelConfig(path=folder, dtype=args.dtype, device=args.device), folder),
                        LoraConfig(rank=16, alpha=32))
    random_up_factors(model, seed=1)
    rollout = ragged_rollout(args.prompts, args.G, args.prompt, lo, hi, model.get_base_model().config.vocab_size)
    mask_BT = rollout.completion_mask_BTc.bool()
    if args.force:
        packed_groups.packing_pays = lambda *_, **__: True
    if args.capacity is not None:
        packed_groups.cheapest_capacity = lambda *_, **__: args.capacity
    batch = trim(rollout.to(model_device(model)))
    structured = packed_groups.recomputes_forward
    sides = ["structured", "padded"] + (["dense"] if args.dense else []) + (["unshared"] if args.unshared else [])

    def use(side: str) -> None:  # what the next passes do
        set_prompt_sharing(model, side != "unshared")
        set_group_packing(model, side not in ("padded", "unshared"))
        packed_groups.recomputes_forward = (lambda model: True) if side == "dense" else structured

    print(f"# {args.model} {args.dtype}, LoRA r16 all-linear; {args.prompts} prompts x {args.G} rows, "
          f"prompt {args.prompt}, completions {lo}-{hi} ({int(mask_BT.sum())} of {mask_BT.numel()} positions real); "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    forced = " (forced: --force)" if args.force else f" (forced: --capacity {args.capacity})" if args.capacity else ""
    for side in [side for side in sides if side not in ("padded", "unshared")]:
        use(side)
        layout = plan_packing(model, batch, prompt_groups(batch))
        refused = packed_groups.group_packing_unsupported(model, batch)
        print(f"# {side}: not packed ({refused})" if refused else
              f"# {side}: the estimate does not pack this batch" if layout is None else
              f"# {side}, packed{forced}: {len(layout.prompt_S)} sequences of {layout.num_positions} positions")
    times: dict[str, list[float]] = {side: [] for side in sides}
    grads: dict[str, torch.Tensor] = {}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for side in sides:
            use(side)
            seconds, grads[side] = update(model, rollout)
            if repeat:
                times[side].append(seconds)
    kept, logp = {}, {}
    for side in sides:  # apart from the timed rounds: the hooks cost time
        use(side)
        with SavedForBackward() as saved:
            update(model, rollout)
        kept[side] = saved.bytes / 2**20
        with torch.no_grad():
            logp[side] = completion_logprobs(model, rollout)[0].cpu()
    medians = {side: statistics.median(values) for side, values in times.items()}
    labels = {"padded": "padded (shared prompts)", "structured": "packed groups", "dense": "packed, dense mask",
              "unshared": "unshared (each row)"}
    for side in sides:
        values = times[side]
        print(f"{labels[side]:<24} {medians[side]:8.3f} s  ({min(values):.3f}-{max(values):.3f}), kept for backward "
              f"{kept[side]:.1f} MiB")
    for side in sides:
        if side == "padded":
            continue
        cosine = float(torch.nn.functional.cosine_similarity(grads[side], grads["padded"], dim=0))
        print(f"{labels[side]} / padded: {medians[side] / medians['padded']:.2f}x; log-probs max |diff| "
              f"{float((logp[side] - logp['padded'])[mask_BT].abs().max()):.2e}; gradient cosine {cosine:.9f}, "
              f"norm ratio {float(grads[side].norm() / grads['padded'].norm()):.7f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
