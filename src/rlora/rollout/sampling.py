"""Token sampling math, per row: temperature, top-k, top-p, min-p, greedy. Pure tensor functions.

Order (as in Hugging Face's warpers): divide by temperature, keep the top-k logits, keep the smallest set
of tokens whose probability (renormalised after top-k) reaches top-p, then drop tokens whose probability
is below min-p times the most likely token's. The returned log-probability is that of the chosen token
under the temperature-scaled, *untruncated* distribution: the quantity the trainer recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlora.types import SamplingParams


@dataclass
class RowParams:
    """Sampling settings per row (A rows)."""

    temperature_A: torch.Tensor  # float; 1.0 for greedy rows
    top_k_A: torch.Tensor  # long, 0 = off
    top_p_A: torch.Tensor  # float, 1.0 = off
    min_p_A: torch.Tensor  # float, 0.0 = off
    greedy_A: torch.Tensor  # bool
    max_new_A: torch.Tensor  # long
    min_new_A: torch.Tensor  # long

    @classmethod
    def per_row(cls, params: Sequence[SamplingParams], n: int, device=None) -> "RowParams":
        """One SamplingParams per prompt -> n rows per prompt (prompt-major)."""
        rows = [p for p in params for _ in range(n)]

        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature_A=col([1.0 if p.greedy else p.temperature for p in rows], torch.float32),
            top_k_A=col([p.top_k for p in rows], torch.long),
            top_p_A=col([p.top_p for p in rows], torch.float32),
            min_p_A=col([p.min_p for p in rows], torch.float32),
            greedy_A=col([p.greedy for p in rows], torch.bool),
            max_new_A=col([p.max_new_tokens for p in rows], torch.long),
            min_new_A=col([p.min_new_tokens for p in rows], torch.long),
        )

    def select(self, index: torch.Tensor) -> "RowParams":
        return RowParams(*(getattr(self, f)[index] for f in self.__dataclass_fields__))


_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


_SEED_MIX, _STEP_MIX = _signed(0xD1B54A32D192ED03), _signed(0x8CB92BA72F3D8DD7)


def counter_uniform(seed: int | torch.Tensor, keys_A: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) (float64) per row from (seed, row key, token index t): splitmix64 of a counter
    (int64 arithmetic wraps modulo 2^64, as the hash needs). A row's draws depend on nothing but its own
    key, so splitting a batch across processes or chunks never changes what is sampled. seed: one for all
    rows, or one per row (int64 [A]: rows of several policies, each with its own seed). t: an int, or a
    one-element int64 tensor on the rows' device (a CUDA graph replays it with any t).

    The counter gets splitmix64's increment before mixing: without it (seed 0, key 0, t 0) is the counter 0,
    which the mix maps to 0, so row 0 of every seed-0 run drew u = 0 (the lowest-index token with any
    probability) as its first token. u takes the top 52 bits, centred in their interval: (m + 0.5) / 2^52 is
    exact in float64 for every m < 2^52, so u is never 0 or 1 (with 53 bits the largest would round to 1)."""
    if isinstance(t, torch.Tensor):
        step = t.to(torch.int64) * _STEP_MIX + _GOLDEN
        offset = step + (seed.to(torch.int64) * _SEED_MIX if isinstance(seed, torch.Tensor) else _signed(seed * _SEED_MIX))
    elif isinstance(seed, torch.Tensor):
        offset = seed.to(torch.int64) * _SEED_MIX + _signed(t * _STEP_MIX + _GOLDEN)
    else:
        offset = _signed(seed * _SEED_MIX + t * _STEP_MIX + _GOLDEN)
    x = keys_A.to(torch.int64) * _GOLDEN + offset
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    return (_shift_right(x, 12).to(torch.float64) + 0.5) * 2.0**-52


CANDIDATES = 1024  # top-k/top-p look at this many most likely tokens first (a full vocabulary sort is slow)


