"""`rlora serve` in an agent's loop: its sampling with the prefix cache (serve/prefix_cache.py) and without, its
training with the turns' shared history run once (serve/shared_prefix.py) and apart.

--episodes episodes of --turns turns sample from one snapshot of a LoRA client (rank 16, the SDK's default targets),
through the server's worker directly (no HTTP): each turn sends one sample request per episode (num_samples 1,
--max-tokens tokens, stop=[] so exactly that many, temperature 1, a seed per episode and turn), all of a turn's
requests in one sampler call as the server batches them; the next turn's prompt is the last prompt, the sampled
reply with its last token rendered again as another (as a chat template writes a cut reply's end), and --observation
random tokens; the first prompt --first random tokens. The same loop runs with a fresh
prefix cache of --prefix-cache-mb and with none, alternating, a warm-up round first; reported: medians over
--repeats, the prompt tokens the turns sent and how many of them the cache saved running. Both ways send and sample
the same numbers of tokens (fixed lengths), so they do the same work but for the tokens the cache holds; their tokens
are the same (same seeds) until float rounding moves a draw, which on random prompts (flat next-token distributions,
where a token's probability is near the rounding of the cumulative sum) happens within a few turns: counted.

Then the client trains on the last round's turns as a cookbook loop sends them when a turn's prompt does not extend
the last turn's tokens: one datum per episode and turn (its prompt and reply; importance_sampling, advantages on the
reply), all in one forward_backward, with trees (the default) and with every datum run apart, alternating, medians
over --repeats after a warm-up.

    .venv/bin/python bench/serve_episodes.py [--model smollm2] [--episodes 16] [--turns 8] [--first 120]
        [--observation 24] [--max-tokens 24] [--repeats 3] [--prefix-cache-mb 1024]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
import warnings

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb

from bench_common import model_folder
from rlora.machine import cpu_flags
from rlora.serve import proto, wire
from rlora.serve.main import build
from rlora.serve.prefix_cache import PrefixCache


def _request(session: str, prompt: list[int], max_tokens: int, seed: int) -> wire.Sample:
    return wire.Sample.model_validate({
        "sampling_session_id": session, "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
        "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "stop": []}})


END = 2  # the token a cut reply's last one is rendered again as


def _episodes(worker, session: str, args, rng_seed: int) -> tuple[float, list[list[int]], int, list]:
    """One round of the loop -> (seconds, each episode's last prompt, prompt tokens sent, every turn's (prompt, reply))."""
    rng = np.random.default_rng(rng_seed)
    prompts = [rng.integers(3, worker.vocab_size, args.first).tolist() for _ in range(args.episodes)]
    observations = rng.integers(3, worker.vocab_size, (args.turns, args.episodes, args.observation)).tolist()
    sent, seconds, turns = 0, 0.0, []
    for turn in range(args.turns):
        bodies = [_request(session, prompt, args.max_tokens, seed=turn * 1000 + e) for e, prompt in enumerate(prompts)]
        sent += sum(map(len, prompts))
        start = time.perf_counter()
        results = worker.sample(session, bodies)
        seconds += time.perf_counter() - start
        for e, result in enumerate(results):
            reply = np.frombuffer(pb.SampleResponse.FromString(result).sequences[0].tokens, dtype=np.int32).tolist()
            turns.append((prompts[e], reply))
            prompts[e] = prompts[e] + reply[:-1] + [END] + observations[turn][e]
    return seconds, prompts, sent, turns


def _training_request(model_id: str, turns: list) -> proto.ForwardBackward:
    data = []
    for prompt, reply in turns:
        tokens = prompt + reply
        advantages = np.zeros(len(tokens) - 1, dtype=np.float32)
        advantages[-len(reply):] = 1.0
        data.append(proto.Datum(tokens[:-1], {"target_tokens": np.asarray(tokens[1:], dtype=np.int64),
                                              "logprobs": np.full(len(tokens) - 1, -2.0, dtype=np.float32),
                                              "advantages": advantages}))
    return proto.ForwardBackward(model_id, None, "importance_sampling", {}, False, data)


def _trained(worker, request: proto.ForwardBackward, min_shared: int | None) -> float:
    worker.min_shared_prefix = min_shared
    start = time.perf_counter()
    worker.forward_backward(request, {})
    seconds = time.perf_counter() - start
    for param in worker.trainees[request.model_id].params:  # the next round starts from no gradients
        param.grad = None
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' (the embedded SmolLM2-135M-Instruct) or a folder")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--first", type=int, default=120, help="tokens of each episode's first prompt")
    parser.add_argument("--observation", type=int, default=24, help="tokens added after each reply")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens sampled per turn")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefix-cache-mb", type=int, default=1024)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*tie_word_embeddings")
    budget = args.prefix_cache_mb * 2**20
    with tempfile.TemporaryDirectory(prefix="rlora-bench-serve-") as state_dir:
        _, served = build(model_folder(args.model), state_dir)
        served.jobs.stop()  # the worker is driven directly here
        worker = served.worker
        worker.create_model("bench:train:0", wire.LoraSpec(rank=16, seed=0))
        session = "bench:sample:0"
        worker.save_for_sampler("bench:train:0", None, session)
        times: dict[str, list[float]] = {"cache": [], "none": []}
        saved, sent, finals, alike = [], 0, {}, []
        for repeat in range(args.repeats + 1):  # the first round warms up
            for way in (("cache", "none") if repeat % 2 else ("none", "cache")):
                worker.prefix_cache = PrefixCache(budget if way == "cache" else 0)
                seconds, finals[way], sent, turns = _episodes(worker, session, args, rng_seed=repeat)
                if way == "cache" and repeat:
                    saved.append(worker.prefix_cache.reused_tokens)
                if repeat:
                    times[way].append(seconds)
            alike.append(sum(a == b for a, b in zip(finals["cache"], finals["none"])))
        request, default = _training_request("bench:train:0", turns), worker.min_shared_prefix
        training: dict[str, list[float]] = {"trees": [], "apart": []}
        for repeat in range(args.repeats + 1):
            for way in (("trees", "apart") if repeat % 2 else ("apart", "trees")):
                seconds = _trained(worker, request, default if way == "trees" else None)
                if repeat:
                    training[way].append(seconds)
    device = next(worker.model.parameters()).device
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))) or "none read"
    print(f"# serve episodes: {served.names[0]}, {args.episodes} episodes x {args.turns} turns, first prompt "
          f"{args.first} tokens, +{args.max_tokens} sampled +{args.observation} observed a turn; {device}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; "
          f"CPU flags: {flags}; medians of {args.repeats}")
    print(f"# prompt tokens sent in a round: {sent}; run again with the cache: {sent - statistics.median(saved):.0f} "
          f"({statistics.median(saved) / sent:.0%} of them reused); episodes "
          f"alike token for token in both ways: {', '.join(map(str, alike))} of {args.episodes} per round")
    for way, values in times.items():
        print(f"{way:<6} {statistics.median(values):8.3f} s   (runs {', '.join(f'{v:.3f}' for v in values)})")
    print(f"without / with the prefix cache: {statistics.median(times['none']) / statistics.median(times['cache']):.2f}x")
    trained = sum(len(d.tokens) for d in request.data)
    print(f"# training: one forward_backward of the last round's {len(request.data)} turns ({trained} tokens), "
          f"importance_sampling")
    for way, values in training.items():
        print(f"{way:<6} {statistics.median(values):8.3f} s   (runs {', '.join(f'{v:.3f}' for v in values)})")
    print(f"apart / as trees: {statistics.median(training['apart']) / statistics.median(training['trees']):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
