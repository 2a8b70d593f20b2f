"""The data of one forward_backward that begin alike, run once (`rlora serve`).

A multi-turn client trains each turn as its own datum whenever a turn's prompt does not extend the previous turn's
tokens (a reply cut at max_tokens and rendered again with its end-of-turn; a chat template that drops earlier
reasoning): turn k's datum then holds the whole history up to it, and a step of ten-turn episodes runs each
episode's history some ten times. Here the data are planned into trees (prefix_trees): the longest datum of a tree
(its root) runs whole, with a key/value cache; every other member runs only its tokens after the prefix it shares
with the root, attending to the root's cached keys and values (tree_logprobs). A member's log-prob at a shared
position is the root's where their targets agree, and is computed from the root's hidden state with its own target
where they do not. The backward sums every member's gradient into the root's pass through the cache, so the
gradients are those of the data run apart, up to the rounding of differently shaped products (tested against them:
tests/test_serve_shared_prefix.py; in float64 to float32's resolution, in which the log-softmax and RMSNorm run).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from rlora.models.loading import causal_lm
from rlora.models.logprobs import supports_chunked
from rlora.models.packed_groups import attention_window
from rlora.models.shared_prompts import prompt_cache_unsupported
from rlora.serve.logprobs import head_logprobs
from rlora.tensors import common_prefix_length

MIN_SHARED = 32  # tokens a datum must share with a root to run on its cache: less is not worth a second call


@dataclass
class Tree:
    """Data indices: the root (runs whole) first, then its members; shared[i]: tokens members[i] shares with it."""

    root: int
    members: list[int]
    shared: list[int]

    @property
    def data(self) -> list[int]:
        return [self.root, *self.members]


def prefix_trees(tokens: list[list[int]], min_shared: int = MIN_SHARED) -> tuple[list[Tree], list[int]]:
    """Data (their input tokens) -> (trees of two data or more, the indices of data that share no prefix of at least
    min_shared tokens and half their own with a root). Longest first, each datum joins the root it shares the longest
    prefix with, or becomes a root. The roots are kept in lexicographic order: the one sharing the longest prefix with
    a datum is next to where the datum would go (O(n log n) comparisons, a request of thousands of data included)."""
    arrays = [np.asarray(t, dtype=np.int64) for t in tokens]
    keys = [tuple(t) for t in tokens]
    trees: list[Tree] = []
    ordered: list[tuple[tuple, int]] = []  # (root's tokens, its tree), sorted
    for i in sorted(range(len(arrays)), key=lambda j: (-len(arrays[j]), j)):
        at = bisect.bisect_left(ordered, (keys[i], -1))
        best, best_shared = None, 0
        for neighbour in ordered[max(at - 1, 0):at + 1]:
            tree = trees[neighbour[1]]
            shared = common_prefix_length(arrays[tree.root], arrays[i])
            if shared > best_shared:
                best, best_shared = tree, shared
        # it joins where the root holds at least half of it (else its own tokens would run almost whole, and as a root
        # it may serve data that share more with it: one episode's turn joins its own episode's longest turn)
        if best is not None and best_shared >= min_shared and 2 * best_shared >= len(arrays[i]):
            best.members.append(i)
            best.shared.append(best_shared)
        else:
            trees.append(Tree(i, [], []))
            ordered.insert(at, (keys[i], len(trees) - 1))
    return [t for t in trees if t.members], sorted(t.root for t in trees if not t.members)


def sharing_unsupported(model: nn.Module, longest: int) -> str | None:
    """Why the data of this model cannot run as trees (None: they can). The members' attention reads the root's cache
    through the model's own attention with left-padded keys, which a sliding window would count wrongly."""
    if not supports_chunked(model):
        return "a family outside rlora's chunked log-prob path"
    config = causal_lm(model).config.get_text_config()
    window = attention_window(config)
    if window == 0:
        return "layers other than attention"
    if window is not None and longest >= window:  # a sliding layer's cache keeps only the last window - 1 keys
        return f"a sliding window of {window} positions within the data's {longest}"
    return prompt_cache_unsupported(model)


