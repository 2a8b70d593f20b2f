"""The one batch-wide MoLoRA auxiliary loss (models/molora/batch_aux.py BatchAuxLoss, used by `rlora sft` and the
RL update) against a naive whole-batch computation written out here: the batch in 1, 2 or 4 micro-batches, and
split over two data-parallel ranks (threads with a summing collective, each with its own replica), gives the
naive loss, gradient and router metrics. A rank-local normalisation (each rank dividing by its own unit count
and using its own f_e, as `rlora sft`'s copy of this code did before both paths shared it) does not."""

import copy
import threading

import pytest
import torch
import torch.nn.functional as F

from rlora.config import ModelConfig
from rlora.models import molora as ml
from rlora.models.loading import load_base_model

# rows of different lengths: every micro-batch of several rows has padding; the first PROMPT tokens route a row
ROW_LENGTHS = [6, 11, 4, 9]
PROMPT = 3


def molora_model(model_dir: str, router: str):
    """float64 MoLoRA with non-zero B and spread-out routers, large auxiliary weights (the routing softmax's
    statistics stay float32, as in training)."""
    torch.manual_seed(0)
    model = load_base_model(ModelConfig(path=model_dir), model_dir)
    ml.attach_molora(model, ml.MoLoRAConfig(num_experts=3, rank=2, top_k=2, router=router, balance_coef=0.5,
                                            z_coef=0.1, router_init_std=0.3))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("molora_B"):
                p.normal_(0, 0.1)
    return model.double()


def batch_rows(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in ROW_LENGTHS]


def right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


def naive_aux_loss(model, mask_BT: torch.Tensor) -> torch.Tensor:
    """balance_coef * sum_modules N sum_e f_e P_e + z_coef * sum_modules mean logsumexp^2, over the real units of the
    model's last forward (tokens without padding, or rows), in float64."""
    config = ml.routing_state(model).config
    N, balance, z = config.num_experts, 0.0, 0.0
    for _, module in ml.molora_modules(model):
        record = module.last
        keep_U = mask_BT.reshape(-1).bool() if record.per_token else torch.ones(len(record.logits_UE), dtype=torch.bool)
        logits_UE = record.logits_UE[keep_U].double()
        f_E = F.one_hot(record.chosen_UK[keep_U], N).sum(1).double().mean(0) / config.top_k
        balance = balance + N * (f_E * logits_UE.softmax(-1).mean(0)).sum()
        z = z + logits_UE.logsumexp(-1).pow(2).mean()
    return config.balance_coef * balance + config.z_coef * z


def routed_forward(model, rows: list[list[int]]):
    """The forward of these rows (right-padded), routed by their prompts -> its attention mask."""
    ids, mask = right_padded(rows)
    with ml.routing_from_prompts(model, [r[:PROMPT] for r in rows]):
        model(input_ids=ids, attention_mask=mask)
    return mask


def naive(model, rows: list[list[int]]) -> tuple[float, dict, dict]:
    """(aux loss, router gradients, router metrics) of the whole batch in one forward."""
    mask = routed_forward(model, rows)
    loss = naive_aux_loss(model, mask)
    loss.backward()
    return loss.item(), grads(model), ml.router_metrics(model, mask)


def accumulated(model, rows: list[list[int]], micro: int, sum_over_ranks=None) -> dict:
    """BatchAuxLoss over micro-batches of `micro` rows, each share backpropagated -> its metrics."""
    chunks = [rows[i:i + micro] for i in range(0, len(rows), micro)]
    masks = [right_padded(chunk)[1] for chunk in chunks]
    summaries = [ml.prompt_summary(model, [r[:PROMPT] for r in chunk]) for chunk in chunks]
    aux = ml.BatchAuxLoss(model, masks, lambda: torch.cat(summaries),
                          lambda index: routed_forward(model, chunks[index]), sum_over_ranks)
    for chunk in chunks:
        aux.share(routed_forward(model, chunk)).backward()
    return aux.metrics()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class ThreadRanks:
    """sum_over_ranks for threads standing in for data-parallel ranks: every call is a collective that each
    thread makes in the same order (a thread that fails breaks the barrier instead of hanging the others)."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=120)
        self.slots: list[torch.Tensor | None] = [None] * size

    def sum_over_ranks(self, rank: int):
        def reduce(tensor: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = tensor.detach().clone()
            self.barrier.wait()
            total = torch.stack(self.slots).sum(0)
            self.barrier.wait()  # every rank has read the slots before the next collective overwrites them
            return total
        return reduce


def two_ranks(model, rows: list[list[int]], micro: int, collective: bool) -> tuple[list[dict], dict]:
    """Each of two ranks (threads, each with its own replica) runs its half of the rows -> (each rank's metrics,
    the gradients summed over the ranks, as data parallel sums them). collective=False: each rank alone."""
    replicas = [copy.deepcopy(model) for _ in range(2)]
    ranks = ThreadRanks(2)
    metrics, errors = [None, None], []

    def run(rank: int) -> None:
        try:
            share = rows[rank * len(rows) // 2:(rank + 1) * len(rows) // 2]
            collective_sum = ranks.sum_over_ranks(rank) if collective else None
            metrics[rank] = accumulated(replicas[rank], share, micro, collective_sum)
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(err)
            ranks.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    per_rank = [grads(r) for r in replicas]
    return metrics, {name: per_rank[0][name] + per_rank[1][name] for name in per_rank[0]}


def assert_grads_close(got: dict, want: dict) -> None:
    """Equal to 1e-6 of each gradient's largest entry: the production code keeps the utilisation counts f_e in
    float32 (~1e-7 relative), the naive reference in float64."""
    assert got.keys() == want.keys() and any("molora_router" in n for n in want)
    for name, expected in want.items():
        torch.testing.assert_close(got[name], expected, rtol=0, atol=1e-6 * float(expected.abs().max()), msg=name)


def assert_metrics_close(got: dict, loss: float, metrics: dict) -> None:
    assert got["aux_loss"] == pytest.approx(loss, rel=1e-6)
    for key, value in metrics.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("router", ["sequence", "token"])
def test_micro_batches_give_the_naive_whole_batch_aux_loss(router, tiny_model_dir):
    model = molora_model(tiny_model_dir, router)
    rows = batch_rows(model.config.vocab_size)
    loss, want, metrics = naive(copy.deepcopy(model), rows)
    assert loss > 0
    for micro in (4, 2, 1):
        replica = copy.deepcopy(model)
        got = accumulated(replica, rows, micro)
        assert_metrics_close(got, loss, metrics)
        assert_grads_close(grads(replica), want)


@pytest.mark.parametrize("router", ["sequence", "token"])
def test_two_ranks_give_the_naive_whole_batch_aux_loss(router, tiny_model_dir):
    model = molora_model(tiny_model_dir, router)
    rows = batch_rows(model.config.vocab_size)
    loss, want, metrics = naive(copy.deepcopy(model), rows)
    for micro in (2, 1):  # one forward per rank, then two
        per_rank, summed = two_ranks(model, rows, micro, collective=True)
        for got in per_rank:  # every rank reports the whole batch's metrics
            assert_metrics_close(got, loss, metrics)
        assert_grads_close(summed, want)
    # each rank normalising by its own units and f_e: every rank's share is a mean of its own half, so the
    # summed gradient is about twice the batch's (this test would have caught it)
    _, rank_local = two_ranks(model, rows, 2, collective=False)
    routers = [n for n in want if "molora_router" in n]
    assert all(not torch.allclose(rank_local[n], want[n], rtol=1e-3, atol=1e-9) for n in routers)
