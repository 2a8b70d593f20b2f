import math

import torch

from rlora.algos.losses import BatchTotals, LossInputs, aggregate, grpo_token_loss, k3_kl, truncated_is_weight


def test_k3_hand_computed():
    # logp = log 0.5, ref = log 0.25: delta = ref - logp = log 0.5 = -0.693147
    # k3 = exp(delta) - delta - 1 = 0.5 + 0.693147 - 1 = 0.193147
    kl = k3_kl(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]))
    assert abs(kl.item() - 0.193147) < 1e-6
    assert k3_kl(torch.tensor([-1.3]), torch.tensor([-1.3])).item() == 0.0


def test_grpo_loss_hand_computed_clipping():
    # token 0: ratio exp(0.5)=1.648721, A=+1 -> min(1.6487, clip 1.2) = 1.2 -> loss -1.2, clipped
    # token 1: ratio exp(-0.5)=0.606531, A=+1 -> min(0.6065, 0.8) = 0.6065 -> loss -0.606531, not clipped
    # token 2: ratio 0.606531, A=-1 -> min(-0.6065, -0.8) = -0.8 -> loss 0.8, clipped
    # token 3: ratio 1.648721, A=-1 -> min(-1.6487, -1.2) = -1.6487 -> loss 1.648721, not clipped
    logp = torch.tensor([[0.5, -0.5], [-0.5, 0.5]])
    inp = LossInputs(logp_BT=logp, old_logp_BT=torch.zeros(2, 2), advantages_BT=torch.tensor([1.0, -1.0]),
                     mask_BT=torch.ones(2, 2))
    out = grpo_token_loss(inp, clip_low=0.2, clip_high=0.2, beta=0.0)
    assert torch.allclose(out.loss_BT, torch.tensor([[-1.2, -0.606531], [0.8, 1.648721]]), atol=1e-6)
    assert out.metrics_BT["clip_frac"].tolist() == [[True, False], [True, False]]
    assert out.kl_BT is None and out.metrics_BT["kl"] is None


def test_clip_higher_uses_separate_bounds():
    # ratio 1.25, A=+1: with clip_high 0.28 (DAPO) the bound 1.28 is not reached -> loss -1.25
    inp = LossInputs(torch.tensor([[math.log(1.25)]]), torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1))
    assert abs(grpo_token_loss(inp, 0.2, 0.28, 0.0).loss_BT.item() + 1.25) < 1e-6
    assert abs(grpo_token_loss(inp, 0.2, 0.2, 0.0).loss_BT.item() + 1.2) < 1e-6


def test_kl_term_added_with_beta():
    # ratio 1, A = 0 -> surrogate 0; KL(logp=log .5, ref=log .25) = 0.193147; beta 0.1 -> 0.0193147
    inp = LossInputs(torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.5)]]), torch.tensor([0.0]),
                     torch.ones(1, 1), ref_logp_BT=torch.tensor([[math.log(0.25)]]))
    out = grpo_token_loss(inp, 0.2, 0.2, beta=0.1)
    assert abs(out.loss_BT.item() - 0.0193147) < 1e-6


def test_ratio_one_gives_minus_advantage_gradient():
    # at old == logp the loss is -A per token and d loss / d logp = -A (the policy-gradient direction)
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    inp = LossInputs(logp, logp.detach(), torch.tensor([0.5]), torch.ones(1, 2))
    out = grpo_token_loss(inp, 0.2, 0.2, 0.0)
    out.loss_BT.sum().backward()
    assert torch.allclose(out.loss_BT, torch.tensor([[-0.5, -0.5]]))
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.5]]))


VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_aggregate_hand_computed():
    totals = BatchTotals(num_tokens=5, num_seqs=2, constant_len=4)
    # token_mean: (1 + 2 + 4 + 5 + 6) / 5 = 18 / 5 = 3.6
    assert abs(aggregate(VALUES, MASK, "token_mean", totals).item() - 3.6) < 1e-6
    # seq_mean: ((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2 = (1.5 + 5) / 2 = 3.25
    assert abs(aggregate(VALUES, MASK, "seq_mean", totals).item() - 3.25) < 1e-6
    # constant: 18 / (2 sequences * 4) = 2.25
    assert abs(aggregate(VALUES, MASK, "constant", totals).item() - 2.25) < 1e-6


def naive_aggregate(values, mask, mode, constant_len):
    rows = [[v for v, m in zip(vr, mr) if m] for vr, mr in zip(values.tolist(), mask.tolist())]
    if mode == "token_mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq_mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / (len(rows) * constant_len)


def test_aggregate_micro_batches_sum_to_full_batch_and_match_naive():
    torch.manual_seed(3)
    values = torch.randn(6, 7)
    mask = (torch.rand(6, 7) > 0.3).float()
    mask[:, 0] = 1.0
    totals = BatchTotals(num_tokens=float(mask.sum()), num_seqs=6, constant_len=7)
    for mode in ("token_mean", "seq_mean", "constant"):
        full = aggregate(values, mask, mode, totals).item()
        parts = sum(aggregate(values[i:i + 2], mask[i:i + 2], mode, totals).item() for i in range(0, 6, 2))
        assert abs(full - parts) < 1e-6, mode
        assert abs(full - naive_aggregate(values, mask, mode, 7)) < 1e-5, mode


def test_truncated_is_weight_hand_computed():
    # old - sampler = log 1.5 -> 1.5; = log 3 -> capped at 2; = log 0.5 -> 0.5
    old = torch.tensor([[math.log(1.5), math.log(3.0), math.log(0.5)]])
    w = truncated_is_weight(old, torch.zeros(1, 3), cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.5, 2.0, 0.5]]), atol=1e-6)
    # ratio 1 (mu = 1), A = +1: surrogate -1 per token, scaled by w; the gradient scales the same way
    logp = torch.zeros(1, 3, requires_grad=True)
    inp = LossInputs(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 3), is_weight_BT=w)
    out = grpo_token_loss(inp, 0.2, 0.2, 0.0)
    assert torch.allclose(out.loss_BT, -w)
    out.loss_BT.sum().backward()
    assert torch.allclose(logp.grad, -w)
