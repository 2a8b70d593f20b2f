"""The GRPO recipe, top to bottom: prepare the session (train/session.py: everything validated before any
model loads), then for each step: sample -> score -> advantages -> reference/old log-probs -> update(s) -> log."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext

from rlora.config import RLConfig, to_yaml
from rlora.data.prompts import prompt_text
from rlora.errors import UserError
from rlora.logging.console import info, metrics_line, print_summary, progress_bar
from rlora.train.sinks import Sinks
from rlora.models.loading import trainable_parameters
from rlora.plot import plot_after_run
from rlora.system import return_freed_memory
from rlora.train import policies as pol
from rlora.train.checkpoint import set_aside_after
from rlora.train.distributed import World, all_reduce_sums, barrier, gather_objects, on_every_rank, rank_divergence
from rlora.train.evaluate import eval_sampling, evaluate_policies
from rlora.train.metrics import merge_metrics
from rlora.train.lifecycle import kept_on_stop
from rlora.train.outputs import RunDir, to_json
from rlora.train.ppo_step import ppo_step
from rlora.train.replay import ReplayBuffer, replay_buffers
from rlora.train.resume import check_same_run, replay_state, restore_training_state, rng_state, save_training_state
from rlora.train.session import Session, prepare
from rlora.train.step import grpo_step


def eval_before(s: Session) -> dict | None:
    """Held-out evaluation before training (of the first policy: before training every policy is the same
    function, so it stands for all)."""
    if not s.prompts.eval:
        return None
    [(result, samples)] = _evaluate(s, "before", s.policies[:1])
    return record_eval(s.run_dir, "before", "", result, samples)


def _evaluate(s: Session, label: str, policies: list[pol.Policy]) -> list[tuple[dict, list[dict]]]:
    """These policies' held-out evaluations, sampled together -> [(metrics, rows)] in their order."""
    ev = s.cfg.eval
    texts = [prompt_text(ex) for ex in s.prompts.eval]
    with progress_bar(f"eval ({label})", len(texts) * len(policies)) as update:
        return evaluate_policies(s.model, s.eval_source, s.prompts.eval, s.eval_ids, texts, eval_sampling(s.cfg),
                                 ev.batch_size, s.adapter.sampler_policies([p.index for p in policies]),
                                 ev.num_samples, tuple(ev.pass_k), ev.seed, progress=update)


def record_eval(run_dir: RunDir, label: str, name: str, result: dict, samples: list[dict]) -> dict:
    """eval_{label}.jsonl in run_dir, and the line on the console."""
    run_dir.write_text(f"eval_{label}.jsonl", "".join(_jsonl(x) for x in samples))
    reward = "-" if result["reward_mean"] is None else f"{result['reward_mean']:.3f}"
    failures = f", {result['reward_failures']} reward failures" if result["reward_failures"] else ""
    info(f"held-out {label}{name}: accuracy {result['accuracy']:.3f}  reward {reward}  (n={result['n']}{failures})")
    return result


def eval_after(s: Session) -> dict | None:
    """The evaluation after training of every policy, sampled together: the policy's result, or {name: result}
    beside other policies (each then also in its folder: eval_after.jsonl, eval.json)."""
    if not s.prompts.eval:
        return None
    results = {}
    for policy, (result, samples) in zip(s.policies, _evaluate(s, "after", s.policies)):
        name = f" {policy.name}" if policy.own_folder else ""
        results[policy.name] = record_eval(policy.run_dir, "after", name, result, samples)
    for policy in pol.own_folders(s.policies):
        policy.run_dir.write_json("eval.json", {"after": results[policy.name]})
    return pol.per_run(s.policies, results)


def main_eval(s: Session, run: Callable[[], dict | None]) -> dict | None:
    """Rank 0 evaluates (run()) while the others wait; with train.fsdp every rank enters the sharded base's sampling
    scope for it (and, streaming it, takes part in rank 0's passes over the layers)."""
    with s.sharded.sampling() if s.sharded is not None else nullcontext():
        return run() if s.world.is_main else None


def _jsonl(obj) -> str:
    return to_json(obj) + "\n"


def save_final(s: Session, name: str = "adapter") -> None:
    """Each policy in its folder: a PEFT adapter folder, a MoLoRA folder (docs/molora.md); beside other policies,
    each in its own OUTPUT/policies/NAME."""
    for policy in s.policies:
        policy.run_dir.write_folder(name, lambda folder, k=policy.index: s.adapter.save(folder, k))
    for policy, critic in zip(s.policies, s.critics):  # PPO: adapter -> value_model, adapter-stepN -> value_model-stepN
        policy.run_dir.write_folder(name.replace("adapter", "value_model"), critic.save)


