"""`rlora serve`'s prefix cache: the keys and values of the rows it sampled, kept by the tokens they hold, so that
a later request whose prompt begins with such tokens runs only the rest (the engine's sample_continued).

An agent's episode sends, turn after turn, its whole history: the previous prompt, the reply just sampled, the new
observation. Without the cache each turn runs that history through the model again; with it a turn runs its new
tokens only. A prompt takes the longest prefix any kept row shares with it (a common system prompt too), as long
as one whole block of BLOCK tokens matches, and never its last token (the sampler must run at least one).

Kept rows are indexed by chained hashes of their whole blocks, per sampler weights (serve/worker.py: the loaded
adapter's name, which no other load gets, or None for the base): other weights' keys and values are never reused. The least recently used rows go first once
the budget (bytes of keys and values) is full; a row that a newer one extends is dropped when that one is kept.
Reused keys and values come from the decode step rather than a prefill of the same tokens, so a continued
prompt's numbers differ from a fresh one's by float rounding only (tests/test_serve_prefix_cache.py).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import numpy as np

from rlora.rollout.kvcache import RowCache
from rlora.tensors import common_prefix_length

BLOCK = 16  # tokens hashed together: shorter shared prefixes are not worth a lookup
DEFAULT_MB = 1024


@dataclass
class _Kept:
    weights: Hashable  # whose keys and values: a loaded sampler adapter's name, None for the base
    tokens_T: np.ndarray  # int64: the tokens `cache` holds the keys and values of
    cache: RowCache
    hashes: list[int]  # chained hashes of its whole blocks
    nbytes: int


def _chained(tokens_T: np.ndarray) -> Iterator[int]:
    """The hash of each whole block's prefix: block i's chains block i-1's, so equal hashes at block i mean (but for
    collisions, which lookups check) equal first (i + 1) * BLOCK tokens."""
    previous = 0
    for start in range(0, len(tokens_T) - BLOCK + 1, BLOCK):
        previous = hash((previous, tokens_T[start:start + BLOCK].tobytes()))
        yield previous


def _nbytes(cache: RowCache) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in cache.layers)


class PrefixCache:
    """Sampled rows' keys and values by their tokens, within `budget_bytes` (0: nothing kept, no lookups)."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"the prefix cache's budget is {budget_bytes} bytes: give 0 (off) or more")
        self.budget = budget_bytes
        self._kept: OrderedDict[int, _Kept] = OrderedDict()  # least recently used first
        self._by_block: dict[tuple[Hashable, int], set[int]] = {}  # (weights, chained hash) -> ids of rows holding it
        self._ids = itertools.count()
        self.nbytes = 0
        self.prompt_tokens = self.reused_tokens = 0  # over every lookup: tokens the prompts held, tokens reused

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def __len__(self) -> int:
        return len(self._kept)

    def rows_of(self, weights: Hashable) -> int:
        """How many rows sampled from these weights are kept."""
        return sum(kept.weights == weights for kept in list(self._kept.values()))

    def longest(self, weights: Hashable, prompt: list[int]) -> RowCache | None:
        """The kept keys and values of the longest prefix of `prompt` that a row sampled from these weights holds,
        short of the prompt's last token; None when no whole block matches."""
        self.prompt_tokens += len(prompt)
        tokens_T = np.asarray(prompt, dtype=np.int64)
        usable_T = tokens_T[:-1]
        candidates: set[int] = set()
        for block_hash in _chained(usable_T):  # deeper blocks hold fewer rows: stop at the first missing
            ids = self._by_block.get((weights, block_hash))
            if not ids:
                break
            candidates = ids
        best, best_length = None, 0
        for kept_id in candidates:
            length = common_prefix_length(self._kept[kept_id].tokens_T, usable_T)
            if length > best_length:
                best, best_length = kept_id, length
        if best is None or best_length < BLOCK:  # only a hash collision matched
            return None
        self._kept.move_to_end(best)
        self.reused_tokens += best_length
        return RowCache([(k[:, :best_length], v[:, :best_length]) for k, v in self._kept[best].cache.layers])

    def keep(self, weights: Hashable, tokens: list[int], cache: RowCache) -> None:
        """A sampled row's keys and values (cache) of its `tokens` (its prompt and its sample but the last token)."""
        if len(tokens) != cache.length:
            raise ValueError(f"{len(tokens)} tokens for a cache of {cache.length} positions")
        nbytes = _nbytes(cache)
        if len(tokens) < BLOCK or nbytes > self.budget:
            return
        tokens_T = np.asarray(tokens, dtype=np.int64)
        hashes = list(_chained(tokens_T))
        for kept_id in self._by_block.get((weights, hashes[-1]), ()):
            if common_prefix_length(self._kept[kept_id].tokens_T, tokens_T) == len(tokens_T):
                self._kept.move_to_end(kept_id)  # a kept row extends (or equals) this one: it serves what this would
                return
        for level, block_hash in enumerate(hashes):  # kept rows this one extends go (each checked at its last block)
            for kept_id in [i for i in self._by_block.get((weights, block_hash), ())
                            if len(self._kept[i].hashes) == level + 1]:
                if common_prefix_length(self._kept[kept_id].tokens_T, tokens_T) == len(self._kept[kept_id].tokens_T):
                    self._drop(kept_id)
        kept_id = next(self._ids)
        self._kept[kept_id] = _Kept(weights, tokens_T, cache, hashes, nbytes)
        for block_hash in hashes:
            self._by_block.setdefault((weights, block_hash), set()).add(kept_id)
        self.nbytes += nbytes
        while self.nbytes > self.budget:
            self._drop(next(iter(self._kept)))

    def forget(self, weights: Hashable) -> None:
        """Every row sampled from these weights goes (their snapshot was dropped)."""
        for kept_id in [i for i, kept in self._kept.items() if kept.weights == weights]:
            self._drop(kept_id)

    def _drop(self, kept_id: int) -> None:
        kept = self._kept.pop(kept_id)
        self.nbytes -= kept.nbytes
        for block_hash in kept.hashes:
            ids = self._by_block[(kept.weights, block_hash)]
            ids.discard(kept_id)
            if not ids:
                del self._by_block[(kept.weights, block_hash)]
