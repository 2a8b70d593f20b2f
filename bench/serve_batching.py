"""`rlora serve`: K training clients' forward_backward in one batched pass (one base forward for all their rows,
serve/batched.py) against the same requests one after another, through the worker directly (no HTTP, no queue);
and N sample requests of one sampling session (an RL step sends one per group) in one sampler call against one
after another.

Each client is a LoRA of --rank on the attention, MLP and output layers (the SDK's default targets) with its own
seed; each sends one cross_entropy forward_backward of --data random sequences of --tokens tokens. Both ways run
on the same clients in the same round (a warm-up round first, not timed), their gradients dropped after each;
reported: medians over --repeats rounds and sequential / batched. The pass is timed as serve/batched.py runs it
whatever its size: on a CPU `rlora serve` itself batches clients only while their tokens together fit one CPU
forward (1024; app.py), so the defaults (4 x 1024 tokens) time a batch it forms only on a GPU. The sample requests (--sample-requests prompts
of --prompt-tokens random tokens, --samples each, --max-tokens, temperature 1, each its own seed) sample client
0's adapter (a snapshot).

With --snapshot-switch, two more ways time the batched sample requests as an RL loop meets them: a new snapshot
each round (its decoder made again), the base from the oneDNN weight packs the server keeps (the default on an x86
CPU) against merged weight copies made per snapshot.

    .venv/bin/python bench/serve_batching.py [--model smollm2] [--clients 4] [--data 8] [--tokens 128] [--repeats 3]
        [--sample-requests 16] [--samples 8] [--prompt-tokens 40] [--max-tokens 16] [--snapshot-switch]
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

from bench_common import model_folder
from rlora.machine import cpu_flags
from rlora.serve import proto, wire
from rlora.serve.main import build


def _requests(worker, clients: int, data: int, tokens: int, rank: int) -> list[tuple[proto.ForwardBackward, dict]]:
    rng = np.random.default_rng(0)
    requests = []
    for k in range(clients):
        model_id = f"bench:train:{k}"
        worker.create_model(model_id, wire.LoraSpec(rank=rank, seed=k))
        rows = []
        for _ in range(data):
            ids = rng.integers(0, worker.vocab_size, tokens + 1)
            rows.append(proto.Datum(ids[:-1].tolist(), {"target_tokens": ids[1:].astype(np.int64)}))
        requests.append((proto.ForwardBackward(model_id, None, "cross_entropy", {}, False, rows), {}))
    return requests


def _sample_bodies(worker, count: int, samples: int, prompt_tokens: int, max_tokens: int) -> tuple[str, list]:
    """A sampling session on a snapshot of client 0's adapter and `count` sample requests for it."""
    session = "bench:sample:0"
    worker.save_for_sampler("bench:train:0", None, session)
    rng = np.random.default_rng(1)
    bodies = [wire.Sample.model_validate({
        "sampling_session_id": session, "num_samples": samples,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": rng.integers(0, worker.vocab_size, prompt_tokens).tolist()}]},
        "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "seed": i, "stop": []}})
        for i in range(count)]
    return session, bodies


def _after_a_snapshot_switch(worker, session: str, bodies: list, packs: bool) -> list:
    """The batched requests as the first of a new snapshot: the kept decoder dropped, then made from the packs
    (made once for the server's life) or from merged weight copies. The kept decoder is put back after, so the
    other ways sample as they would without these two."""
    kept, worker.view = worker.view, None
    worker.packer.onednn = packs
    try:
        return worker.sample(session, bodies)
    finally:
        worker.packer.onednn, worker.view = True, kept


def _timed(worker, run) -> float:
    start = time.perf_counter()
    outcomes = run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    failed = [o for o in outcomes if isinstance(o, Exception)]
    if failed:
        raise failed[0]
    for trainee in worker.trainees.values():  # the next round starts from no gradients
        for param in trainee.params:
            param.grad = None
        trainee.loss_since_step = 0.0
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' (the embedded SmolLM2-135M-Instruct) or a folder")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--data", type=int, default=8, help="sequences per client's forward_backward")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sample-requests", type=int, default=16, help="sample requests of one session (0: none)")
    parser.add_argument("--samples", type=int, default=8, help="num_samples of each")
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens sampled (stop=[]: exactly these)")
    parser.add_argument("--snapshot-switch", action="store_true", help="also time the batched requests after a "
                        "snapshot switch, from the kept weight packs and from merged copies")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*tie_word_embeddings")
    with tempfile.TemporaryDirectory(prefix="rlora-bench-serve-") as state_dir:
        _, served = build(model_folder(args.model), state_dir)
        served.jobs.stop()  # the worker is driven directly here
        worker = served.worker
        requests = _requests(worker, args.clients, args.data, args.tokens, args.rank)
        ways = {"sequential": lambda: [worker.forward_backward(r, c) for r, c in requests],
                "batched": lambda: worker.forward_backward_batch(requests)}
        if args.sample_requests:
            session, bodies = _sample_bodies(worker, args.sample_requests, args.samples, args.prompt_tokens, args.max_tokens)
            ways["sample sequential"] = lambda: [worker.sample(session, [body])[0] for body in bodies]
            ways["sample batched"] = lambda: worker.sample(session, bodies)
            if args.snapshot_switch:
                ways["switch, packs"] = lambda: _after_a_snapshot_switch(worker, session, bodies, packs=True)
                ways["switch, merged"] = lambda: _after_a_snapshot_switch(worker, session, bodies, packs=False)
        times: dict[str, list[float]] = {way: [] for way in ways}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for way, run in ways.items():
                seconds = _timed(worker, run)
                if repeat:
                    times[way].append(seconds)
        assert worker.last_batch == args.clients, "the batched pass did not run every client"
    device = next(worker.model.parameters()).device
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))) or "none read"
    print(f"# serve batching: {served.names[0]}, {args.clients} clients x {args.data} sequences x {args.tokens} tokens, "
          f"rank {args.rank}, cross_entropy; {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; CPU flags: {flags}; medians of {args.repeats}")
    if args.sample_requests:
        print(f"# sampling: {args.sample_requests} requests x {args.samples} samples, {args.prompt_tokens} prompt tokens, "
              f"{args.max_tokens} tokens sampled, temperature 1")
    for way, values in times.items():
        print(f"{way:<18} {statistics.median(values):8.3f} s   (runs {', '.join(f'{v:.3f}' for v in values)})")
    for prefix in ("", "sample ")[:1 + bool(args.sample_requests)]:
        ratio = statistics.median(times[f"{prefix}sequential"]) / statistics.median(times[f"{prefix}batched"])
        print(f"{prefix or 'forward_backward '}sequential / batched: {ratio:.2f}x")
    if args.sample_requests and args.snapshot_switch:
        if worker.packer.packs_for(worker.model) is None:
            print("# no oneDNN weight packs on this machine: both switch ways sampled from merged copies")
        ratio = statistics.median(times["switch, packs"]) / statistics.median(times["switch, merged"])
        print(f"after a snapshot switch, packs / merged copies: {ratio:.2f}x the time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
