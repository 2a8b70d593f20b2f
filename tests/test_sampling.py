"""Sampling math: truncation equals Hugging Face's warpers, draws follow the truncated distribution, the
returned log-prob is that of the untruncated temperature-scaled distribution."""

import dataclasses

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from rlora.rollout import sampling
from rlora.rollout.sampling import RowParams, sample_tokens, truncate_logits
from rlora.types import SamplingParams


def hf_truncate(logits, top_k, top_p, min_p):
    out = logits.clone()
    if top_k:
        out = TopKLogitsWarper(top_k)(None, out)
    if top_p < 1:
        out = TopPLogitsWarper(top_p)(None, out)
    if min_p:
        out = MinPLogitsWarper(min_p)(None, out)
    return out


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 0.9, 0), (50, 1.0, 0), (50, 0.8, 0), (0, 1.0, 0.1),
                                               (10, 0.5, 0.2), (0, 0.999, 0), (0, 0.3, 0.05)])
@pytest.mark.parametrize("candidates", [4096, 16])  # 16: most rows need the full-sort fallback
def test_truncation_equals_hf_warpers(monkeypatch, top_k, top_p, min_p, candidates):
    monkeypatch.setattr(sampling, "CANDIDATES", candidates)
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(0)) * 4
    ours = truncate_logits(logits, torch.full((6,), top_k), torch.full((6,), top_p), torch.full((6,), float(min_p)))
    want = hf_truncate(logits, top_k, top_p, min_p)
    differ = torch.isinf(ours) != torch.isinf(want)
    # Same rule, summed in a different order: they may only disagree on tokens that sit at the top-p
    # boundary to rounding precision (mass of the more likely tokens == top_p within 1e-5).
    if differ.any():
        assert min_p == 0 and top_p < 1
        kept_by_k = hf_truncate(logits, top_k, 1.0, 0).double()
        probs = kept_by_k.softmax(-1)
        for row, token in differ.nonzero().tolist():
            before = probs[row][probs[row] > probs[row, token]].sum()  # mass of the more likely tokens
            assert abs(float(before) - top_p) < 1e-5
    assert differ.sum() <= 2
    assert torch.equal(ours[torch.isfinite(ours)], logits[torch.isfinite(ours)])


def test_rows_keep_their_own_settings():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1)) * 3
    ours = truncate_logits(logits, torch.tensor([5, 0, 0]), torch.tensor([1.0, 0.7, 1.0]), torch.tensor([0.0, 0.0, 0.0]))
    assert int(torch.isfinite(ours[0]).sum()) == 5
    assert torch.equal(torch.isinf(ours[1]), torch.isinf(hf_truncate(logits[1:2], 0, 0.7, 0)[0]))
    assert torch.equal(ours[2], logits[2])  # no truncation at all


