"""Run under torchrun by tests/test_fsdp.py: each rank samples its own, different workload from a sharded base
(train.fsdp_gather=model or layer) and from an unsharded copy of the same policy, and writes what it saw.

argv: model_dir gather out_dir. Rank 0 samples 3 prompts x 2 rows (2 chunks), rows ending at ragged steps;
rank 1 one prompt for 4 tokens. Then rank 0 alone makes two sampler calls in one sampling scope (as evaluation
does) while rank 1 only enters the scope. A forward hook on every layer's input norm counts, each time the
sampler uses a layer, how many layers are gathered (weights not a DTensor shard) on this rank."""

import json
import sys
import weakref

import torch
import torch.distributed as dist
from test_policy_model import make_policy, perturb_adapter
from torch.distributed.tensor import DTensor

from rlora.models.loading import causal_lm
from rlora.models.sharded_base import shard_layers
from rlora.rollout import decoder
from rlora.rollout.engine import BuiltinGenerator
from rlora.types import SamplingParams

TEXTS = ["What is 1 + 1?", "Name a colour", "Count to three: one", "Hi"]


def policy(model_dir):
    tokenizer, tok, model = make_policy(model_dir)
    perturb_adapter(model, scale=0.3, seed=1)
    return tokenizer, tok, model


def workloads(rank: int, ids: list[list[int]]):
    """(prompts, G, params) per sampler call; rank 0's rows end at ragged steps (a common token is EOS)."""
    if rank == 0:
        params = [SamplingParams(max_new_tokens=n, temperature=1.0) for n in (12, 7, 10)]
        return [(ids[:3], 2, params)], [(ids[3:], 2, SamplingParams(max_new_tokens=5, greedy=True)),
                                        (ids[:1], 1, SamplingParams(max_new_tokens=9, temperature=0.8))]
    return [(ids[3:], 2, SamplingParams(max_new_tokens=4, temperature=1.0))], []


def main(model_dir: str, gather: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    tokenizer, tok, reference = policy(model_dir)
    _, _, model = policy(model_dir)
    model.load_state_dict(reference.state_dict())  # the same adapter (lora_A draws differ between the two loads)
    sharded = shard_layers(model, torch.device("cpu"), gather, _any)
    layers = causal_lm(model).model.layers
    seen, fused_alive = [], []
    live = weakref.WeakSet()  # every fused linear map the sampler builds (merged weight copies), while it lives
    original_init = decoder.FusedLinear.__init__

    def tracked_init(self, *args, **kwargs):  # the peak: while a layer's view is built, the last one's may live
        original_init(self, *args, **kwargs)
        live.add(self)
        if any(not isinstance(layer.input_layernorm.weight, DTensor) for layer in layers):  # the sharded model's
            fused_alive.append(len(live))

    decoder.FusedLinear.__init__ = tracked_init

    def count(*_):
        seen.append(sum(not isinstance(layer.input_layernorm.weight, DTensor) for layer in layers))

    for layer in layers:
        layer.input_layernorm.register_forward_hook(count)
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    eos = ids[0][1]  # a token the tiny model samples now and then: rows end at different steps
    engine = BuiltinGenerator(tokenizer, [eos], tok.pad_id, max_rows=4)
    train_calls, eval_calls = workloads(rank, ids)
    results = []
    for prompts, G, params in train_calls:  # every rank samples (a training step)
        with sharded.sampling():
            results.append((engine.sample(model, prompts, G, params, seed=3), (prompts, G, params, 3)))
    with sharded.sampling():  # evaluation: rank 0 samples, rank 1 waits in the scope
        for prompts, G, params in eval_calls:
            results.append((engine.sample(model, prompts, G, params, seed=4), (prompts, G, params, 4)))
    # the unsharded model as a sharded base samples it: from merged copies (the default engine would run this
    # resident base from oneDNN packs: the same products through another kernel, equal only to float32 rounding)
    merged = BuiltinGenerator(tokenizer, [eos], tok.pad_id, max_rows=4, onednn=False)
    same = []
    for ours, (prompts, G, params, seed) in results:
        theirs = merged.sample(reference, prompts, G, params, seed=seed)
        same.append({"tokens": torch.equal(ours.completion_ids_BTc, theirs.completion_ids_BTc),
                     "mask": torch.equal(ours.completion_mask_BTc, theirs.completion_mask_BTc),
                     "logp_diff": float((ours.sampling_logp_BTc - theirs.sampling_logp_BTc).abs().max()),
                     "reasons": ours.finish_reasons == theirs.finish_reasons,
                     "lengths": ours.completion_mask_BTc.sum(-1).tolist()})
    gathered_after = sum(not isinstance(layer.input_layernorm.weight, DTensor) for layer in layers)
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"same": same, "max_gathered": max(seen), "uses": len(seen), "gathered_after": gathered_after,
                   "layers": len(layers), "passes": sharded.passes, "max_fused_alive": max(fused_alive)}, f)
    dist.destroy_process_group()


def _any(flag: bool) -> bool:
    tensor = torch.tensor([float(flag)])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item() > 0)


if __name__ == "__main__":
    main(*sys.argv[1:4])
