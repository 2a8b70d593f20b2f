"""Peak memory of PPO's four roles on one base versus the same roles as four separate models.

    .venv/bin/python bench/role_memory.py [--model smollm2] [--repeats 3] [--rows 16] [--prompt-tokens 32]
                                          [--completion-tokens 64] [--rank 16] [--device cpu]
                                          [--gradient-checkpointing] [--release-memory] [--json FILE]

Roles: the policy (base + LoRA), the reference (the base), a reward model (reward adapter + fp32 score head,
rlora's reward_model format) and a value model (value adapter + fp32 value head). Two layouts:

- one_base: the model loads once and every role sits on it, through the calls `rlora train` makes in
  train/session.py prepare() for algo.name=ppo with a `fn: reward_model` reward: attach_lora (the policy),
  attach_reward_adapters (the reward adapter beside the policy's), attach_critic (the value adapter); the
  reference is the policy with its adapter off.
- separate: four models loaded from the same folder: a policy (base + LoRA), a frozen reference, a reward
  model (load_reward_model on its own base) and a value model (base + LoRA + value head).

Each run is a fresh process (`--worker`), the layouts alternate (one_base, separate, one_base, ...), and the
tables give medians over `--repeats`. After loading, every weight is read once, so that "after load" counts
the weights in memory (transformers maps safetensors files and reads pages only when first touched). Then the
same work in both layouts, as in one PPO step without sampling and optimizer: reference log-probs, old
log-probs and old values (no gradient), reward scores (no gradient), GAE, the policy's forward + backward and
the value model's forward + backward, over `--rows` fixed random token sequences (prompt + completion, every
position real), float32, LoRA rank `--rank` on all linear layers for policy, reward and value adapters.

Measured per run: peak RSS (ru_maxrss) before loading, after loading and after the work; PSS (physical
memory, a page shared by several mappings counted once: /proc/self/smaps_rollup) after loading and after the
work; on `--device cuda`, torch.cuda.max_memory_allocated after loading and after the work. Caveat for the CPU:
the separate layout maps one unchanged file four times, so its copies share page-cache pages; RSS counts every
copy (what separate models with their own weights, e.g. a trained reward model, hold), PSS counts the shared
pages once (and splits them with other processes that map the same file). `--gradient-checkpointing` and
`--release-memory` are `train.gradient_checkpointing` and `train.release_memory` in both layouts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_common import model_folder  # noqa: E402
from compare_trl import peak_gpu_mb, peak_rss_mb  # noqa: E402

LAYOUTS = ("one_base", "separate")
PROBES = ("peak_rss_before_load_mb", "peak_rss_after_load_mb", "peak_rss_after_work_mb", "pss_after_load_mb",
          "pss_after_work_mb", "peak_gpu_after_load_mb", "peak_gpu_after_work_mb")


def pss_mb() -> float | None:
    """Proportional set size of this process in MiB (None where /proc/self/smaps_rollup is missing)."""
    try:
        lines = Path("/proc/self/smaps_rollup").read_text().splitlines()
    except OSError:
        return None
    return next(int(line.split()[1]) / 1024 for line in lines if line.startswith("Pss:"))


def role_config(model_path: str, reward_folder: str, args):
    """The settings of both layouts: `rlora train` with algo.name=ppo and the reward adapter as its reward."""
    from rlora.config import RLConfig, apply_presets, check_config

    cfg = RLConfig(
        model={"path": model_path, "dtype": "float32", "device": args.device},
        lora={"rank": args.rank, "alpha": 2 * args.rank, "target_modules": "all-linear"},
        data={"path": "unused.jsonl"}, rewards=[{"fn": "reward_model", "args": {"path": reward_folder}}],
        algo={"name": "ppo"}, rollout={"max_new_tokens": args.completion_tokens},
        train={"micro_batch_size": args.rows, "threads": args.threads,
               "gradient_checkpointing": args.gradient_checkpointing, "release_memory": args.release_memory},
    )
    apply_presets(cfg)  # as load_config does: ppo's critic section and beta
    check_config(cfg)
    return cfg


def checkpoint_if_asked(cfg, model) -> None:
    """prepare()'s train.gradient_checkpointing (active only in train mode: no-grad passes skip it)."""
    from rlora.models.loading import causal_lm

    if cfg.train.gradient_checkpointing:
        causal_lm(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def save_fresh_reward_model(model_path: str, folder: Path, rank: int) -> None:
    """A freshly initialised reward model in rlora's format (LoRA B = 0, head ~ N(0, 0.02)): memory, not quality."""
    import torch

    from rlora.config import LoraConfig, ModelConfig
    from rlora.models.loading import attach_lora, load_base_model
    from rlora.models.reward_model import hidden_size, new_score_head, save_reward_model

    torch.manual_seed(0)
    model = attach_lora(load_base_model(ModelConfig(path=model_path), model_path),
                        LoraConfig(rank=rank, alpha=2 * rank, target_modules="all-linear"))
    save_reward_model(folder, model, new_score_head(hidden_size(model), init_std=0.02))


# ---------------------------------------------------------------------------------------------- the roles
@dataclasses.dataclass
class Roles:
    policy: object  # peft model, the policy adapter active
    reference: object | None  # None: the policy with its adapter off
    reward_model: object
    reward_head: object
    reward_adapter: str | None  # the adapter to switch to on reward_model (None: it runs only its own)
    critic: object  # rlora.models.value_model.Critic

    def models(self) -> list:
        found = [self.policy, self.reference, self.reward_model, self.critic.model]
        return [m for i, m in enumerate(found) if m is not None and all(m is not other for other in found[:i])]


def one_base(cfg, tokenizer, tok) -> Roles:
    """prepare()'s calls for ppo with a reward adapter: one base, three adapters beside each other."""
    from rlora.data.prompts import PromptSets
    from rlora.models.loading import add_model_eos_ids, attach_lora, load_base_model
    from rlora.models.value_model import attach_critic
    from rlora.rewards.reward_adapter import attach_reward_adapters, reward_adapters
    from rlora.rewards.scoring import resolve_rewards

    base = load_base_model(cfg.model, cfg.model.path)
    add_model_eos_ids(tok, base)
    model = attach_lora(base, cfg.lora)
    rewards = resolve_rewards(cfg.rewards, has_task=False)
    attach_reward_adapters(rewards, model, tokenizer, tok, cfg, PromptSets([], []))
    critic = attach_critic(model, cfg.ppo.value_rank or cfg.lora.rank, cfg.ppo.value_alpha or cfg.lora.alpha,
                           cfg.ppo.value_head_init_std)
    checkpoint_if_asked(cfg, model)
    model.train()
    [reward] = reward_adapters(rewards)
    return Roles(model, None, model, reward.head, reward.adapter_name, critic)


def separate(cfg, tokenizer, tok) -> Roles:
    """The same roles as four models, each with its own base loaded from the same folder."""
    from rlora.config import LoraConfig
    from rlora.models.loading import attach_lora, load_base_model, model_device
    from rlora.models.reward_model import hidden_size, load_reward_model, new_score_head
    from rlora.models.value_model import Critic

    path = cfg.model.path
    policy = attach_lora(load_base_model(cfg.model, path), cfg.lora)
    checkpoint_if_asked(cfg, policy)
    policy.train()
    reference = load_base_model(cfg.model, path)
    reference.eval()
    reward_model, reward_head = load_reward_model(cfg.rewards[0].args["path"], load_base_model(cfg.model, path))
    reward_model.eval()
    value_lora = LoraConfig(rank=cfg.ppo.value_rank or cfg.lora.rank, alpha=cfg.ppo.value_alpha or cfg.lora.alpha,
                            target_modules=cfg.lora.target_modules)
    value_model = attach_lora(load_base_model(cfg.model, path), value_lora)  # its "default" adapter: the value adapter
    checkpoint_if_asked(cfg, value_model)
    value_model.train()
    head = new_score_head(hidden_size(value_model), cfg.ppo.value_head_init_std, model_device(value_model))
    return Roles(policy, reference, reward_model, reward_head, None, Critic(value_model, head, "default"))


def base_parameter_counts(roles: Roles) -> tuple[int, int]:
    """(base parameters held by all roles, each tensor counted once, base parameters of one model). LoRA
    weights and heads are not base parameters."""
    def base_tensors(model) -> dict:
        return {p.data_ptr(): p.numel() for name, p in model.named_parameters() if "lora_" not in name}

    held: dict = {}
    for model in roles.models():
        held |= base_tensors(model)
    return sum(held.values()), sum(base_tensors(roles.policy).values())


def read_every_weight(roles: Roles) -> None:
    """Touch each parameter and buffer once, so that mapped weights are in memory."""
    import torch

    with torch.no_grad():
        for model in roles.models():
            for tensor in list(model.parameters()) + list(model.buffers()):
                tensor.float().sum()
        roles.reward_head.weight.sum()
        roles.critic.head.weight.sum()


# ---------------------------------------------------------------------------------------------- the work
def random_rollout(rows: int, prompt_tokens: int, completion_tokens: int, vocab_size: int):
    """Fixed random token ids (the same in every run), every position real."""
    import torch

    from rlora.types import Rollout

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab_size, (rows, prompt_tokens), generator=g)
    completion = torch.randint(0, vocab_size, (rows, completion_tokens), generator=g)
    return Rollout(prompt, torch.ones_like(prompt), completion, torch.ones_like(completion), [""] * rows,
                   ["length"] * rows, torch.ones(rows))


