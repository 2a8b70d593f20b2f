"""The SFT recipe: supervised fine-tuning of a LoRA adapter (or, for small models, every parameter) on
prompt/completion or chat rows, with the loss on completion tokens only. Same run folder and adapter format
as `rlora train`, so `rlora train lora.init_from=RUN/adapter` continues from it. With a `molora:` section it
trains a mixture of LoRA experts instead (docs/molora.md): every forward is routed by its rows' prompts, and
the routers' auxiliary losses join the loss.

Under torchrun each rank trains its contiguous share of every step's (length-sorted) batch: the target count
that normalises the loss and the gradients are summed over ranks, so the update is the one-process update;
the held-out loss sums every rank's share; rank 0 alone writes and prints."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import torch as safetensors_torch

from rlora.config import SFTConfig, to_yaml
from rlora.data.sft_data import IGNORE, LengthGroupedOrder, SFTData, TokenizedRow, load_sft_data, num_targets
from rlora.errors import UserError
from rlora.logging.console import info, print_summary
from rlora.models import molora as ml
from rlora.models.adapters import adapter_of
from rlora.models.loading import (
    attach_lora, causal_lm, check_lora_targets, load_base_model, load_tokenizer, model_device, resolve_model_path,
    trainable_parameters,
)
from rlora.models.logprobs import supports_chunked
from rlora.tensors import right_padded
from rlora.train.distributed import World, all_reduce_gradients, all_reduce_sums, all_reduce_tensor, on_every_rank
from rlora.train.optim import build_optimizer
from rlora.train.lifecycle import kept_on_stop
from rlora.train.outputs import RunDir
from rlora.train.session import seed_everything
from rlora.train.supervised_checkpoints import (
    Resumable, check_supervised_resume, logged_so_far, restore_supervised_state, save_supervised_state,
    trained_seconds,
)
from rlora.train.supervised import check_inputs, micro_batches, optimizer_steps

FULL_FINETUNE_MAX_PARAMS = 1_000_000_000
DEFAULT_STEPS = 20  # neither train.steps nor train.epochs set
# what decides the batches and what a step computes; other train.* keys (steps, epochs, lr, eval_every, ...) may change
# on resume. data.eval_size counts too: without data.eval_path its rows come out of data.path
SFT_MUST_MATCH = ("model", "lora", "molora", "data", "train.seed", "train.batch_size", "train.group_window",
                  "train.max_length", "train.full_finetune")
FULL_MODEL_FILE = "model.safetensors"  # a full fine-tuning checkpoint's weights (the run's output is OUTPUT/model)


# ---- pure math -----------------------------------------------------------------------------------------

def collate(rows: list[TokenizedRow], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels); padding is IGNORE in labels."""
    ids, mask = right_padded([r.ids for r in rows], pad_id)
    labels, _ = right_padded([r.labels for r in rows], IGNORE)
    return ids, mask, labels


def token_nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of -log p(label) over labelled positions; position t - 1 predicts token t. [B, T, V], [B, T]."""
    shifted = labels[:, 1:]
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    flat = flat.to(torch.promote_types(flat.dtype, torch.float32))  # half precision up, float64 kept
    return F.cross_entropy(flat, shifted.reshape(-1), ignore_index=IGNORE, reduction="sum")


def labelled_nll_sum(model, ids_BT: torch.Tensor, mask_BT: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """token_nll_sum of one forward, the output layer run only at the positions that predict a labelled token
    where the family's logits are the output layer of the last hidden state (supports_chunked): prompt and
    padding positions get no logits (most of a chat row's positions; the output layer of a small model is a
    large share of its compute). Other families: the model's full logits."""
    if not supports_chunked(model):
        return token_nll_sum(model(input_ids=ids_BT, attention_mask=mask_BT).logits, labels_BT)
    hf = causal_lm(model)
    hidden_BTH = hf.get_decoder()(input_ids=ids_BT, attention_mask=mask_BT, use_cache=False).last_hidden_state
    targets_BT = labels_BT[:, 1:]
    keep_BT = targets_BT != IGNORE
    logits_NV = hf.get_output_embeddings()(hidden_BTH[:, :-1][keep_BT])
    logits_NV = logits_NV.to(torch.promote_types(logits_NV.dtype, torch.float32))  # half precision up
    return F.cross_entropy(logits_NV, targets_BT[keep_BT], reduction="sum")


