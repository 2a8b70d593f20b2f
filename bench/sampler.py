"""Sampling throughput: rlora's built-in engine against Hugging Face `generate` with an unmerged peft
adapter, on the same model, adapter, prompts and settings, alternating A, B, A, B.

The `hf` side is plain `generate` with transformers' own sampling (the baseline every speed-up here is against);
`hf-draw` is rlora's fallback sampler, `generate` with rlora's draw (rollout/generate_draw.py: the engine's draw and
its log-probs), for what that draw costs over plain `generate`.

    .venv/bin/python bench/sampler.py [--model smollm2] [--prompts 4] [--G 8] [--tokens 64] [--repeats 3]

Work per call: P demo prompts (chat template) x G samples x `tokens` new tokens. EOS is suppressed until
`tokens` (min_new_tokens = max_new_tokens) so both sides generate exactly the same number of tokens;
--natural lets completions end at EOS instead (the engine then stops computing finished rows).
--ragged LO,HI gives each prompt its own length, uniform in [LO, HI] (seeded; EOS suppressed until then), as
long reasoning traces end at very different steps: use G=1, many prompts and --max-rows below the rows.
The -chunks sides decode fixed chunks of --max-rows rows (the next chunk starts when the chunk's longest row
ends), the others refill a slot as soon as its rows end (continuous batching). It also prints the lock-step
occupancy of one chunk of all rows, tokens / (rows x longest row): the share of a fixed-shape step's rows
doing useful work when nothing refills them.
builtin-compiled: the fixed-shape (static) step compiled with torch.compile (inductor, static shapes), warmed
up on the measured call's own shapes (the compile time is printed, not counted): what a compiled graph would
save per step on a CPU, where CUDA graphs do not exist.
The adapter is LoRA r16/alpha32 on all linear layers with random non-zero B, so it changes the outputs.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from types import SimpleNamespace

import torch
from transformers import GenerationConfig

from bench_common import model_folder, random_up_factors, task_rows
from rlora.logging.console import quiet_libraries
from rlora.config import LoraConfig, ModelConfig
from rlora.models.loading import add_model_eos_ids, attach_lora, load_base_model, load_tokenizer
from rlora.rollout import graphed
from rlora.rollout.engine import BuiltinGenerator
from rlora.rollout.generator import HFGenerator
from rlora.rollout.packed import packed_fp16_available
from rlora.tensors import left_padded
from rlora.types import SamplingParams


def build(model_name: str, dtype: str):
    folder = model_folder(model_name)
    tokenizer, tok = load_tokenizer(folder)
    base = load_base_model(ModelConfig(path=folder, dtype=dtype), folder)
    add_model_eos_ids(tok, base)
    model = attach_lora(base, LoraConfig(rank=16, alpha=32))
    random_up_factors(model, seed=0)
    model.eval()
    return tokenizer, tok, model


class CompiledStaticGenerator(BuiltinGenerator):
    """The static decode step under torch.compile (a benchmark side, not an engine option: compiling a 30-layer
    step took minutes of a 2-core CPU, and every new prompt width or row count compiles again)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs, decode="static")
        self.compiled = torch.compile(graphed.static_decode_step, dynamic=False)

    def sample(self, *args, **kwargs):
        eager_step = graphed.static_decode_step
        graphed.static_decode_step = self.compiled
        try:
            return super().sample(*args, **kwargs)
        finally:
            graphed.static_decode_step = eager_step


