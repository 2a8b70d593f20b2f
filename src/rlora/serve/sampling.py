"""What `rlora serve`'s sampling needs beside the model: a sampling session's record, tinker's sampling settings
as rlora's, and rlora's sampler on a decoder kept between requests."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from rlora.rollout.decoder import DecoderView
from rlora.rollout.engine import BuiltinGenerator
from rlora.serve import proto, wire
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


def responses(rollout: Rollout, logp_BTc, G: int, prompt_logprobs: list[list[float] | None],
              prompt_topk: list | None = None) -> list[bytes]:
    """The protobuf sample response of each request of a sampler call: its G rows (prompt-major), their tokens up to
    and with the one that ended them, their log-probs, whether a stop ended them; its prompt's log-probs and top-k
    (proto.sample_response) where it asked for them."""
    prompt_topk = prompt_topk or [None] * len(prompt_logprobs)
    results = []
    # one read back of the rollout (it may sit on a GPU), then plain lists
    lengths, ids, logps = rollout.completion_mask_BTc.sum(-1).tolist(), rollout.completion_ids_BTc.tolist(), logp_BTc.tolist()
    for i, prompt_lp in enumerate(prompt_logprobs):
        sequences = []
        for row in range(i * G, (i + 1) * G):
            n = lengths[row]
            sequences.append(proto.Sequence(ids[row][:n], logps[row][:n], rollout.finish_reasons[row] == "stop"))
        results.append(proto.sample_response(sequences, prompt_lp, prompt_topk[i]))
    return results