def test_draws_follow_the_truncated_distribution():
    """logits log([.5, .25, .15, .07, .03]) at top_p=0.8 keep tokens 0-2 (mass before token 2 is 0.75 <
    0.8; before token 3 it is 0.9): probabilities .5/.9, .25/.9, .15/.9 = .556, .278, .167."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 20000
    rows = RowParams.per_row([SamplingParams(max_new_tokens=1, top_p=0.8)], n)
    token, logp = sample_tokens(probs.log().expand(n, 5), rows, torch.Generator().manual_seed(0))
    freq = torch.bincount(token, minlength=5).float() / n
    want = torch.tensor([0.5, 0.25, 0.15, 0.0, 0.0]) / 0.9
    assert (freq - want).abs().max() < 0.015  # ~4 standard errors at n=20000
    assert torch.allclose(logp, probs.log()[token], atol=1e-6)  # untruncated log-prob


def test_temperature_scales_the_distribution_and_its_logprob():
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 20000
    rows = RowParams.per_row([SamplingParams(max_new_tokens=1, temperature=0.5)], n)
    token, logp = sample_tokens(probs.log().expand(n, 3), rows, torch.Generator().manual_seed(1))
    sharpened = probs ** 2 / (probs ** 2).sum()  # softmax(log p / 0.5) = p^2 / sum p^2 = .783, .196, .022
    freq = torch.bincount(token, minlength=3).float() / n
    assert (freq - sharpened).abs().max() < 0.015
    assert torch.allclose(logp, sharpened.log()[token], atol=1e-5)


def test_greedy_rows_and_banned_tokens():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    rows = RowParams.per_row([SamplingParams(max_new_tokens=1, greedy=True)], 2)
    token, _ = sample_tokens(logits, rows, torch.Generator().manual_seed(0))
    assert token.tolist() == [1, 1]
    token, logp = sample_tokens(logits, rows, None, torch.tensor([True, False]), [1])
    assert token.tolist() == [2, 1]
    assert logp[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[2]))


def test_zero_probability_tokens_are_never_drawn():
    logits = torch.tensor([0.0, float("-inf"), 0.0, float("-inf")]).expand(5000, 4)
    rows = RowParams.per_row([SamplingParams(max_new_tokens=1, temperature=1.0)], 5000)
    token, _ = sample_tokens(logits, rows, torch.Generator().manual_seed(2))
    assert set(token.tolist()) == {0, 2}


def test_banned_tokens_leave_before_truncation():
    """EOS dominates (p = .9) and top_p = 0.5 would keep only EOS; with EOS banned (min_new_tokens) the
    nucleus is taken over the remaining tokens, as generate does: [.06, .03, .01] / .1 -> top_p .5 keeps
    token 1 (0.6) only."""
    probs = torch.tensor([0.9, 0.06, 0.03, 0.01])  # token 0 is EOS
    rows = RowParams.per_row([SamplingParams(max_new_tokens=4, top_p=0.5, min_new_tokens=4)], 200)
    token, logp = sample_tokens(probs.log().expand(200, 4), rows, torch.Generator().manual_seed(0),
                                torch.ones(200, dtype=torch.bool), [0])
    assert set(token.tolist()) == {1}
    assert torch.allclose(logp, torch.full((200,), float(probs.log()[1])), atol=1e-6)  # untruncated log-prob
    assert torch.isfinite(logp).all()


def _full_cdf_draw(allowed_AV, u_A):
    """The one-level reference: a float64 cumulative sum over the whole vocabulary."""
    cdf_AV = torch.cumsum(allowed_AV.double().softmax(-1), -1)
    return torch.searchsorted(cdf_AV, u_A[:, None] * cdf_AV[:, -1:], right=True).squeeze(-1)


@pytest.mark.parametrize("V", [5, 1023, 1024, 1025, 3000, 49152])
def test_the_two_level_draw_picks_the_full_cumulative_sums_token(V):
    """Same u, same token as one cumulative sum over the vocabulary (only the order of float64 additions
    differs, so a token could differ only for u within ~1e-16 of a boundary), over sharp and flat rows with
    a third of the tokens removed (-inf); and its normaliser is logsumexp."""
    g = torch.Generator().manual_seed(V)
    logits_AV = torch.randn(256, V, generator=g) * torch.tensor([0.3, 3.0, 30.0, 100.0]).repeat(64)[:, None]
    logits_AV[:, 1::3] = float("-inf")
    u_A = sampling.counter_uniform(1, torch.arange(256), V)
    token_A, log_normaliser_A = sampling.inverse_cdf_draw(logits_AV, u_A)
    assert torch.equal(token_A, _full_cdf_draw(logits_AV, u_A))
    assert torch.allclose(log_normaliser_A, logits_AV.logsumexp(-1), rtol=1e-6, atol=1e-5)


def test_the_two_level_draw_never_takes_a_removed_token_at_the_edges():
    """u at its extremes (the smallest and largest counter_uniform can return), blocks whose last tokens are
    removed, a row whose only token is the vocabulary's last: always a token with probability > 0. Row 4: a
    block whose sum (a vectorised reduction: 1 + 8.4e-14) exceeds its sequential cumulative sum (1.0: each
    e^-37 is below half an ulp of 1), so near u = 1 the target lies past the block's last cumulative value."""
    V = 2 * sampling.CDF_BLOCK + 10
    logits_AV = torch.full((5, V), float("-inf"))
    logits_AV[0, :5] = 0.0  # mass only at the start of block 0
    logits_AV[1, sampling.CDF_BLOCK - 3:sampling.CDF_BLOCK + 2] = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0])
    logits_AV[2, -1] = 0.0
    logits_AV[3, ::977] = torch.linspace(-30, 0, len(range(0, V, 977)))
    logits_AV[4, 0], logits_AV[4, 1:1001] = 0.0, -37.0
    for u in (0.5 * 2.0**-52, 1 - 0.5 * 2.0**-52, 0.5):
        token_A, _ = sampling.inverse_cdf_draw(logits_AV, torch.full((5,), u, dtype=torch.float64))
        assert torch.isfinite(logits_AV.gather(-1, token_A[:, None])).all(), (u, token_A)
    assert int(sampling.inverse_cdf_draw(logits_AV[2:3], torch.tensor([1 - 2.0**-53], dtype=torch.float64))[0]) == V - 1