def prompt_ids(row: TokenizedRow) -> list[int]:
    """The row's prompt, which routes it (MoLoRA sequence router): its tokens before the first trained token
    (at least one token). For a chat row with several assistant turns, the conversation up to the first one."""
    first = next(i for i, label in enumerate(row.labels) if label != IGNORE)
    return row.ids[: max(first, 1)]


def backward_batch(model, rows: list[TokenizedRow], micro_size: int, pad_id: int,
                   metrics: dict | None = None, world: World = World()) -> tuple[float, int]:
    """Accumulate the gradient of the batch's mean token loss: every micro-batch's summed loss is divided by
    the whole batch's target count, so how the batch is split does not change the gradient. Each forward runs
    in its rows' prompt routing, and the policy's auxiliary loss of the whole batch (a MoLoRA router's:
    ml.BatchAuxLoss, so micro_batch_size does not change that part of the gradient either) joins the loss, its
    `aux_loss` and router metrics going into `metrics` (models/adapters.py: what the policy kind does). Data
    parallel: `rows` is this rank's share; the count, the gradients and the loss are summed over ranks.
    -> (loss, tokens): the task loss alone, of the whole batch."""
    adapter = adapter_of(model)
    total = int(all_reduce_sums(world, [sum(num_targets(r) for r in rows)])[0])
    chunks = micro_batches(rows, micro_size)
    batches = [collate(chunk, pad_id) for chunk in chunks]
    prompts = [[prompt_ids(r) for r in chunk] for chunk in chunks]
    device = model_device(model)

    def forward(index: int):
        """Micro-batch `index`'s forward in its routing context -> (its summed token loss, attention mask)."""
        ids, mask, labels = (t.to(device) for t in batches[index])
        with adapter.prompt_routing(prompts[index]):
            return labelled_nll_sum(model, ids, mask, labels), mask

    aux = adapter.batch_aux_loss([mask for _, mask, _ in batches], [p for chunk in prompts for p in chunk], forward,
                                 (lambda t: all_reduce_tensor(world, t)) if world.active else None)
    loss_sum = 0.0
    for index in range(len(batches)):
        nll, mask = forward(index)
        loss = nll / total
        if aux is not None:
            loss = loss + aux.share(mask)
        loss.backward()
        loss_sum += nll.item()
    all_reduce_gradients(world, trainable_parameters(model))
    (loss_sum,) = all_reduce_sums(world, [loss_sum])
    if aux is not None:
        router_metrics = aux.metrics()  # a collective under data parallel: every rank calls it
        if metrics is not None:
            metrics.update(router_metrics)
    return loss_sum / total, total