def reward_scores(roles: Roles, rollout, micro_batch_size: int):
    """[B] scores of prompt + completion under the reward model, no gradient (RewardAdapter.__call__'s scoring
    loop, on token ids instead of text)."""
    import torch

    from rlora.models.loading import model_device
    from rlora.models.reward_model import score
    from rlora.rewards.reward_adapter import reward_adapter_active

    ids = torch.cat([rollout.prompt_ids_BTp, rollout.completion_ids_BTc], dim=1)
    mask = torch.cat([rollout.prompt_mask_BTp, rollout.completion_mask_BTc], dim=1)
    device = model_device(roles.reward_model)
    active = (reward_adapter_active(roles.reward_model, roles.reward_adapter) if roles.reward_adapter
              else nullcontext())
    parts = []
    with torch.no_grad(), active:
        for lo in range(0, len(ids), micro_batch_size):
            parts.append(score(roles.reward_model, roles.reward_head, ids[lo:lo + micro_batch_size].to(device),
                               mask[lo:lo + micro_batch_size].to(device)).cpu())
    return torch.cat(parts)


def ppo_work(roles: Roles, cfg, rollout) -> dict:
    """train/ppo_step.py's passes after sampling, optimizer step left out -> numbers that must agree across
    layouts (the reference log-probs and the reward scores come from the same weights and tokens)."""
    from rlora.algos.gae import ppo_advantages
    from rlora.algos.registry import get_algorithm
    from rlora.models.adapters import reference_policy
    from rlora.train.ppo_step import accumulate_value_gradient, batched_values
    from rlora.train.update import ScoredRollout, accumulate_policy_gradient, batched_logprobs

    mb, chunk, beta = cfg.train.micro_batch_size, cfg.train.logprob_chunk_tokens, cfg.algo.beta
    mask_BT = rollout.completion_mask_BTc.float()
    with reference_policy(roles.policy) if roles.reference is None else nullcontext():
        ref_logp = batched_logprobs(roles.reference or roles.policy, rollout, mb, chunk)
    old_logp = batched_logprobs(roles.policy, rollout, mb, chunk)
    old_values_BT = batched_values(roles.critic, rollout, mb) * mask_BT
    scores_B = reward_scores(roles, rollout, mb)
    targets = ppo_advantages(scores_B.double(), old_values_BT, mask_BT, cfg.ppo.gamma, cfg.ppo.lam,
                             cfg.ppo.whiten_advantages, cfg.algo.adv_eps, old_logp - ref_logp, beta)
    algo = dataclasses.replace(get_algorithm("ppo"), kl_in_reward=cfg.ppo.kl_mode == "reward")
    scored = ScoredRollout(rollout, targets.advantages_BT, mask_BT, old_logp, ref_logp)
    update = accumulate_policy_gradient(roles.policy, algo, cfg.algo, scored, mb, cfg.constant_norm(), chunk)
    update |= accumulate_value_gradient(roles.critic, rollout, targets.returns_BT, old_values_BT, mask_BT, mb,
                                        cfg.ppo.value_clip)
    return {"ref_logp_sum": float(ref_logp.double().sum()), "reward_sum": float(scores_B.double().sum()),
            "policy_loss": update["loss"], "value_loss": update["value_loss"]}