def test_draws_across_blocks_follow_the_distribution():
    """Mass spread over four blocks: frequencies within ~4 standard errors of the probabilities."""
    V, n = 4 * sampling.CDF_BLOCK, 40000
    probs_V = torch.zeros(V)
    probs_V[[3, 1500, 1501, 2047, 2048, 4095]] = torch.tensor([0.3, 0.2, 0.1, 0.25, 0.1, 0.05])
    rows = RowParams.per_row([SamplingParams(max_new_tokens=1)], n)
    token, logp = sample_tokens(probs_V.log().expand(n, V), rows, sampling.counter_uniform(0, torch.arange(n), 0))
    freq_V = torch.bincount(token, minlength=V).float() / n
    assert (freq_V - probs_V).abs().max() < 4 * (0.25 / n) ** 0.5
    assert torch.allclose(logp, probs_V.log()[token], atol=1e-6)


def test_a_plan_decided_once_draws_what_a_plan_decided_per_call():
    logits_AV = torch.randn(8, 300, generator=torch.Generator().manual_seed(4)) * 2
    settings = [SamplingParams(max_new_tokens=3, temperature=0.8, min_new_tokens=2),
                SamplingParams(max_new_tokens=3, greedy=True), SamplingParams(max_new_tokens=3, top_p=0.9),
                SamplingParams(max_new_tokens=3, top_k=5)]
    rows = RowParams.per_row(settings, 2)
    u_A, banned_A = sampling.counter_uniform(2, torch.arange(8), 0), rows.min_new_A > 0
    planned = sample_tokens(logits_AV, rows, u_A, banned_A, [4], sampling.DrawPlan.of(rows))
    assert sampling.DrawPlan.of(rows) == sampling.DrawPlan(truncate=True, greedy=True, banned=True)
    for got, want in zip(planned, sample_tokens(logits_AV, rows, u_A, banned_A, [4])):
        assert torch.equal(got, want)


def test_rows_all_at_temperature_1_skip_the_division_and_draw_the_same():
    """x / 1 is x exactly: a plan whose rows are all at temperature 1 (greedy rows count as 1) skips the
    vocabulary-wide division, with bit-equal tokens and log-probs; one row at another temperature keeps it."""
    logits_AV = torch.randn(6, 3000, generator=torch.Generator().manual_seed(5)) * 3
    rows = RowParams.per_row([SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=3, greedy=True)], 3)
    plan = sampling.DrawPlan.of(rows)
    assert plan.unit_temperature
    u_A = sampling.counter_uniform(4, torch.arange(6), 0)
    divided = dataclasses.replace(plan, unit_temperature=False)
    for got, want in zip(sample_tokens(logits_AV, rows, u_A, plan=plan), sample_tokens(logits_AV, rows, u_A, plan=divided)):
        assert torch.equal(got, want)
    warm = RowParams.per_row([SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=3, temperature=0.7)], 3)
    assert not sampling.DrawPlan.of(warm).unit_temperature


def test_a_rows_draw_and_log_prob_do_not_depend_on_its_neighbours_settings():
    """A plain row (temperature only) draws the same token with the same log-prob, exactly, alone and beside rows
    whose draw removes tokens (top-p, top-k, min-p, EOS banned): its log-prob's normaliser is decided per row.
    (Decided for the whole batch, it came from another computation beside such rows: up to 2e-6 apart in a few
    of these draws.)"""
    plain = SamplingParams(max_new_tokens=3, temperature=0.9)
    settings = [plain, SamplingParams(max_new_tokens=3, top_p=0.8), SamplingParams(max_new_tokens=3, top_k=7),
                SamplingParams(max_new_tokens=3, min_p=0.1), SamplingParams(max_new_tokens=3, min_new_tokens=2), plain]
    rows, alone_rows = RowParams.per_row(settings, 1), RowParams.per_row([plain], 1)
    for t in range(40):
        logits_AV = torch.randn(6, 49152, generator=torch.Generator().manual_seed(t)) * 3
        u_A = sampling.counter_uniform(3, torch.arange(6), t)
        together = sample_tokens(logits_AV, rows, u_A, rows.min_new_A > 0, [4])
        for row in (0, 5):
            alone = sample_tokens(logits_AV[row:row + 1], alone_rows, u_A[row:row + 1], alone_rows.min_new_A > 0, [4])
            assert int(alone[0]) == int(together[0][row]) and float(alone[1]) == float(together[1][row]), (t, row)