def start(s: Session, replay) -> tuple[int, float, dict]:
    """A fresh run: create the folder and evaluate before training. A resumed one: put the checkpoint's
    state back and drop log lines of steps after it. -> (first step, training time so far, evaluations)."""
    cfg = s.cfg
    if s.resume_from is None or not s.run_dir.holds_checkpoint(s.resume_from):
        s.run_dir.create()
    pol.create_folders(s.policies)
    s.run_dir.write_text("config.yaml", to_yaml(cfg))
    if s.resume_from is None:
        before = main_eval(s, lambda: eval_before(s)) if cfg.eval.before else None
        barrier(s.world)
        return 0, 0.0, {"before": before}
    state = check_same_run(cfg, s.resume_from)
    restore_training_state(s.resume_from, s.adapter, s.policies, replay, s.critics, s.world.size, s.world.rank)
    for run_dir, names in [(s.run_dir, ("metrics.jsonl", "samples.jsonl"))] + [(p.run_dir, ("metrics.jsonl",))
                                                                                for p in pol.own_folders(s.policies)]:
        run_dir.drop_steps_after(state["step"], names)
    if s.world.is_main and s.run_dir.holds_checkpoint(s.resume_from):
        for folder in set_aside_after(s.resume_from.parent, state["step"]):
            step_name = "step-" + folder.name.rpartition("step-")[2]  # abandoned-[K-]step-N
            info(f"checkpoint {step_name} is after the resumed step: kept as {folder}")
    info(f"resuming from {s.resume_from} after step {state['step']}")
    return state["step"], state["train_s"], {"before": state["eval_before"]}


def run_grpo(cfg: RLConfig) -> dict:
    """Train; under torchrun every rank runs this, rank 0 alone writes and prints."""
    return on_every_rank(lambda world: _run(cfg, world))


def _run(cfg: RLConfig, world: World) -> dict:
    if cfg.train.release_memory and not return_freed_memory():
        info("train.release_memory has no effect here (needs glibc)")
    s = prepare(cfg, world)
    n_trainable = _announce(s)
    replay = replay_buffers(cfg.algo.replay, [p.seed for p in s.policies], world.rank) if cfg.algo.replay.enabled \
        else None
    first_step, train_s_before, evals = start(s, replay)
    sinks = Sinks(cfg, s.run_dir, first_step)  # TensorBoard, W&B, completions table (log.*)
    t0, last = time.perf_counter() - train_s_before, {}
    summary = {"status": "completed", "last_metrics": last, "eval": evals}  # what summary.json holds if a step fails

    def checkpoint(done: int) -> None:
        write_checkpoint(s, done, replay, time.perf_counter() - t0, evals["before"])

    with kept_on_stop(s.run_dir, summary, lambda: save_final(s), before_save=lambda: sinks.close(failed=True)):
        with progress_bar("train", cfg.train.steps) as update:
            update(first_step, "")
            for step in range(first_step, cfg.train.steps):
                metrics, samples = (ppo_step if s.critics else grpo_step)(s, step, replay)
                last = summary["last_metrics"] = log_step(s, step, metrics, samples, sinks)
                if cfg.train.save_every and (step + 1) % cfg.train.save_every == 0:
                    save_final(s, f"adapter-step{step + 1}")
                if cfg.train.checkpoint_every and (step + 1) % cfg.train.checkpoint_every == 0:
                    checkpoint(step + 1)
                update(step + 1, progress_line(last, s.policies))
                out_of_time = bool(cfg.train.max_time_s) and time.perf_counter() - t0 >= cfg.train.max_time_s
                if all_reduce_sums(world, [float(out_of_time)])[0]:  # every rank stops after the same step
                    info(f"train.max_time_s={cfg.train.max_time_s} reached after {step + 1} "
                         f"step{'s' if step else ''}")
                    break
    sinks.close()
    save_final(s)
    done = last.get("step", first_step)
    if cfg.train.checkpoint_every and done % cfg.train.checkpoint_every:
        checkpoint(done)  # the end of the run is a checkpoint too: `train.steps=more train.resume=auto` extends it
    summary |= {"steps": done, "train_s": time.perf_counter() - t0, "adapter_params": n_trainable}
    return finish(s, summary, evals)


def _announce(s: Session) -> int:
    """The run's first line -> the number of trainable adapter parameters."""
    n_trainable = sum(p.numel() for p in trainable_parameters(s.model))
    in_critics = sum(p.numel() for critic in s.critics for p in critic.parameters())
    critic = f" (+ {in_critics:,} in the critic{'s' if len(s.critics) > 1 else ''})" if s.critics else ""
    info(f"rlora train: {s.cfg.model.path}, {n_trainable:,} adapter parameters{critic}, {len(s.train_ids)} prompts "
         f"-> {s.cfg.train.output_dir}")
    return n_trainable