class PlainGenerate:
    """transformers `generate` with its own sampling (do_sample, temperature, no top-k/top-p), one call per chunk of
    rows: the baseline of the speed-ups (rlora's HFGenerator before it drew tokens itself, 2026-11-30)."""

    name = "generate"

    def __init__(self, tokenizer, eos_ids: list[int], pad_id: int):
        self.tokenizer, self.eos_ids, self.pad_id = tokenizer, eos_ids, pad_id

    @torch.no_grad()
    def sample(self, model, prompts, n, params, seed):
        """-> an object with completion_mask_BTc only (what the timing counts); one call per run of prompts with
        the same settings (--ragged gives each prompt its own length)."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        torch.manual_seed(seed)
        device, generated = next(model.parameters()).device, 0
        start = 0
        while start < len(prompts):
            end = start + 1
            while end < len(prompts) and per_prompt[end] == per_prompt[start]:
                end += 1
            setting = per_prompt[start]
            ids, mask = left_padded([p for p in prompts[start:end] for _ in range(n)], self.pad_id)
            config = GenerationConfig(do_sample=True, temperature=setting.temperature, top_k=0, top_p=1.0,
                                      max_new_tokens=setting.max_new_tokens,
                                      min_new_tokens=setting.min_new_tokens or None, eos_token_id=self.eos_ids,
                                      pad_token_id=self.pad_id, repetition_penalty=1.0,
                                      stop_strings=list(setting.stop) or None)
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                                 tokenizer=self.tokenizer)
            is_eos = torch.isin(out[:, ids.shape[1]:].cpu(), torch.tensor(self.eos_ids))
            generated += int((is_eos.long().cumsum(-1) - is_eos.long() == 0).sum())  # tokens up to each row's EOS
            start = end
        return SimpleNamespace(completion_mask_BTc=torch.tensor([generated]))


def copy_bandwidth_gbs(device: torch.device, gib: float = 1.0, repeats: int = 10) -> float:
    """Measured device memory bandwidth: a large device-to-device copy, bytes read + written per second."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * src.numel() * repeats / (time.perf_counter() - start) / 1e9