# ---- the counter-based uniforms (seed, row key, token index) -> u -------------------------------------------

def _ks_p(values: torch.Tensor) -> float:
    from scipy import stats

    return float(stats.kstest(values.numpy(), "uniform").pvalue)


def test_counter_uniform_never_returns_0_or_1_and_has_no_fixed_point():
    """(seed 0, key 0, t 0) was the counter 0, a fixed point of the mix: u = 0.0 exactly, so row 0 of every
    seed-0 run drew the lowest-index token with any probability. Now every u lies strictly inside (0, 1)."""
    keys = torch.arange(2000)
    for seed in (0, 1, 2**31 - 1, 2**62):
        for t in (0, 1, 2, 1000):
            u = sampling.counter_uniform(seed, keys, t)
            assert float(u.min()) > 0 and float(u.max()) < 1
    first = sampling.counter_uniform(0, torch.tensor([0]), 0)
    assert 1e-3 < float(first) < 1 - 1e-3  # (seed, key, t) = 0 is an ordinary draw, not an edge
    assert float(sampling.counter_uniform(0, torch.tensor([0]), 0)) == float(first)  # reproducible
    top, bottom = (2**52 - 1 + 0.5) * 2.0**-52, 0.5 * 2.0**-52  # the extreme values, exact in float64
    assert 0 < bottom and top < 1


@pytest.mark.parametrize("rest", [0, 1])
@pytest.mark.parametrize("axis", ["key", "seed", "t"])
def test_counter_uniform_is_uniform_and_uncorrelated_along_each_input_from_zero(axis, rest):
    """20,000 draws varying one input from 0, the other two at `rest` (0 is where a weak hash shows its
    structure): Kolmogorov-Smirnov against U(0, 1), and neighbours along that input uncorrelated
    (|r| < 4 / sqrt(n), four standard errors). Deterministic: the hash gives the same numbers on every machine."""
    n = 20000
    fixed = torch.full((n,), rest, dtype=torch.long)
    if axis == "key":
        u = sampling.counter_uniform(rest, torch.arange(n), rest)
    elif axis == "seed":  # one seed per row, as rows of several policies have
        u = sampling.counter_uniform(torch.arange(n), fixed, rest)
    else:
        u = torch.cat([sampling.counter_uniform(rest, fixed[:1], t) for t in range(n)])
    assert _ks_p(u) > 1e-3
    r = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(float(r)) < 4 / n**0.5


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square of token counts against probabilities, the rare tokens pooled so that every
    cell expects >= 5 draws."""
    from scipy import stats

    n = int(counts.sum())
    order = probs.argsort(descending=True)
    expected, observed = (probs[order] * n).double(), counts[order].double()
    common = expected >= 5
    cells_e = torch.cat([expected[common], expected[~common].sum()[None]])
    cells_o = torch.cat([observed[common], observed[~common].sum()[None]])
    keep = cells_e > 0
    return float(stats.chisquare(cells_o[keep].numpy(), cells_e[keep].numpy() * float(cells_o[keep].sum() / cells_e[keep].sum())).pvalue)


def test_first_tokens_at_seed_0_follow_the_distribution():
    """The first token (t = 0) of 20,000 rows at seed 0, and of row 0 over 20,000 seeds, drawn with the
    counter uniforms from one distribution over 200 tokens with a long tail: Pearson's chi-square against it.
    Before the fix row 0 at seed 0 drew the first token with non-zero probability whatever the model said."""
    logits = torch.randn(200, generator=torch.Generator().manual_seed(3)) * 3
    logits[0] = -30.0  # token 0 nearly impossible (p ~ 1e-14): where u = 0 drew it
    probs = logits.softmax(-1)
    n = 20000
    rows = RowParams.per_row([SamplingParams(max_new_tokens=1, temperature=1.0)], n)
    for u in (sampling.counter_uniform(0, torch.arange(n), 0),
              sampling.counter_uniform(torch.arange(n), torch.zeros(n, dtype=torch.long), 0)):
        token, _ = sample_tokens(logits.expand(n, 200), rows, u)
        assert _chi_square_p(torch.bincount(token, minlength=200), probs) > 1e-3
    row0, _ = sample_tokens(logits[None], RowParams.per_row([SamplingParams(max_new_tokens=1)], 1),
                            sampling.counter_uniform(0, torch.tensor([0]), 0))
    assert int(row0) != 0 and float(probs[row0]) > 1e-3  # row 0 at seed 0 no longer lands in the tail