def truncate_logits(scaled_AV: torch.Tensor, top_k_A: torch.Tensor, top_p_A: torch.Tensor,
                    min_p_A: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled logits -> the same with excluded tokens set to -inf (float32)."""
    scaled_AV = scaled_AV.float()
    k_on_A, p_on_A = top_k_A > 0, top_p_A < 1
    if bool((k_on_A | p_on_A).any()):
        scaled_AV = _top_k_top_p(scaled_AV, top_k_A, top_p_A, k_on_A, p_on_A)
    if bool((min_p_A > 0).any()):
        probs_AV = scaled_AV.softmax(-1)
        drop_AV = probs_AV < min_p_A[:, None] * probs_AV.amax(-1, keepdim=True)
        scaled_AV = scaled_AV.masked_fill(drop_AV, float("-inf"))
    return scaled_AV


def _top_k_top_p(scaled_AV, top_k_A, top_p_A, k_on_A, p_on_A):
    """Top-k, then top-p on the top-k-renormalised distribution, decided among the C most likely tokens.
    That is exact whenever those C tokens hold at least top_p of the mass (or top-k confines the row);
    other rows are decided by a full sort."""
    A, V = scaled_AV.shape
    C = min(V, max(CANDIDATES, int(top_k_A.max())))
    values_AC, index_AC = scaled_AV.topk(C, dim=-1)  # sorted, most likely first
    rank_C = torch.arange(C, device=scaled_AV.device)
    keep_AC = ~(k_on_A[:, None] & (rank_C >= top_k_A[:, None]))
    lse_candidates = values_AC.masked_fill(~keep_AC, float("-inf")).logsumexp(-1, keepdim=True)
    lse_all = scaled_AV.logsumexp(-1, keepdim=True)
    probs_AC = (values_AC - torch.where(k_on_A[:, None], lse_candidates, lse_all)).exp() * keep_AC
    before_AC = probs_AC.cumsum(-1) - probs_AC  # mass of the more likely tokens
    keep_AC &= ~(p_on_A[:, None] & (before_AC >= top_p_A[:, None]))
    keep_AC[:, 0] = True  # the most likely token always stays
    truncated_AV = torch.full_like(scaled_AV, float("-inf")).scatter_(
        -1, index_AC, values_AC.masked_fill(~keep_AC, float("-inf")))
    out_AV = torch.where((k_on_A | p_on_A)[:, None], truncated_AV, scaled_AV)
    uncovered_A = p_on_A & ~k_on_A & (probs_AC.sum(-1) < top_p_A)
    if bool(uncovered_A.any()):
        rows = uncovered_A.nonzero().squeeze(-1)
        out_AV[rows] = truncate_by_sort(scaled_AV[rows], top_p_A[rows])
    return out_AV


def truncate_by_sort(scaled_AV: torch.Tensor, top_p_A: torch.Tensor) -> torch.Tensor:
    """Top-p by sorting the whole vocabulary (the reference; used for rows whose nucleus is very wide)."""
    sorted_AV, order_AV = scaled_AV.sort(dim=-1, descending=True)
    probs_AV = sorted_AV.softmax(-1)
    drop_AV = (probs_AV.cumsum(-1) - probs_AV) >= top_p_A[:, None]
    drop_AV[:, 0] = False
    return torch.empty_like(sorted_AV).scatter_(-1, order_AV, sorted_AV.masked_fill(drop_AV, float("-inf")))


@dataclass(frozen=True)
class DrawPlan:
    """Which optional parts of a draw a batch of rows needs, decided once for a chunk of rows so that a draw
    makes no device-to-host sync (a CUDA graph records it; the host does not wait on each token).
    truncate: some row has top-k, top-p or min-p; greedy: some row is greedy; banned: some row has
    min_new_tokens (its EOS is banned until then); unit_temperature: every row's temperature is 1 (the logits are
    then the scaled logits: x / 1 is x exactly, and a vocabulary-wide division and its [A, V] buffer are saved)."""

    truncate: bool
    greedy: bool
    banned: bool
    unit_temperature: bool = False

    @classmethod
    def of(cls, rows: RowParams) -> "DrawPlan":
        return cls(truncate=bool(((rows.top_k_A > 0) | (rows.top_p_A < 1) | (rows.min_p_A > 0)).any()),
                   greedy=bool(rows.greedy_A.any()), banned=bool((rows.min_new_A > 0).any()),
                   unit_temperature=bool((rows.temperature_A == 1).all()))


CDF_BLOCK = 1024  # tokens per block of the two-level inverse-CDF draw


def inverse_cdf_draw(allowed_AV: torch.Tensor, u_A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first token whose cumulative probability exceeds u (float64 [A], in (0, 1)) under softmax(allowed),
    and the log of the row's normaliser sum(exp(allowed)) -> (token_A, log_normaliser_A).

    Two levels instead of one float64 cumulative sum over the vocabulary: sums of blocks of CDF_BLOCK tokens
    (float64), the block where u falls, then a cumulative sum inside that block only. Only the order of the
    float64 additions differs from a full cumulative sum. A token with probability 0 (-inf) is never drawn:
    its cumulative mass equals its predecessor's, and where rounding puts the target past the block's last
    sum the draw takes the block's last token with probability > 0."""
    A, V = allowed_AV.shape
    blocks = -(-V // CDF_BLOCK)
    peak_A1 = allowed_AV.amax(-1, keepdim=True)
    # one [A, V] buffer, exponentiated in place (the same values as (x - peak).exp()), padded only where V is not a
    # multiple of the block: every fresh vocabulary-wide buffer costs page faults when the allocator maps it anew
    weights_AV = torch.sub(allowed_AV, peak_A1).exp_()
    if blocks * CDF_BLOCK != V:
        weights_AV = F.pad(weights_AV, (0, blocks * CDF_BLOCK - V))
    weights_ANB = weights_AV.view(A, blocks, CDF_BLOCK)
    cum_blocks_AN = weights_ANB.sum(-1, dtype=torch.float64).cumsum(-1)
    target_A1 = u_A.to(cum_blocks_AN)[:, None] * cum_blocks_AN[:, -1:]
    block_A1 = torch.searchsorted(cum_blocks_AN, target_A1, right=True).clamp(max=blocks - 1)
    before_A1 = torch.where(block_A1 > 0, cum_blocks_AN.gather(-1, (block_A1 - 1).clamp(min=0)), 0.0)
    inside_AB = weights_ANB.gather(1, block_A1[:, :, None].expand(A, 1, CDF_BLOCK)).squeeze(1)
    cum_inside_AB = inside_AB.cumsum(-1, dtype=torch.float64)
    index_A1 = torch.searchsorted(cum_inside_AB, target_A1 - before_A1, right=True)
    last_positive_A1 = ((inside_AB > 0) * torch.arange(CDF_BLOCK, device=allowed_AV.device)).amax(-1, keepdim=True)
    token_A = (block_A1 * CDF_BLOCK + torch.minimum(index_A1, last_positive_A1)).squeeze(-1)
    log_normaliser_A = peak_A1.squeeze(-1) + cum_blocks_AN[:, -1].log().to(peak_A1.dtype)
    return token_A, log_normaliser_A


def sample_tokens(logits_AV: torch.Tensor, rows: RowParams, randomness: torch.Generator | torch.Tensor | None,
                  banned_rows_A: torch.Tensor | None = None, banned_ids: list[int] | torch.Tensor | None = None,
                  plan: DrawPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (token_A, logp_A). Rows where banned_rows_A is True may not draw banned_ids (token ids, or a bool mask
    [V] on the logits' device; min_new_tokens blocks EOS this way); the log-prob stays that of the
    untruncated distribution. plan: what the rows need (DrawPlan.of(rows)); given, with banned_ids a mask, the
    draw makes no device-to-host sync or host-to-device copy. None: decided here from the rows."""
    if plan is None:
        plan = DrawPlan(truncate=bool(((rows.top_k_A > 0) | (rows.top_p_A < 1) | (rows.min_p_A > 0)).any()),
                        greedy=bool(rows.greedy_A.any()),
                        banned=banned_rows_A is not None and bool(banned_rows_A.any()),
                        unit_temperature=bool((rows.temperature_A == 1).all()))
    scaled_AV = logits_AV.float() if plan.unit_temperature else logits_AV.float() / rows.temperature_A[:, None]
    candidates_AV = scaled_AV
    if plan.banned and banned_rows_A is not None:
        # Banned tokens leave before truncation (as in generate), so top-k/top-p/min-p pick among the rest.
        banned_V = banned_ids
        if not isinstance(banned_V, torch.Tensor):
            banned_V = torch.zeros(scaled_AV.shape[-1], dtype=torch.bool, device=scaled_AV.device)
            banned_V[banned_ids] = True
        candidates_AV = scaled_AV.masked_fill(banned_rows_A[:, None] & banned_V, float("-inf"))
    allowed_AV = truncate_logits(candidates_AV, rows.top_k_A, rows.top_p_A, rows.min_p_A) if plan.truncate \
        else candidates_AV
    if isinstance(randomness, torch.Tensor):  # one uniform per row, given (counter_uniform)
        u_A = randomness.to(device=scaled_AV.device, dtype=torch.float64)
    else:
        u_A = torch.rand(scaled_AV.shape[0], generator=randomness, dtype=torch.float64, device=scaled_AV.device)
    token_A, log_normaliser_A = inverse_cdf_draw(allowed_AV, u_A)
    if plan.greedy:
        token_A = torch.where(rows.greedy_A, allowed_AV.argmax(-1), token_A)
    # the log-prob's normaliser is that of the untruncated distribution: the draw's own for a row that lost no token,
    # recomputed for rows that did; decided per row, so that a row's log-prob never depends on its neighbours'
    removed_A = None
    if plan.truncate:
        removed_A = (rows.top_k_A > 0) | (rows.top_p_A < 1) | (rows.min_p_A > 0)
    if candidates_AV is not scaled_AV:
        removed_A = banned_rows_A if removed_A is None else removed_A | banned_rows_A
    logsumexp_A = log_normaliser_A if removed_A is None else \
        torch.where(removed_A, scaled_AV.logsumexp(-1), log_normaliser_A)
    logp_A = scaled_AV.gather(-1, token_A[:, None]).squeeze(-1) - logsumexp_A
    return token_A, logp_A
