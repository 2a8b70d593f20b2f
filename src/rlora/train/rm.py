"""The reward-model recipe: a LoRA adapter plus a scalar score head on the shared base, trained on pairwise
preferences with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin), reporting pair
accuracy on a held-out split; saves OUTPUT/reward_model (docs/reward_models.md).

Under torchrun each rank trains its contiguous share of every (length-sorted) batch of pairs: the pair count
that normalises the loss, the gradients (adapter and head) and the metrics' sums are summed over ranks, so the
update is the one-process update; rank 0 alone writes and prints."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from rlora.config import RMConfig, to_yaml
from rlora.data.pref_data import PreferenceData, TokenizedPair, load_preference_data
from rlora.data.sft_data import LengthGroupedOrder
from rlora.logging.console import info, print_summary
from rlora.models.loading import (
    attach_lora, check_lora_targets, load_base_model, load_tokenizer, model_device, resolve_model_path,
    trainable_parameters,
)
from rlora.models.adapters import PeftLora
from rlora.models.reward_model import hidden_size, load_score_head, new_score_head, save_reward_model, score
from rlora.tensors import right_padded
from rlora.train.distributed import World, all_reduce_gradients, all_reduce_sums, on_every_rank
from rlora.train.session import seed_everything
from rlora.train.optim import build_optimizer
from rlora.train.lifecycle import kept_on_stop
from rlora.train.outputs import RunDir
from rlora.train.supervised import check_inputs, micro_batches, optimizer_steps
from rlora.train.supervised_checkpoints import (
    Resumable, check_supervised_resume, logged_so_far, restore_supervised_state, save_supervised_state,
    trained_seconds,
)

# what decides the batches and what a step computes (data.eval_size too: its pairs come out of data.path); other
# train.* keys (steps, lr, eval_every, ...) may change on resume
RM_MUST_MATCH = ("model", "lora", "data", "train.seed", "train.batch_size", "train.max_length", "train.margin")


# ---- pure math -----------------------------------------------------------------------------------------

def bradley_terry_loss_sum(r_chosen_P: torch.Tensor, r_rejected_P: torch.Tensor,
                           margin_P: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over pairs of -log sigmoid(r_chosen - r_rejected - margin)."""
    diff_P = r_chosen_P - r_rejected_P
    if margin_P is not None:
        diff_P = diff_P - margin_P
    return -F.logsigmoid(diff_P).sum()