# ---------------------------------------------------------------------------------------------- one run
def worker(layout: str, reward_folder: str, args) -> dict:
    import torch

    from rlora.logging.console import quiet_libraries
    from rlora.models.loading import load_tokenizer
    from rlora.system import return_freed_memory

    quiet_libraries()
    if args.release_memory and not return_freed_memory():  # as `rlora train` does before prepare()
        raise RuntimeError("--release-memory needs glibc")
    torch.set_num_threads(args.threads)
    before = peak_rss_mb()
    cfg = role_config(model_folder(args.model), reward_folder, args)
    tokenizer, tok = load_tokenizer(cfg.model.path)
    roles = (one_base if layout == "one_base" else separate)(cfg, tokenizer, tok)
    read_every_weight(roles)
    after_load = {"peak_rss_after_load_mb": peak_rss_mb(), "pss_after_load_mb": pss_mb(),
                  "peak_gpu_after_load_mb": peak_gpu_mb()}
    held, per_copy = base_parameter_counts(roles)
    rollout = random_rollout(args.rows, args.prompt_tokens, args.completion_tokens,
                             roles.policy.get_base_model().config.vocab_size)
    start = time.perf_counter()
    checks = ppo_work(roles, cfg, rollout)
    work_s = time.perf_counter() - start
    return {"layout": layout, "peak_rss_before_load_mb": before, **after_load,
            "peak_rss_after_work_mb": peak_rss_mb(), "pss_after_work_mb": pss_mb(),
            "peak_gpu_after_work_mb": peak_gpu_mb(), "base_params_held": held, "base_params_per_copy": per_copy,
            "base_copies": held / per_copy, "models": len(roles.models()), "work_s": work_s, **checks}