class TreePass:
    """One tree's forward (and backward) in chunks of its rows (right-padded; row 0 the root, row b > 0 sharing its
    first shared_B[b] tokens with it; one target a position). The root runs once on creation; chunks(...) yields each
    chunk's rows and their log-probs ([n, T] float32, 0 on padding), whose loss the caller may backward before taking
    the next; finish() then runs the root's backward once. The chunks read the root's outputs (its final hidden
    states, keys and values, log-probs) as leaves that gather the chunks' gradients, so the root's graph is walked once
    however many chunks there are, and no chunk's activations outlive it."""

    def __init__(self, model: nn.Module, ids_BT: torch.Tensor, mask_BT: torch.Tensor, targets_BT: torch.Tensor,
                 shared_B: list[int]):
        self.model, self.ids_BT, self.mask_BT, self.targets_BT, self.shared_B = model, ids_BT, mask_BT, targets_BT, shared_B
        self.lengths = mask_BT.sum(-1).tolist()
        L, device = self.lengths[0], ids_BT.device
        self.config = causal_lm(model).config
        self.decoder = causal_lm(model).get_decoder()
        root = self.decoder(input_ids=ids_BT[:1, :L], position_ids=torch.arange(L, device=device)[None],
                            use_cache=True)
        kv = [(layer.keys, layer.values) for layer in root.past_key_values.layers]
        hidden_LH = root.last_hidden_state[0]
        logp_L = head_logprobs(model, hidden_LH, targets_BT[0, :L])
        self._outputs = [hidden_LH, logp_L, *(x for pair in kv for x in pair)]
        leaves = [x.detach().requires_grad_(x.requires_grad) for x in self._outputs]
        self.hidden_LH, self.logp_L = leaves[0], leaves[1]
        self.kv = list(zip(leaves[2::2], leaves[3::2]))
        self._leaves = leaves

    def chunks(self, max_tokens: int):
        """(rows, their log-probs [n, T]) for chunks of rows whose own tokens (padded) stay within max_tokens and whose
        copies of the root's keys and values within 2 x max_tokens positions (attention may expand them to every query
        head and keep them for the backward); the root's row comes first. A row with no token of its own (all of it
        shared) costs nothing here and joins the chunk at hand."""
        chunk, tails, tail_W, past_W = [0], 0, 0, 0
        for b in range(1, len(self.lengths)):
            own = self.lengths[b] - self.shared_B[b]
            if own:
                grown_tail, grown_past = max(tail_W, own), max(past_W, self.shared_B[b])
                if tails and (grown_tail * (tails + 1) > max_tokens or grown_past * (tails + 1) > 2 * max_tokens):
                    yield chunk, self._logprobs(chunk)
                    chunk, tails, grown_tail, grown_past = [], 0, own, self.shared_B[b]
                tails, tail_W, past_W = tails + 1, grown_tail, grown_past
            chunk.append(b)
        yield chunk, self._logprobs(chunk)

    def finish(self) -> None:
        """The root's backward (one walk of its graph, its output layer's included) with what the chunks' backwards
        gathered in its outputs' leaves; nothing when none did (forward only)."""
        pairs = [(out, leaf.grad) for out, leaf in zip(self._outputs, self._leaves)
                 if leaf.grad is not None and out.requires_grad]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        self._outputs = self._leaves = self.kv = []  # the root's graph and leaves go before the next tree's root runs
        self.hidden_LH = self.logp_L = None

    def _tails(self, rows: list[int]) -> dict[int, torch.Tensor]:
        """The final hidden states of these rows' own tokens (after their shared prefix), run on the root's cache."""
        shared, lengths, device = self.shared_B, self.lengths, self.ids_BT.device
        tails = [b for b in rows if b and shared[b] < lengths[b]]
        if not tails:
            return {}
        past_W = max(shared[b] for b in tails)
        tail_W = max(lengths[b] - shared[b] for b in tails)
        # each tail reads its shared part of the root's keys and values, left-padded to past_W
        cache = DynamicCache([tuple(torch.cat([F.pad(x[:, :, :shared[b]], (0, 0, past_W - shared[b], 0)) for b in tails])
                                    for x in pair) for pair in self.kv], config=self.config)
        past_mask = torch.stack([(torch.arange(past_W, device=device) >= past_W - shared[b]) for b in tails])
        tail_ids, tail_mask = (torch.stack([F.pad(x[b, shared[b]:lengths[b]], (0, tail_W - lengths[b] + shared[b]))
                                            for b in tails]) for x in (self.ids_BT, self.mask_BT))
        positions = torch.stack([shared[b] + torch.arange(tail_W, device=device) for b in tails])
        out = self.decoder(input_ids=tail_ids, attention_mask=torch.cat([past_mask.long(), tail_mask], dim=1),
                           position_ids=positions, past_key_values=cache, use_cache=True).last_hidden_state
        return {b: out[i, :lengths[b] - shared[b]] for i, b in enumerate(tails)}

    def _logprobs(self, rows: list[int]) -> torch.Tensor:
        """These rows' log-probs: the root's where a row's position is shared and its target agrees, else from one
        output-layer run over the root's hidden states (shared positions, other targets) and the rows' own tokens."""
        device, T = self.ids_BT.device, self.ids_BT.shape[1]
        targets_BT, lengths, L = self.targets_BT, self.lengths, self.lengths[0]
        tail_hidden = self._tails(rows)
        hidden, targets, index, offset = [], [], [], L  # index: into [root log-probs, this chunk's head run]
        for b in rows:
            s = self.shared_B[b]
            own_S = targets_BT[b, :s] != targets_BT[0, :s]  # shared positions whose target is not the root's
            differ = own_S.nonzero().squeeze(-1)
            hidden += [self.hidden_LH[differ], tail_hidden.get(b, self.hidden_LH[:0])]
            targets += [targets_BT[b, differ], targets_BT[b, s:lengths[b]]]
            row = torch.arange(lengths[b], device=device)
            row[:s][own_S] = offset + torch.arange(len(differ), device=device)
            row[s:] = offset + len(differ) + torch.arange(lengths[b] - s, device=device)
            index.append(row)
            offset += len(differ) + lengths[b] - s
        logp_N = torch.cat([self.logp_L, head_logprobs(self.model, torch.cat(hidden), torch.cat(targets))])
        rows_N = torch.cat([torch.full((lengths[b],), i, device=device) for i, b in enumerate(rows)])
        columns_N = torch.cat([torch.arange(lengths[b], device=device) for b in rows])
        logp_nT = torch.zeros(len(rows), T, dtype=torch.float32, device=device)
        return logp_nT.index_put((rows_N, columns_N), logp_N[torch.cat(index)])