def bradley_terry_loss(r_chosen_P: torch.Tensor, r_rejected_P: torch.Tensor,
                       margin_P: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over pairs of -log sigmoid(r_chosen - r_rejected - margin)."""
    return bradley_terry_loss_sum(r_chosen_P, r_rejected_P, margin_P) / r_chosen_P.shape[0]


def pair_correct(r_chosen_P: torch.Tensor, r_rejected_P: torch.Tensor) -> int:
    """Pairs whose chosen response scores strictly higher (a tie counts as wrong)."""
    return int((r_chosen_P > r_rejected_P).sum().item())


def pair_accuracy(r_chosen_P: torch.Tensor, r_rejected_P: torch.Tensor) -> float:
    return pair_correct(r_chosen_P, r_rejected_P) / r_chosen_P.shape[0]


def score_pairs(model, head, pairs: list[TokenizedPair], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_chosen [P], r_rejected [P]) from one forward pass over the 2P sequences."""
    ids, mask = (t.to(model_device(model)) for t in
                 right_padded([p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs], pad_id))
    rewards_2P = score(model, head, ids, mask)
    return rewards_2P[: len(pairs)], rewards_2P[len(pairs):]


def margins(pairs: list[TokenizedPair], extra: float, device) -> torch.Tensor:
    return torch.tensor([p.margin + extra for p in pairs], dtype=torch.float32, device=device)


def backward_batch(model, head, pairs: list[TokenizedPair], micro_size: int, pad_id: int,
                   margin: float = 0.0, world: World = World()) -> dict:
    """Accumulate the gradient of the batch's mean pair loss: each micro-batch's summed loss is divided by the
    whole batch's pair count, so the split does not change the gradient. Data parallel: `pairs` is this rank's
    share; the count, the gradients (adapter and head) and the sums are summed over ranks. -> loss, accuracy,
    reward_gap of the whole batch."""
    num_pairs = all_reduce_sums(world, [len(pairs)])[0]
    loss_sum, correct, gap_sum = 0.0, 0, 0.0
    for chunk in micro_batches(pairs, micro_size):
        r_chosen, r_rejected = score_pairs(model, head, chunk, pad_id)
        nll = bradley_terry_loss_sum(r_chosen, r_rejected, margins(chunk, margin, r_chosen.device))
        (nll / num_pairs).backward()
        loss_sum += nll.item()
        correct += pair_correct(r_chosen, r_rejected)
        gap_sum += (r_chosen - r_rejected).sum().item()
    all_reduce_gradients(world, trainable_parameters(model) + list(head.parameters()))
    loss_sum, correct, gap_sum = all_reduce_sums(world, [loss_sum, correct, gap_sum])
    return {"loss": loss_sum / num_pairs, "accuracy": correct / num_pairs, "reward_gap": gap_sum / num_pairs}


@torch.no_grad()
def evaluate_pairs(model, head, pairs: list[TokenizedPair], micro_size: int, pad_id: int,
                   margin: float = 0.0, world: World = World()) -> dict:
    """Mean loss and accuracy over all pairs (data parallel: each rank scores its contiguous part)."""
    count = len(pairs)
    pairs = pairs[world.rank * count // world.size:(world.rank + 1) * count // world.size]
    loss_sum, correct = 0.0, 0
    for chunk in micro_batches(pairs, micro_size):
        r_chosen, r_rejected = score_pairs(model, head, chunk, pad_id)
        loss_sum += bradley_terry_loss_sum(r_chosen, r_rejected, margins(chunk, margin, r_chosen.device)).item()
        correct += pair_correct(r_chosen, r_rejected)
    loss_sum, correct = all_reduce_sums(world, [loss_sum, correct])
    return {"loss": loss_sum / count, "accuracy": correct / count}


# ---- plumbing ------------------------------------------------------------------------------------------

def checkpointed_weights(model=None, head=None) -> Resumable:
    """What an rm checkpoint holds of the model: its reward_model/ folder (the adapter and the score head), read back
    into the live adapter and head."""
    def load(folder: Path) -> None:
        PeftLora(model).load(folder / "reward_model")
        saved = load_score_head(str(folder / "reward_model"), hidden_size(model), head.weight.device)
        with torch.no_grad():
            head.weight.copy_(saved.weight)
            head.bias.copy_(saved.bias)

    return Resumable("rm", RM_MUST_MATCH, lambda folder: save_reward_model(folder / "reward_model", model, head), load)


def run_rm(cfg: RMConfig) -> dict:
    """Train; under torchrun every rank runs this, rank 0 alone writes and prints."""
    return on_every_rank(lambda world: _run_rm(cfg, world))


def _run_rm(cfg: RMConfig, world: World) -> dict:
    run_dir, resume_from = check_inputs(cfg, "rm", world)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    model_path = resolve_model_path(cfg.model.path)
    tokenizer, tok = load_tokenizer(model_path, cfg.model.trust_remote_code)
    data = load_preference_data(cfg.data, tokenizer, tok.eos_ids[0], cfg.train.max_length)  # before the model
    if resume_from is not None:  # other settings: refused before the model loads
        check_supervised_resume(cfg, resume_from, cfg.train.steps, checkpointed_weights())
    check_lora_targets(cfg.lora, model_path, cfg.model.trust_remote_code)  # before the weights load
    model = attach_lora(load_base_model(cfg.model, model_path), cfg.lora)
    model.train()
    head = new_score_head(hidden_size(model), cfg.train.head_init_std, model_device(model))
    params = trainable_parameters(model) + list(head.parameters())
    optimizer, scheduler = build_optimizer(params, cfg.train, cfg.train.steps)
    n_params = sum(p.numel() for p in params)
    info(f"rlora rm: {cfg.model.path}, {n_params:,} parameters (adapter + score head), {len(data.train)} pairs "
         f"({data.truncated} truncated, {data.dropped} dropped), {len(data.eval)} held out, {cfg.train.steps} steps "
         f"-> {cfg.train.output_dir}")
    if resume_from is None or not run_dir.holds_checkpoint(resume_from):
        run_dir.create()
    run_dir.write_text("config.yaml", to_yaml(cfg))
    first_step, t0, weights = 0, time.perf_counter(), checkpointed_weights(model, head)
    if resume_from is not None:
        first_step = restore_supervised_state(resume_from, run_dir, weights, optimizer, scheduler, world)
        t0 -= trained_seconds(resume_from)
    summary = {"status": "completed", "steps": first_step, "trainable_params": n_params,
               "train_pairs": len(data.train), "eval_pairs": len(data.eval), "truncated_pairs": data.truncated,
               "dropped_pairs": data.dropped, "last_metrics": {}, "eval_loss": None, "eval_accuracy": None}
    if first_step:  # a resume that trains no further step (already at the end) keeps what the run had logged
        summary |= logged_so_far(run_dir, ("eval_loss", "eval_accuracy"))

    def save() -> None:
        run_dir.write_folder("reward_model", lambda folder: save_reward_model(folder, model, head))

    def checkpoint(done: int) -> None:
        save_supervised_state(run_dir, done, cfg, weights, optimizer, scheduler, time.perf_counter() - t0, world)

    with kept_on_stop(run_dir, summary, save):  # keep what was learnt, say why it stopped
        train_loop(cfg, run_dir, model, head, params, optimizer, scheduler, data, tok.pad_id, summary, world,
                   first_step, checkpoint)
    save()
    summary["train_s"] = time.perf_counter() - t0
    run_dir.write_json("summary.json", summary)
    _print_final(run_dir, summary)
    return summary


def train_loop(cfg: RMConfig, run_dir: RunDir, model, head, params, optimizer, scheduler, data: PreferenceData,
               pad_id: int, summary: dict, world: World = World(), first_step: int = 0,
               checkpoint: Callable[[int], None] | None = None) -> None:
    train = cfg.train
    order = LengthGroupedOrder([p.length() for p in data.train], train.batch_size, 1, train.seed)

    def one_batch(step: int) -> dict:
        pairs = sorted((data.train[i] for i in order.indices(step)), key=TokenizedPair.length)
        return backward_batch(model, head, world.share(pairs), train.micro_batch_size, pad_id, train.margin, world)

    def held_out() -> dict:
        model.eval()
        try:
            held = evaluate_pairs(model, head, data.eval, train.micro_batch_size, pad_id, train.margin, world)
        finally:
            model.train()
        return {"eval_loss": held["loss"], "eval_accuracy": held["accuracy"]}

    def describe(m: dict) -> str:
        eval_text = f"  eval_loss {m['eval_loss']:.4f} eval_acc {m['eval_accuracy']:.2f}" if "eval_loss" in m else ""
        return f"loss {m['loss']:.4f} acc {m['accuracy']:.2f}{eval_text}"

    optimizer_steps("rm", train.steps, params, optimizer, scheduler, train.max_grad_norm, one_batch,
                    held_out if data.eval else None, train.eval_every, run_dir, summary, describe, first_step,
                    train.checkpoint_every, checkpoint)


def _print_final(run_dir: RunDir, summary: dict) -> None:
    last = summary["last_metrics"]
    rows = [("output", str(run_dir.path)), ("steps", str(summary["steps"])), ("train time", f"{summary['train_s']:.1f} s")]
    if "loss" in last:  # a resume in a new folder at the run's last step trains no step and finds no log
        rows += [("last loss", f"{last['loss']:.4f}"), ("last train accuracy", f"{last['accuracy']:.3f}")]
    if summary["eval_loss"] is not None:
        rows += [("eval loss", f"{summary['eval_loss']:.4f}"), ("eval accuracy", f"{summary['eval_accuracy']:.3f}")]
    print_summary("rlora rm: done", rows)