def spawn(layout: str, reward_folder: str, argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
        worker_args = ["--worker", layout, "--reward-folder", reward_folder, "--out", str(out)]
        done = subprocess.run([sys.executable, __file__, *argv, *worker_args], env={**os.environ, "PYTHONPATH": path},
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{layout} run failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def summarise(runs: dict[str, list[dict]]) -> dict:
    summary = {layout: {key: median(results, key) for key in (*PROBES, "work_s")} for layout, results in runs.items()}
    for layout, results in runs.items():
        for key in ("base_copies", "models", "ref_logp_sum", "reward_sum"):
            summary[layout][key] = results[0][key]
    summary["ratio"] = {key: summary["one_base"][key] / summary["separate"][key] for key in PROBES
                        if summary["one_base"][key] and summary["separate"][key]}
    summary["runs"] = runs
    return summary


def print_table(summary: dict, args) -> None:
    print(f"# roles on one base vs separate models: {args.model}, float32, LoRA rank {args.rank} all-linear, "
          f"{args.rows} rows x ({args.prompt_tokens} + {args.completion_tokens}) tokens, {args.device}, "
          f"{args.threads} threads, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}, "
          f"release_memory {'on' if args.release_memory else 'off'}, "
          f"medians of {args.repeats} runs each (alternating)")
    one, sep = summary["one_base"], summary["separate"]
    print(f"base copies held: one_base {one['base_copies']:g} ({one['models']} model object), "
          f"separate {sep['base_copies']:g} ({sep['models']} model objects)")
    print(f"{'MiB':<26} {'one_base':>9} {'separate':>9} {'ratio':>6}")
    for key in PROBES:
        if one[key] is None or sep[key] is None:
            continue
        ratio = summary["ratio"].get(key)
        print(f"{key.removesuffix('_mb'):<26} {one[key]:9.0f} {sep[key]:9.0f} {ratio:6.3f}")
    print(f"work s (median)            {one['work_s']:9.1f} {sep['work_s']:9.1f}")
    print(f"same work: ref log-prob sum {one['ref_logp_sum']:.4f} / {sep['ref_logp_sum']:.4f}, "
          f"reward sum {one['reward_sum']:.6f} / {sep['reward_sum']:.6f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (the embedded SmolLM2-135M-Instruct) or a folder")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each layout (alternating)")
    parser.add_argument("--rows", type=int, default=16, help="sequences (also the micro-batch size)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of the policy, reward and value adapters")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="train.gradient_checkpointing=true (the policy and value passes recompute activations)")
    parser.add_argument("--release-memory", action="store_true",
                        help="train.release_memory=true (glibc returns freed large blocks to the OS at once)")
    parser.add_argument("--json", help="also write the summary and every run here")
    parser.add_argument("--worker", choices=LAYOUTS, help=argparse.SUPPRESS)
    parser.add_argument("--reward-folder", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.out).write_text(json.dumps(worker(args.worker, args.reward_folder, args)))
        return 0
    argv = [f"--model={args.model}", f"--rows={args.rows}", f"--prompt-tokens={args.prompt_tokens}",
            f"--completion-tokens={args.completion_tokens}", f"--rank={args.rank}", f"--device={args.device}",
            f"--threads={args.threads}", *(["--gradient-checkpointing"] if args.gradient_checkpointing else []),
            *(["--release-memory"] if args.release_memory else [])]
    from rlora.logging.console import quiet_libraries

    quiet_libraries()
    with tempfile.TemporaryDirectory() as tmp:
        reward_folder = Path(tmp) / "reward_model"
        save_fresh_reward_model(model_folder(args.model), reward_folder, args.rank)
        runs: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
        for _ in range(args.repeats):
            for layout in LAYOUTS:
                runs[layout].append(spawn(layout, str(reward_folder), argv))
    summary = summarise(runs)
    print_table(summary, args)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
