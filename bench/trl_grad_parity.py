"""Does one rlora GRPO update move the adapter as TRL's would? Loss and LoRA gradient on ONE identical batch.

    PYTHONPATH=src:bench .venv/bin/python bench/trl_grad_parity.py [--model smollm2] [--seed 0] [--lora-b-std 0.01]

Both sides get the same model, the same LoRA weights (TRL's adapter is overwritten with rlora's), the same
prompts (checked: TRL's tokenisation equals rlora's), the same sampled completions (of different lengths, drawn
once at the demo's temperature) and the same hand-set rewards. rlora: the demo config's algorithm (grpo, token_mean,
adv_scale group, beta 0), advantages from its registry and the gradient from train/update.py
(accumulate_policy_gradient) as a step computes them. TRL 1.16 GRPOTrainer: its advantage formula (the lines of
_generate_and_score_completions for scale_rewards="group", with trl's own nanstd) and its compute_loss on the
inputs dict that _generate_and_score_completions returns, loss_type="dapo" (compare_trl.py's match of token_mean),
one micro-batch (gradient_accumulation_steps = steps_per_generation = 1, as in compare_trl.py quality mode).
Printed: both sides' advantages, loss, gradient norm and the cosine / norm ratio of the two gradients, overall and
per LoRA matrix kind; with --lora-b-std 0 the adapter is at its init (B = 0), so only B has a gradient.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# per prompt: G rewards, chosen so that both groups have spread (a flat group trains nothing on either side)
REWARDS = [[1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    """Cosine and norm ratio a/b of the flattened gradients, overall and per LoRA matrix kind (A, B)."""
    assert set(a) == set(b), f"gradients on different parameters: {sorted(set(a) ^ set(b))[:4]}"
    out = {}
    for kind in ("all", "lora_A", "lora_B"):
        names = [n for n in a if kind == "all" or kind in n]
        if not names:
            continue
        va = torch.cat([a[n].flatten().double() for n in names])
        vb = torch.cat([b[n].flatten().double() for n in names])
        norm_a, norm_b = float(va.norm()), float(vb.norm())
        cos = float(va @ vb) / max(norm_a * norm_b, 1e-300)
        out[kind] = {"cosine": cos, "norm_rlora": norm_a, "norm_trl": norm_b,
                     "norm_ratio_rlora_over_trl": norm_a / norm_b if norm_b else float("nan"),
                     "max_abs_diff": float((va - vb).abs().max())}
    return out


def sample_batch(model, prompt_ids: list[list[int]], G: int, max_new: int, temperature: float, pad_id: int,
                 eos_id: int, seed: int):
    """G completions per prompt from `model` -> (left-padded prompts, right-padded completions, mask up to and
    including the first EOS), prompt-major. A model that never samples EOS (a random one) gets its completions
    cut to different lengths, so that the token-mean normaliser differs from a per-sequence one."""
    width = max(map(len, prompt_ids))
    rows = [ids for ids in prompt_ids for _ in range(G)]
    prompt = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    prompt_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=prompt_mask, do_sample=True, temperature=temperature,
                             top_k=0, top_p=1.0, max_new_tokens=max_new, pad_token_id=pad_id, eos_token_id=eos_id)
    completion = out[:, width:]
    is_eos = completion == eos_id
    # 1 up to and including the first EOS
    mask = ((is_eos.cumsum(-1) - is_eos.long()) == 0).long()
    if len(set(mask.sum(-1).tolist())) == 1:
        keep_B = torch.tensor([max_new - (7 * i) % max_new for i in range(len(mask))])
        mask = (torch.arange(mask.shape[1])[None, :] < keep_B[:, None]).long()
        completion = torch.where(mask.bool(), completion, torch.full_like(completion, pad_id))
    length = int(mask.sum(-1).max())
    return prompt, prompt_mask, completion[:, :length], mask[:, :length]


def rlora_side(model, cfg, prompt, prompt_mask, completion, mask, rewards_P_G):
    from rlora.algos.registry import AdvantageInputs, get_algorithm
    from rlora.train.update import ScoredRollout, accumulate_policy_gradient
    from rlora.types import Rollout

    algo = get_algorithm(cfg.algo.name)
    G = rewards_P_G.shape[1]
    mask_f = mask.float()
    advantages_BT = algo.advantages_BT(AdvantageInputs(rewards_P_G.double(), mask_f, cfg.algo.adv_scale,
                                                       cfg.algo.adv_eps, cfg.algo.beta, G))
    rollout = Rollout(prompt, prompt_mask, completion, mask, [""] * len(mask), ["stop"] * len(mask),
                      torch.full((len(mask),), cfg.rollout.temperature))
    # old log-probs None: one update per rollout, old = current (detached), ratio 1 (what grpo_step passes)
    scored = ScoredRollout(rollout, advantages_BT, mask_f)
    model.zero_grad(set_to_none=True)
    model.train()
    metrics = accumulate_policy_gradient(model, algo, cfg.algo, scored, cfg.train.micro_batch_size,
                                         cfg.constant_norm(), cfg.train.logprob_chunk_tokens)
    return advantages_BT[:, 0], metrics["loss"], lora_grads(model)


def trl_advantages(rewards_B: torch.Tensor, G: int) -> torch.Tensor:
    """TRL 1.16's advantages for scale_rewards="group" (grpo_trainer.py, multi_objective_aggregation
    "sum_then_normalize"): (r - group mean) / (nanstd + 1e-4), nanstd being trl's (Bessel-corrected)."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards_B.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    std = nanstd(rewards_B.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    return (rewards_B - mean) / (std + 1e-4)