def log_step(s: Session, step: int, metrics: dict, samples: list[dict], sinks: Sinks) -> dict:
    """A step's metrics joined over the ranks, written (metrics.jsonl, each policy's own, the sinks) -> the run's
    metrics of the step."""
    if s.world.active:
        metrics, samples = gather_step(s.world, metrics, samples, trainable_parameters(s.model) +
                                       [p for critic in s.critics for p in critic.parameters()])
    last, per_policy = pol.split_metrics(metrics, s.policies)
    for policy in pol.own_folders(s.policies):
        policy.run_dir.append_jsonl("metrics.jsonl", per_policy[policy.name])
    s.run_dir.append_jsonl("metrics.jsonl", last)
    sinks.log_metrics(step + 1, last)
    if s.cfg.train.sample_every and (step + 1) % s.cfg.train.sample_every == 0:
        sinks.log_completions(step + 1, samples)
    return last


def write_checkpoint(s: Session, done: int, replay: list[ReplayBuffer] | None, train_s: float,
                     eval_before: dict | None) -> None:
    """The training state after `done` steps (rank 0 writes it; every rank's replay buffers go in); a write that
    fails stops every rank with the same one-line error."""
    # each policy's buffer of every rank
    buffers = None if replay is None else [gather_objects(s.world, replay_state(b)) for b in replay]
    rngs = gather_objects(s.world, rng_state())  # every rank's own: their dropout masks differ
    cause = None
    if s.world.is_main:
        try:
            save_training_state(s.run_dir.path, done, s.cfg, s.adapter, s.policies, buffers, train_s, eval_before,
                                s.critics, rngs)
        except OSError as err:  # a full disk, a lost mount: the previous checkpoint is untouched
            cause = err.strerror or str(err)
    if all_reduce_sums(s.world, [float(cause is not None)])[0]:  # every rank stops with the same line
        raise UserError(f"could not write the checkpoint after step {done} ({cause or 'on rank 0'}); the previous "
                        "checkpoint stays valid: fix the cause and continue with train.resume=auto")


def finish(s: Session, summary: dict, evals: dict) -> dict:
    """After the last step: the evaluation after training, eval.json, summary.json, the plots, the summary table."""
    evals["after"] = main_eval(s, lambda: eval_after(s)) if s.cfg.eval.after else None
    barrier(s.world)
    if any(evals.values()):
        s.run_dir.write_json("eval.json", evals)
    s.run_dir.write_json("summary.json", summary)
    if s.cfg.log.plot and s.world.is_main:  # several policies: their curves overlaid
        plot_after_run(s.run_dir.path, [p.run_dir.path for p in pol.own_folders(s.policies)] or None)
    _print_final(s, summary)
    return summary


def gather_step(world: World, metrics: dict, samples: list[dict], params) -> tuple[dict, list[dict]]:
    """Every rank's metrics merged (each by its reduction, train/metrics.py) and samples joined,
    with the check that all ranks hold the same adapter."""
    gathered = gather_objects(world, (metrics, samples))
    merged = merge_metrics([m for m, _ in gathered])
    merged |= {"world_size": world.size, "adapter_rank_divergence": rank_divergence(world, params)}
    return merged, [row for _, rows in gathered for row in rows]


def progress_line(flat: dict, policies: list[pol.Policy]) -> str:
    """The progress line of a step (the run's metrics): the metrics' line of one policy; beside other policies,
    each one's mean reward and the step time."""
    if not pol.own_folders(policies):
        return metrics_line(flat)
    rewards = "  ".join(f"{p.name} {'-' if flat.get(f'{p.name}/reward_mean') is None else format(flat[f'{p.name}/reward_mean'], '.3f')}"
                        for p in policies)
    return f"reward {rewards}  {flat['step_s']:.1f}s/step"


def _print_final(s: Session, summary: dict) -> None:
    rows = [("output", str(s.run_dir.path)), ("steps", str(summary["steps"])),
            ("train time", f"{summary['train_s']:.1f} s")]
    last = summary["last_metrics"]
    if last:
        rows.append(("last step", progress_line(last, s.policies)))
    for label in ("before", "after"):
        result = summary["eval"].get(label)
        per_policy = result if pol.own_folders(s.policies) and label == "after" and result else {"": result}
        for name, one in per_policy.items():
            if one:
                rows.append((f"held-out accuracy {label}{' ' + name if name else ''}", f"{one['accuracy']:.3f} (n={one['n']})"))
    print_summary("rlora train: done", rows)