@torch.no_grad()
def mean_loss(model, rows: list[TokenizedRow], micro_size: int, pad_id: int, world: World = World()) -> float:
    """Mean token loss over all rows (summed over tokens, divided by their count); MoLoRA: routed by the rows'
    prompts, without the auxiliary loss. Data parallel: each rank sums its contiguous part of `rows`."""
    rows = rows[world.rank * len(rows) // world.size:(world.rank + 1) * len(rows) // world.size]
    total, loss_sum = 0, 0.0
    chunks = micro_batches(rows, micro_size)
    adapter = adapter_of(model)
    for chunk in chunks:
        ids, mask, labels = (t.to(model_device(model)) for t in collate(chunk, pad_id))
        with adapter.prompt_routing([prompt_ids(r) for r in chunk]):
            loss_sum += labelled_nll_sum(model, ids, mask, labels).item()
        total += sum(num_targets(r) for r in chunk)
    loss_sum, total = all_reduce_sums(world, [loss_sum, total])
    return loss_sum / total


# ---- plumbing ------------------------------------------------------------------------------------------

def load_model(cfg: SFTConfig, model_path: str):
    if cfg.molora is not None:  # a target module's typo: from the model's config, before the weights load
        ml.check_molora_targets(cfg.molora, model_path, cfg.model.trust_remote_code)
    elif not cfg.train.full_finetune:
        check_lora_targets(cfg.lora, model_path, cfg.model.trust_remote_code)
    base = load_base_model(cfg.model, model_path)
    if cfg.molora is not None:
        ml.attach_molora(base, cfg.molora)  # in place; freezes the base
        return base
    if not cfg.train.full_finetune:
        return attach_lora(base, cfg.lora)
    n_params = sum(p.numel() for p in base.parameters())
    if n_params > FULL_FINETUNE_MAX_PARAMS:
        raise UserError(f"train.full_finetune: the model has {n_params / 1e9:.1f}B parameters, over the "
                        f"{FULL_FINETUNE_MAX_PARAMS / 1e9:.0f}B limit; train a LoRA adapter (full_finetune=false)")
    return base.requires_grad_(True)


def resolve_steps(cfg: SFTConfig, num_rows: int) -> int:
    if cfg.train.epochs is None:
        return cfg.train.steps or DEFAULT_STEPS
    return max(1, math.ceil(cfg.train.epochs * num_rows / cfg.train.batch_size))


def save_outputs(cfg: SFTConfig, run_dir: RunDir, model, tokenizer) -> None:
    if not cfg.train.full_finetune:  # a LoRA adapter, or a MoLoRA folder (docs/molora.md)
        run_dir.write_folder("adapter", adapter_of(model).save)
        return

    def fill(folder: Path) -> None:
        model.save_pretrained(str(folder), safe_serialization=True)
        tokenizer.save_pretrained(str(folder))

    run_dir.write_folder("model", fill)


def checkpointed_weights(cfg: SFTConfig, model=None) -> Resumable:
    """What an sft checkpoint holds of the model: the adapter (PEFT or MoLoRA, through the adapter protocol) or, with
    full_finetune, every parameter (safetensors' save_model/load_model: tied embeddings are one shared tensor)."""
    if cfg.train.full_finetune:
        return Resumable("sft", SFT_MUST_MATCH,
                         lambda folder: safetensors_torch.save_model(model, str(folder / FULL_MODEL_FILE)),
                         lambda folder: safetensors_torch.load_model(model, str(folder / FULL_MODEL_FILE)))
    return Resumable("sft", SFT_MUST_MATCH, lambda folder: adapter_of(model).save(folder / "adapter"),
                     lambda folder: adapter_of(model).load(folder / "adapter"))


def run_sft(cfg: SFTConfig) -> dict:
    """Train; under torchrun every rank runs this, rank 0 alone writes and prints."""
    return on_every_rank(lambda world: _run_sft(cfg, world))


def _run_sft(cfg: SFTConfig, world: World) -> dict:
    run_dir, resume_from = check_inputs(cfg, world=world)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    model_path = resolve_model_path(cfg.model.path)
    tokenizer, tok = load_tokenizer(model_path, cfg.model.trust_remote_code)
    data = load_sft_data(cfg.data, tokenizer, tok.eos_ids[0], cfg.train.max_length)  # bad rows fail before the model
    steps = resolve_steps(cfg, len(data.train))
    if resume_from is not None:  # other settings: refused before the model loads
        check_supervised_resume(cfg, resume_from, steps, checkpointed_weights(cfg))
    model = load_model(cfg, model_path)
    model.train()
    params = trainable_parameters(model)
    optimizer, scheduler = build_optimizer(params, cfg.train, steps)
    kind = "parameters (full fine-tuning)" if cfg.train.full_finetune else "adapter parameters"
    if cfg.molora is not None:
        kind = (f"MoLoRA parameters ({cfg.molora.num_experts} experts, top {cfg.molora.top_k}, {cfg.molora.router} "
                f"router{', hydra' if cfg.molora.hydra else ''}, {len(ml.molora_modules(model))} modules)")
    info(f"rlora sft: {cfg.model.path}, {sum(p.numel() for p in params):,} {kind}, {len(data.train)} rows "
         f"({data.truncated} truncated, {data.dropped} dropped), {len(data.eval)} held out, {steps} steps "
         f"-> {cfg.train.output_dir}")
    if resume_from is None or not run_dir.holds_checkpoint(resume_from):
        run_dir.create()
    run_dir.write_text("config.yaml", to_yaml(cfg))
    first_step, t0, weights = 0, time.perf_counter(), checkpointed_weights(cfg, model)
    if resume_from is not None:
        first_step = restore_supervised_state(resume_from, run_dir, weights, optimizer, scheduler, world)
        t0 -= trained_seconds(resume_from)
    summary = {"status": "completed", "steps": first_step, "trainable_params": sum(p.numel() for p in params),
               "train_rows": len(data.train), "eval_rows": len(data.eval), "truncated_rows": data.truncated,
               "dropped_rows": data.dropped, "last_metrics": {}, "eval_loss": None}
    if first_step:  # a resume that trains no further step (already at the end) keeps what the run had logged
        summary |= logged_so_far(run_dir, ("eval_loss",))

    def checkpoint(done: int) -> None:
        save_supervised_state(run_dir, done, cfg, weights, optimizer, scheduler, time.perf_counter() - t0, world)

    # whatever stops the steps: keep what was learnt, say why it stopped
    with kept_on_stop(run_dir, summary, lambda: save_outputs(cfg, run_dir, model, tokenizer)):
        train_loop(cfg, run_dir, model, params, optimizer, scheduler, data, tok.pad_id, steps, summary, world,
                   first_step, checkpoint)
    save_outputs(cfg, run_dir, model, tokenizer)
    summary["train_s"] = time.perf_counter() - t0
    run_dir.write_json("summary.json", summary)
    _print_final(run_dir, summary)
    return summary


def train_loop(cfg: SFTConfig, run_dir: RunDir, model, params, optimizer, scheduler, data: SFTData, pad_id: int,
               steps: int, summary: dict, world: World = World(), first_step: int = 0,
               checkpoint: Callable[[int], None] | None = None) -> None:
    train = cfg.train
    order = LengthGroupedOrder([len(r.ids) for r in data.train], train.batch_size, train.group_window, train.seed)

    def one_batch(step: int) -> dict:
        rows = sorted((data.train[i] for i in order.indices(step)), key=lambda r: len(r.ids))
        router_metrics: dict = {}
        loss, tokens = backward_batch(model, world.share(rows), train.micro_batch_size, pad_id, router_metrics, world)
        return {"loss": loss, "tokens": tokens, **router_metrics}

    def held_out() -> dict:
        model.eval()
        try:
            return {"eval_loss": mean_loss(model, data.eval, train.micro_batch_size, pad_id, world)}
        finally:
            model.train()

    def describe(m: dict) -> str:
        eval_text = f"  eval_loss {m['eval_loss']:.4f}" if "eval_loss" in m else ""
        return f"loss {m['loss']:.4f}{eval_text}  {m['tokens']} tokens"

    optimizer_steps("sft", steps, params, optimizer, scheduler, train.max_grad_norm, one_batch,
                    held_out if data.eval else None, train.eval_every, run_dir, summary, describe, first_step,
                    train.checkpoint_every, checkpoint)


def _print_final(run_dir: RunDir, summary: dict) -> None:
    rows = [("output", str(run_dir.path)), ("steps", str(summary["steps"])), ("train time", f"{summary['train_s']:.1f} s")]
    if "loss" in summary["last_metrics"]:  # a resume at the run's last step trains no step
        rows.append(("last loss", f"{summary['last_metrics']['loss']:.4f}"))
    if summary["eval_loss"] is not None:
        rows.append(("eval loss", f"{summary['eval_loss']:.4f}"))
    print_summary("rlora sft: done", rows)