def trl_side(trainer, prompt, prompt_mask, completion, mask, rewards_P_G):
    G = rewards_P_G.shape[1]
    advantages = trl_advantages(rewards_P_G.reshape(-1).float(), G)
    inputs = {"prompt_ids": prompt, "prompt_mask": prompt_mask, "completion_ids": completion,
              "completion_mask": mask, "advantages": advantages, "num_items_in_batch": mask.sum()}
    model = trainer.model
    model.zero_grad(set_to_none=True)
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; one micro-batch per step here
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    return advantages, float(loss.detach()), lora_grads(model)


def step_deltas(model, step) -> dict[str, torch.Tensor]:
    """The change of every LoRA weight made by step() (clip + AdamW step, on the gradients already in place)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    step()
    return {n: p.detach() - before[n] for n, p in model.named_parameters() if p.requires_grad}


def optimizer_steps(model, cfg, loss: float, trainer) -> tuple[dict, dict, dict]:
    """One optimizer step on each side from the gradients in place: rlora's (train/optim.py, as grpo_step takes it)
    and TRL's (Trainer.create_optimizer, its clip at max_grad_norm, then step) -> (rlora's deltas, TRL's, TRL's
    AdamW hyper-parameters)."""
    from rlora.models.loading import trainable_parameters
    from rlora.train.optim import build_optimizer, optimizer_step

    params = trainable_parameters(model)
    optimizer, scheduler = build_optimizer(params, cfg.train, cfg.train.steps)
    ours = step_deltas(model, lambda: optimizer_step(params, optimizer, scheduler, cfg.train.max_grad_norm, loss))
    trl_optimizer = trainer.create_optimizer()
    trl_params = [p for p in trainer.model.parameters() if p.requires_grad]

    def trl_step():
        torch.nn.utils.clip_grad_norm_(trl_params, trainer.args.max_grad_norm)  # Trainer: accelerator's, the same
        trl_optimizer.step()

    theirs = step_deltas(trainer.model, trl_step)
    hyper = {k: v for k, v in trl_optimizer.param_groups[0].items() if k != "params"}
    return ours, theirs, {k: v if isinstance(v, (int, float, bool, type(None))) else str(v) for k, v in hyper.items()}


def build_trl(folder: str, cfg, seed: int):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from bench_common import answer_reward, task_rows
    from compare_trl import LOSS_AGG_TO_TRL, TRL_PINNED

    G = cfg.rollout.num_generations
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl_parity_"),
                      per_device_train_batch_size=cfg.train.micro_batch_size, gradient_accumulation_steps=1,
                      num_generations=G,
                      max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                      learning_rate=cfg.train.lr, beta=cfg.algo.beta, loss_type=LOSS_AGG_TO_TRL[cfg.algo.loss_agg],
                      seed=seed, max_steps=1, bf16=False, use_cpu=True, **TRL_PINNED)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    lora = LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, target_modules=cfg.lora.target_modules,
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    return GRPOTrainer(model=model, reward_funcs=[answer_reward], args=args,
                       train_dataset=Dataset.from_list(task_rows("train", 64)), processing_class=tokenizer,
                       peft_config=lora)


def parity_report(folder: str, seed: int = 0, lora_b_std: float = 0.01) -> dict:
    """One batch, both sides' advantages, loss and LoRA gradient -> the report main prints."""
    from bench_common import task_rows
    from rlora.config import ModelConfig, load_config
    from rlora.data.prompts import render_prompt
    from rlora.models.loading import attach_lora, load_base_model, load_tokenizer
    from rlora.train.session import seed_everything
    from rlora.types import Example

    cfg = load_config(None, [f"model.path={folder}", f"train.seed={seed}"])  # the demo
    G = cfg.rollout.num_generations
    rewards_P_G = torch.tensor(REWARDS)
    assert rewards_P_G.shape[1] == G, f"REWARDS has {rewards_P_G.shape[1]} per prompt; the demo samples {G}"

    seed_everything(seed)  # as rlora's session does before it attaches the adapter
    model = attach_lora(load_base_model(ModelConfig(path=folder, dtype="float32"), folder), cfg.lora)
    trainer = build_trl(folder, cfg, seed)
    rl_params = dict(model.named_parameters())
    trl_params = dict(trainer.model.named_parameters())
    lora_names = [n for n, p in rl_params.items() if p.requires_grad]
    assert sorted(lora_names) == sorted(n for n, p in trl_params.items() if p.requires_grad), "LoRA layouts differ"
    with torch.no_grad():
        init_same = all(torch.equal(rl_params[n], trl_params[n]) for n in lora_names)
        a_std = {side: float(torch.cat([p[n].flatten() for n in lora_names if "lora_A" in n]).std())
                 for side, p in (("rlora", rl_params), ("trl", trl_params))}
        generator = torch.Generator().manual_seed(seed + 1)
        for n in lora_names:  # one adapter for both: rlora's (B perturbed so that A has a gradient too)
            if "lora_B" in n and lora_b_std:
                rl_params[n].normal_(0.0, lora_b_std, generator=generator)
            trl_params[n].copy_(rl_params[n])

    tokenizer, tok = load_tokenizer(folder)
    rows = task_rows("train")[:len(REWARDS)]
    prompt_ids = [render_prompt(tokenizer, Example(prompt=r["prompt"], columns={}), None, True) for r in rows]
    trl_ids = trainer._tokenize_prompts([r["prompt"] for r in rows])[0]
    assert [list(x) for x in trl_ids] == prompt_ids, "TRL tokenises the prompts differently"
    batch = sample_batch(model, prompt_ids, G, cfg.rollout.max_new_tokens, cfg.rollout.temperature,
                         tok.pad_id, tok.eos_ids[0], seed)
    lengths_B = batch[3].sum(-1)

    adv_rl, loss_rl, grad_rl = rlora_side(model, cfg, *batch, rewards_P_G)
    adv_trl, loss_trl, grad_trl = trl_side(trainer, *batch, rewards_P_G)
    delta_rl, delta_trl, trl_adamw = optimizer_steps(model, cfg, loss_rl, trainer)
    return {
        "completion_lengths": lengths_B.tolist(), "rewards": REWARDS,
        "lora_init_identical_same_seed": init_same, "lora_A_init_std": a_std,
        "advantages_rlora": [round(x, 6) for x in adv_rl.tolist()],
        "advantages_trl": [round(x, 6) for x in adv_trl.tolist()],
        "advantages_max_abs_diff": float((adv_rl - adv_trl).abs().max()),
        "loss_rlora": loss_rl, "loss_trl": loss_trl,
        # ratio 1: the loss is -sum_i A_i * L_i / sum_i L_i (token mean), whatever the model
        "loss_expected": float(-(adv_rl * lengths_B).sum() / lengths_B.sum()),
        "grad": compare(grad_rl, grad_trl),
        # AdamW's first step is about lr x sign(gradient) per weight: a gradient scale alone would not show here
        "update": compare(delta_rl, delta_trl),
        "settings": {"algo": cfg.algo.name, "loss_agg": cfg.algo.loss_agg, "adv_scale": cfg.algo.adv_scale,
                     "beta": cfg.algo.beta, "temperature": cfg.rollout.temperature, "lr": cfg.train.lr,
                     "schedule": cfg.train.schedule, "warmup_steps": cfg.train.warmup_steps,
                     "weight_decay": cfg.train.weight_decay, "adam_betas": [cfg.train.adam_beta1, cfg.train.adam_beta2],
                     "max_grad_norm": cfg.train.max_grad_norm, "lora_dropout": cfg.lora.dropout,
                     "trl": {"optim": str(trainer.args.optim), "lr_scheduler": str(trainer.args.lr_scheduler_type),
                             "max_grad_norm": trainer.args.max_grad_norm, "adamw_param_group": trl_adamw}},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-b-std", type=float, default=0.01,
                        help="B ~ N(0, std) on both sides (0: the init, B = 0, where A has no gradient)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from bench_common import model_folder
    from rlora.logging.console import quiet_libraries

    quiet_libraries()
    report = parity_report(model_folder(args.model), args.seed, args.lora_b_std)
    for key, value in report.items():
        print(f"{key}: {json.dumps(value)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
