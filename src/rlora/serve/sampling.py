"""What `rlora serve`'s sampling needs beside the model: a sampling session's record, tinker's sampling settings
as rlora's, and rlora's sampler on a decoder kept between requests."""

from __future__ import annotations

import secrets
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from rlora.rollout.decoder import DecoderView
from rlora.rollout.engine import BuiltinGenerator
from rlora.rollout.kvcache import RowCache
from rlora.serve import proto, wire
from rlora.serve.prefix_cache import PrefixCache
from rlora.serve.prompt_scores import (
    Draws, PromptScores, TargetCells, check_asks, only_last, sampled_topk, score_prompt,
)
from rlora.serve.state import Snapshot
from rlora.types import Rollout, SamplingParams


@dataclass
class Sampler:
    snapshot: Snapshot | None  # None: the base
    model_path: str | None  # the tinker path it was made from (None: the base or an unnamed snapshot)


class ViewGenerator(BuiltinGenerator):
    """rlora's sampler on a decoder built before: the same weights, so the same samples, without merging the
    adapter into fresh weight copies (or stacking it beside the base's packs) again for every request."""

    def __init__(self, view: DecoderView, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.view = view

    def decoder_view(self, model) -> DecoderView:
        return self.view


def sample_reusing(cache: PrefixCache, weights: Hashable, generator: BuiltinGenerator, model, prompts: list[list[int]],
                   G: int, params: Sequence[SamplingParams], seed: int | Sequence[int], keys: Sequence[int]) -> Rollout:
    """generator.sample(), each prompt continued from the longest prefix of it the cache holds for these weights (only
    its other tokens run), every sampled row kept in the cache as its slot finishes (within the cache's budget). The
    rollout's prompt tensors hold the parts that ran."""
    past = [cache.longest(weights, prompt) for prompt in prompts]
    found = [row_cache for row_cache in past if row_cache is not None]
    if found:  # a prompt with nothing kept continues an empty row
        empty = RowCache([(k[:, :0], v[:, :0]) for k, v in found[0].layers])
        past = [empty if row_cache is None else row_cache for row_cache in past]
    runs = [prompt[row_cache.length:] for prompt, row_cache in zip(prompts, past)] if found else prompts

    def keep(row: int, sample: list[int], row_cache: RowCache) -> None:
        cache.keep(weights, prompts[row // G] + sample[:-1], row_cache)

    rollout, _ = generator.sample_continued(model, runs, G, params, seed, keys=keys, past=past if found else None,
                                            route_by=prompts, keep=keep)  # a sequence router reads whole prompts
    return rollout


def sampling_settings(sp: wire.SamplingParams, eos_ids: list[int]) -> tuple[SamplingParams, list[int], int]:
    """tinker's sampling params -> (rlora's, the token ids that end a sample, the seed). `stop` as strings ends a
    sample after the text; as token ids it replaces EOS; temperature 0 is greedy; no seed draws a random one."""
    stop, ends, stop_strings = sp.stop, list(eos_ids), ()
    if isinstance(stop, str):
        stop_strings = (stop,)
    elif isinstance(stop, list) and stop and isinstance(stop[0], str):
        stop_strings = tuple(stop)
    elif isinstance(stop, list):  # token ids (or []): they replace EOS
        ends = list(stop)
    greedy = sp.temperature == 0
    params = SamplingParams(max_new_tokens=sp.max_tokens, temperature=1.0 if greedy else sp.temperature,
                            top_p=sp.top_p, top_k=max(sp.top_k, 0), greedy=greedy, stop=stop_strings)
    seed = (sp.seed if sp.seed is not None else secrets.randbits(62)) % (2**63 - 1)
    return params, ends, seed


@dataclass
class Asked:
    """What one sample request asked beside its samples, computed (serve/prompt_scores.py)."""

    prompt_logprobs: list[float] | None = None
    scores: PromptScores | None = None
    targets: TargetCells | None = None
    sample_topk: list[tuple[np.ndarray, np.ndarray]] | None = None  # per sample: ids [n, k], log-probs [n, k]


def asked_of(model, r: wire.Sample, prompt: list[int], params: SamplingParams, seed: int, samples: list[list[int]],
             vocab_size: int, prompt_logprobs) -> Asked:
    """What a request asked beside its samples (app.py checked it), under the model as it is switched now: its
    prompt's log-probs (prompt_logprobs(model, prompt)), its prompt's top-k, targets and draws (one forward of the
    prompt), its samples' top-k (one forward of its samples)."""
    targets = check_asks(r, len(prompt), vocab_size)
    draws = Draws(r.prompt_alt_tokens_k, params.temperature, params.greedy, seed) if r.prompt_alt_tokens_k else None
    asked = Asked(prompt_logprobs=prompt_logprobs(model, prompt) if r.prompt_logprobs else None, targets=targets)
    if r.topk_prompt_logprobs or targets is not None or draws is not None:
        asked.scores = score_prompt(model, prompt, r.topk_prompt_logprobs, targets, draws)
    if r.topk_sample_logprobs:
        asked.sample_topk = sampled_topk(model, prompt, samples, params.temperature, r.topk_sample_logprobs)
    if r.prompt_logprobs_last_n is not None:  # only the last N positions scored: the others as the first one
        top = asked.scores.topk if asked.scores is not None else None
        asked.prompt_logprobs, top = only_last(r.prompt_logprobs_last_n, asked.prompt_logprobs, top)
        if asked.scores is not None:
            asked.scores.topk = top
    return asked


def completions(rollout: Rollout) -> list[list[int]]:
    """Each row's tokens up to and with the one that ended it (one read back of the rollout, which may sit on a GPU)."""
    lengths, ids = rollout.completion_mask_BTc.sum(-1).tolist(), rollout.completion_ids_BTc.tolist()
    return [row[:n] for row, n in zip(ids, lengths)]


def responses(rollout: Rollout, logp_BTc, G: int, asked: list[Asked]) -> list[bytes]:
    """The protobuf sample response of each request of a sampler call: its G rows (prompt-major), their tokens up to
    and with the one that ended them, their log-probs, whether a stop ended them; what else it asked for
    (proto.sample_response)."""
    tokens, logps = completions(rollout), logp_BTc.tolist()
    results = []
    for i, ask in enumerate(asked):
        sequences = []
        for j, row in enumerate(range(i * G, (i + 1) * G)):
            n = len(tokens[row])
            topk = None if ask.sample_topk is None else ask.sample_topk[j]
            sequences.append(proto.Sequence(tokens[row], logps[row][:n], rollout.finish_reasons[row] == "stop", topk))
        results.append(proto.sample_response(sequences, ask.prompt_logprobs, ask.scores, ask.targets))
    return results
