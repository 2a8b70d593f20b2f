"""`rlora sft`'s gradient step with the output layer run only at the positions that predict a trained token
(train/sft.py labelled_nll_sum) against the model's full logits at every position (token_nll_sum of model(...)
.logits, what it did before), on the same rows, alternating, medians over --repeats.

Rows: the arithmetic task's prompts as chat rows (the model's chat template), each answered with a short reply
("The answer is N."), so most positions are prompt, as in a chat SFT set; LoRA of --rank on the attention and
MLP layers (rlora's defaults).

    .venv/bin/python bench/sft_output_layer.py [--model smollm2] [--rows 16] [--micro 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings

import torch

from bench_common import model_folder, task_rows
from rlora.config import LoraConfig, ModelConfig
from rlora.data.sft_data import Conversation, num_targets, tokenize
from rlora.machine import cpu_flags
from rlora.models.loading import attach_lora, load_base_model, load_tokenizer
from rlora.train import sft


def _full_logits_nll(model, ids_BT, mask_BT, labels_BT):
    return sft.token_nll_sum(model(input_ids=ids_BT, attention_mask=mask_BT).logits, labels_BT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' (the embedded SmolLM2-135M-Instruct) or a folder")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--micro", type=int, default=8, help="rows per forward")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*tie_word_embeddings")
    folder = model_folder(args.model)
    tokenizer = load_tokenizer(folder)[0]
    rows = [tokenize(tokenizer, Conversation(r["prompt"] + [{"role": "assistant", "content": f"The answer is {r['answer']}."}],
                                             True), True, 0) for r in task_rows("train")[:args.rows]]
    torch.manual_seed(0)
    model = attach_lora(load_base_model(ModelConfig(path=folder), folder), LoraConfig(rank=args.rank))
    labelled = sft.labelled_nll_sum
    ways = {"full logits": _full_logits_nll, "labelled positions": labelled}
    times: dict[str, list[float]] = {way: [] for way in ways}
    losses: dict[str, float] = {}
    try:
        for repeat in range(args.repeats + 1):  # the first round warms up
            for way, nll in ways.items():
                sft.labelled_nll_sum = nll  # what backward_batch calls
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                loss, _ = sft.backward_batch(model, rows, args.micro, tokenizer.pad_token_id)
                if repeat:
                    times[way].append(time.perf_counter() - start)
                losses[way] = loss
    finally:
        sft.labelled_nll_sum = labelled
    tokens = sum(len(r.ids) for r in rows)
    trained = sum(num_targets(r) for r in rows)
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))) or "none read"
    print(f"# sft output layer: {folder}, {args.rows} rows ({tokens} tokens, {trained} trained), {args.micro} a forward, "
          f"rank {args.rank}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; CPU flags: {flags}; medians of {args.repeats}")
    for way, values in times.items():
        print(f"{way:<19} {statistics.median(values):8.3f} s   loss {losses[way]:.6f}   "
              f"(runs {', '.join(f'{v:.3f}' for v in values)})")
    ratio = statistics.median(times["labelled positions"]) / statistics.median(times["full logits"])
    print(f"labelled / full: {ratio:.2f}x the time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