def decode_bytes(model, prompt_lens: list[int], G: int, tokens: int) -> float:
    """The fewest bytes the decode steps must read at fixed length: each step reads every decoder and
    output-layer weight once (in the model's dtype; the embedding lookup is negligible) and the KV cache
    so far, each prompt's part once per group. Prefill is not counted."""
    cfg = model.get_base_model().config
    itemsize = next(model.parameters()).element_size()
    decoder = model.get_base_model().get_decoder()
    weights = sum(p.numel() for n, p in decoder.layers.named_parameters() if "lora_" not in n)
    weights += model.get_base_model().get_output_embeddings().weight.numel()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * itemsize
    steps = range(1, tokens)  # the first new token comes from the prefill
    kv = sum(kv_per_token * (sum(prompt_lens) + len(prompt_lens) * G * t) for t in steps)
    return len(steps) * weights * itemsize + kv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="smollm2, tiny, qwen2-0.1b, qwen2.5-0.5b, gemma3-270m, qwen3-moe-0.1b or a model folder")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--natural", action="store_true", help="let completions end at EOS")
    parser.add_argument("--stop", default=None,
                        help="a stop string for every row (e.g. one never written: the cost of checking each token)")
    parser.add_argument("--ragged", default=None, help="LO,HI: per-prompt lengths uniform in [LO, HI]")
    parser.add_argument("--max-rows", type=int, default=None,
                        help="rows the built-in sides decode together (default: the engine's own limit)")
    parser.add_argument("--sides", default="builtin,builtin-bf16,hf",
                        help="comma-separated subset of builtin, builtin-eager, builtin-static, builtin-compiled, builtin-chunks and "
                        "builtin-static-chunks (fixed chunks of --max-rows rows instead of continuous batching), "
                        "builtin-unmerged, builtin-bf16, "
                        "builtin-fp16w (float32 compute from float16 base weights, x86 CPUs), hf (plain generate), "
                        "hf-draw (rlora's fallback: generate with rlora's draw)")
    args = parser.parse_args()
    quiet_libraries()
    tokenizer, tok, model = build(args.model, args.dtype)
    rows = task_rows("train", train_size=1000)[:args.prompts]  # held-out problems are removed: draw plenty
    if len(rows) < args.prompts:
        parser.error(f"only {len(rows)} distinct training prompts available")
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True) for r in rows]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    stop = (args.stop,) if args.stop else ()
    params = SamplingParams(max_new_tokens=args.tokens, temperature=args.temperature,
                            min_new_tokens=0 if args.natural else args.tokens, stop=stop)
    if args.ragged:
        low, high = (int(x) for x in args.ragged.split(","))
        lengths = torch.randint(low, high + 1, (args.prompts,), generator=torch.Generator().manual_seed(0)).tolist()
        params = [SamplingParams(max_new_tokens=n, temperature=args.temperature, min_new_tokens=n, stop=stop)
                  for n in lengths]
        occupancy = sum(lengths) / (len(lengths) * max(lengths))
    ours = dict(tokenizer=tokenizer, eos_ids=tok.eos_ids, pad_id=tok.pad_id, max_rows=args.max_rows)
    sides = {
        "builtin": BuiltinGenerator(**ours, merge=True),  # GPU: CUDA graphs
        "builtin-eager": BuiltinGenerator(**ours, merge=True, decode="eager"),
        "builtin-static": BuiltinGenerator(**ours, merge=True, decode="static"),
        "builtin-compiled": CompiledStaticGenerator(**ours, merge=True),
        "builtin-chunks": BuiltinGenerator(**ours, merge=True, continuous=False),
        "builtin-static-chunks": BuiltinGenerator(**ours, merge=True, decode="static", continuous=False),
        "builtin-unmerged": BuiltinGenerator(**ours, merge=False),
        "builtin-bf16": BuiltinGenerator(**ours, merge=True, dtype=torch.bfloat16),
        # MKL's products over merged weight copies (the CPU's float32 / bf16 sampler before oneDNN packs)
        "builtin-mkl": BuiltinGenerator(**ours, merge=True, onednn=False),
        "builtin-bf16-mkl": BuiltinGenerator(**ours, merge=True, dtype=torch.bfloat16, onednn=False),
        "builtin-fp16w": BuiltinGenerator(**ours, merge=True, fp16_weights=True) if packed_fp16_available() else None,
        "hf": PlainGenerate(tokenizer, tok.eos_ids, tok.pad_id),
        "hf-draw": HFGenerator(tokenizer, tok.eos_ids, tok.pad_id, batch_size=args.prompts * args.G),
    }
    unknown = set(args.sides.split(",")) - sides.keys()
    if unknown or any(sides[k] is None for k in args.sides.split(",")):
        parser.error(f"unknown or unavailable sides: {sorted(unknown) or 'builtin-fp16w (no fbgemm in this torch)'}")
    sides = {k: v for k, v in sides.items() if k in args.sides.split(",")}
    shape = f"ragged {args.ragged} tokens" if args.ragged else f"{args.tokens} tokens"
    print(f"# sampling: {args.model} {args.dtype}, {args.prompts} prompts x G={args.G} x {shape} "
          f"({'to EOS' if args.natural else 'fixed length'}), prompt tokens {min(map(len, prompts))}-{max(map(len, prompts))}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    times = {name: [] for name in sides}
    tokens = {name: [] for name in sides}
    for name, gen in sides.items():  # warm-up, not counted
        if isinstance(gen, CompiledStaticGenerator):  # compiles for the measured call's shapes
            start = time.perf_counter()
            gen.sample(model, prompts, args.G, params, seed=0)
            print(f"{name}: compiled in {time.perf_counter() - start:.1f} s (warm-up, not counted)")
            continue
        gen.sample(model, prompts[:1], 2, SamplingParams(max_new_tokens=4), seed=0)
    for repeat in range(args.repeats):
        for name, gen in sides.items():
            start = time.perf_counter()
            rollout = gen.sample(model, prompts, args.G, params, seed=repeat)
            times[name].append(time.perf_counter() - start)
            tokens[name].append(int(rollout.completion_mask_BTc.sum()))
    print(f"{'side':<18} {'median s':>9} {'min-max s':>13} {'tokens':>7} {'tok/s':>8} {'speed-up vs hf':>15}")
    hf_median = statistics.median(times["hf"]) if "hf" in times else None
    for name in sides:
        med = statistics.median(times[name])
        tok_s = statistics.median(t / s for t, s in zip(tokens[name], times[name]))
        ratios = [h / s for h, s in zip(times["hf"], times[name])] if hf_median else []
        speedup = f"{statistics.median(ratios):.2f}x" if ratios else "-"
        print(f"{name:<18} {med:9.2f} {min(times[name]):6.2f}-{max(times[name]):<6.2f} {statistics.median(tokens[name]):7.0f} "
              f"{tok_s:8.1f} {speedup:>15}")
    print("speed-up: median over repeats of (hf time / side time) within the same repeat")
    if args.ragged:
        print(f"lock-step occupancy (tokens / (rows x longest)): {occupancy:.2f}")
    device = next(model.parameters()).device
    if device.type == "cuda" and not args.natural and not args.ragged:
        bandwidth = copy_bandwidth_gbs(device)
        floor_s = decode_bytes(model, [len(p) for p in prompts], args.G, args.tokens) / (bandwidth * 1e9)
        print(f"GPU {torch.cuda.get_device_name(device)}: copy bandwidth {bandwidth:.0f} GB/s; decode bandwidth floor "
              f"{floor_s:.3f} s; peak allocated {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
        for name in sides:
            print(f"{name:<18} reaches {floor_s / statistics.median(times[name]):.1%} of the bandwidth bound "
                  "(floor / median time, prefill included in the time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
