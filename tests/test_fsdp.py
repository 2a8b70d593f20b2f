"""train.fsdp on CPU (gloo): 2 ranks with the base's decoder layers sharded == 2 ranks without (which
tests/test_distributed.py compares with 1 rank); the combinations it refuses are one line each."""

import json
import os
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import tiny_overrides
from rlora.cli import main
from rlora.config import check_launch, load_config
from rlora.errors import UserError
from rlora.models.tiny import build_random_model
from test_distributed import TESTS, _run, run_process_group
from test_reward_adapter import rm_folder  # noqa: F401 - a fixture


@pytest.mark.slow  # 100 s on a 2-core CPU; the default suite keeps the sharded policies run and the sampling tests
def test_sharded_base_trains_and_samples_like_data_parallel(tiny_model_dir, prompts_file, tmp_path):
    """Rank 0's only group is flat (flat_for_zero, no KL): it trains no row while rank 1 trains four, so rank 0
    pads with zero passes. Also on: the frozen layer 0 computed once (top_layers=1, old log-probs for 2
    iterations), gradient checkpointing, evaluation before/after (rank 0, on the gathered base), checkpoints:
    the sharded run stops after 2 steps and resumes for the 3rd; the unsharded one runs 3 straight. The run that
    streams the layers through the sampler (train.fsdp_gather=layer) runs 3 straight; rank 1 takes part in rank
    0's evaluation passes."""
    common = {"rewards": "[{fn: rewards_for_tests.flat_for_zero}]", "data.shuffle": "false", "lora.top_layers": 1,
              "algo.num_iterations": 2, "train.gradient_checkpointing": "true", "train.checkpoint_every": 1,
              "train.micro_batch_size": 2, "train.lr": 0.05, "train.threads": 1,
              "rollout.merge_adapter": "true"}  # every run's sampler merges (auto would not merge the streamed one)
    plain, sharded, layered = tmp_path / "plain", tmp_path / "sharded", tmp_path / "layered"
    # a sharded base samples from merged copies; the whole one too (its default, oneDNN packs, rounds differently)
    common["rollout.weight_packs"] = "false"
    streamed = {"train.fsdp": "true", "train.fsdp_gather": "layer"}
    for out, steps, extra in ((plain, 3, {}), (layered, 3, streamed), (sharded, 2, {"train.fsdp": "true"}),
                              (sharded, 3, {"train.fsdp": "true", "train.resume": "auto"})):
        args = tiny_overrides(tiny_model_dir, prompts_file, str(out), **common, **extra, **{"train.steps": steps})
        done = _run(2, args)
        assert done.returncode == 0, done.stderr[-3000:]
        sharded_note = "train.fsdp: 2 decoder layers sharded over 2 ranks" in done.stderr
        assert sharded_note == (out != plain), done.stderr[-3000:]
        assert ("train.fsdp_gather=layer" in done.stderr) == (out == layered)
    assert "resuming from" in done.stderr
    one, two, three = (load_file(str(out / "adapter" / "adapter_model.safetensors")) for out in (plain, sharded, layered))
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
    assert max(float((one[k] - three[k]).abs().max()) for k in one) <= 1e-5
    assert any(float(v.abs().max()) > 0 for k, v in two.items() if "lora_B" in k)  # the adapter did move
    samples = {out: [(json.loads(s)["prompt"], json.loads(s)["completion"])
                     for s in (out / "samples.jsonl").read_text().splitlines()] for out in (plain, sharded, layered)}
    assert samples[plain] == samples[sharded] == samples[layered] and len(samples[sharded]) == 3 * 2 * 4
    rows = [json.loads(line) for line in (sharded / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["trained_frac"] == 0.5
    assert all(r["adapter_rank_divergence"] == 0.0 for r in rows)
    evals = {out: json.loads((out / "eval.json").read_text()) for out in (plain, sharded, layered)}
    assert evals[plain] == evals[sharded] == evals[layered]


def _whole_and_sharded(model_dir, prompts_file, tmp_path, common: dict, gather: str) -> dict:
    """The same 2-rank run with the base whole on each rank and sharded (train.fsdp_gather=gather) -> {label: folder};
    both drew the same completions."""
    outs = {}
    # the same sampler arithmetic on both sides: what `auto` picks for the sharded base (unmerged where it streams)
    merge = {"rollout.merge_adapter": "false" if gather == "layer" else "true"}
    for label, extra in (("whole", {}), ("sharded", {"train.fsdp": "true", "train.fsdp_gather": gather})):
        outs[label] = tmp_path / label
        done = _run(2, tiny_overrides(model_dir, prompts_file, str(outs[label]), **{**merge, **common}, **extra))
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("decoder layers sharded" in done.stderr) == (label == "sharded")
    samples = {label: (out / "samples.jsonl").read_text() for label, out in outs.items()}
    assert samples["whole"] == samples["sharded"]
    return outs


@pytest.mark.slow  # 30 s on a 2-core CPU: the default suite keeps several policies with dynamic sampling (below)
def test_several_policies_on_a_sharded_base_train_as_on_a_whole_one(tiny_model_dir, prompts_file, tmp_path):
    """3 policies on 2 ranks, the base streamed layer by layer through the batched multi-policy sampler, against
    the same run with the base whole on each rank. Prompt 0's groups are flat (flat_for_zero) and only policy c
    has a KL term: rank 0 (prompt 0 of every policy: a0 b0 c0) trains c0's 4 rows, rank 1 (a1 b1 c1) 12, so
    rank 0 pads its update with zero passes through policy a (its row 0). That a zero pass leaves a policy without
    a gradient without one is tested directly in test_policies.py.
    Same completions, every policy's adapter within 1e-6, the same held-out results."""
    from rlora.train.policies import POLICIES_FOLDER

    common = {"rewards": "[{fn: rewards_for_tests.flat_for_zero}]", "data.shuffle": "false", "train.lr": 0.05,
              "train.micro_batch_size": 2, "train.threads": 1, "algo.beta": 0.0, "eval.before": "false",
              "rollout.sampler_dtype": "model", "algo.sampler_is_cap": "null",
              "rollout.weight_packs": "false",  # the sharded base's merged copies for the whole one too
              "policies": "[{name: a, seed: 1}, {name: b, lr: 0.01, seed: 2}, {name: c, seed: 3, beta: 0.04}]"}
    outs = _whole_and_sharded(tiny_model_dir, prompts_file, tmp_path, common, "layer")
    rows = [json.loads(line) for line in (outs["sharded"] / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["a/trained_frac"] == 0.5 and rows[0]["c/trained_frac"] == 1.0  # a's flat group is skipped
    for name in ("a", "b", "c"):
        one, two = (load_file(str(out / POLICIES_FOLDER / name / "adapter" / "adapter_model.safetensors"))
                    for out in outs.values())
        assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-6, name
        evals = [json.loads((out / POLICIES_FOLDER / name / "eval.json").read_text()) for out in outs.values()]
        assert evals[0] == evals[1]


@pytest.mark.slow  # ~30 s on a 2-core CPU; the default suite tests the experts' LoRA (test_expert_lora.py) unsharded
def test_a_mixture_of_experts_on_a_sharded_base_trains_as_on_a_whole_one(prompts_file, tmp_path):
    """A tiny Qwen3-MoE (a dense layer 0, a sparse layer 1) with peft's all-linear LoRA on its fused experts and
    router (computed on the activations, models/expert_lora.py), its decoder layers sharded over 2 ranks against the
    same run with the base whole on each rank: the same completions, the adapter within 1e-4 (the experts' LoRA did
    move), the same held-out results."""
    folder = build_random_model(tmp_path / "qwen3_moe", family="qwen3_moe", tie=False, seed=0)
    common = {"data.shuffle": "false", "train.lr": 0.05, "train.micro_batch_size": 2, "train.threads": 1,
              "algo.beta": 0.04, "eval.before": "false", "rollout.sampler_dtype": "model",
              "algo.sampler_is_cap": "null", "rollout.weight_packs": "false"}
    outs = _whole_and_sharded(str(folder), prompts_file, tmp_path, common, "model")
    one, two = (load_file(str(out / "adapter" / "adapter_model.safetensors")) for out in outs.values())
    # entries ~0.1 (two Adam steps of 0.05); the experts' factors differ by up to 3.3e-5 here, and by 5.0e-5 on peft's
    # own weight-side path (measured 2026-11-30; attention-only LoRA on this model agrees to 1e-6): the rounding of
    # the sharded layers' products, amplified where Adam divides small expert gradients by their own size
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-4
    assert any("experts" in k and "lora_B" in k and float(v.abs().max()) > 0 for k, v in two.items())
    evals = [json.loads((out / "eval.json").read_text()) for out in outs.values()]
    assert evals[0] == evals[1]


@pytest.mark.slow  # ~30 s on a 2-core CPU: the default suite has PPO on a sharded base (below) and PPO's policies alone
def test_ppo_with_several_policies_on_a_sharded_base_trains_as_on_a_whole_one(tiny_model_dir, prompts_file, tmp_path):
    """PPO with 2 policies on 2 ranks, the base streamed: each policy's critic passes (values, value gradient) go
    through the sharded layers with its value adapter, every rank holding as many rows of each policy. Against the
    same run with the base whole on each rank: every policy's adapter and critic within 1e-6."""
    from rlora.train.policies import POLICIES_FOLDER

    common = {"algo.name": "ppo", "ppo.value_head_init_std": 0.1, "data.shuffle": "false", "train.lr": 0.05,
              "train.micro_batch_size": 2, "train.threads": 1, "algo.beta": 0.04, "eval.before": "false",
              "rollout.sampler_dtype": "model", "algo.sampler_is_cap": "null", "rollout.weight_packs": "false",
              "policies": "[{name: a, seed: 1}, {name: b, lr: 0.01, seed: 2}]"}
    outs = _whole_and_sharded(tiny_model_dir, prompts_file, tmp_path, common, "layer")
    for name in ("a", "b"):
        for folder, file in [("adapter", "adapter_model.safetensors"), ("value_model", "adapter_model.safetensors"),
                             ("value_model", "value_head.safetensors")]:
            one, two = (load_file(str(out / POLICIES_FOLDER / name / folder / file)) for out in outs.values())
            assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-6, (name, folder, file)


# ~30 s each on a 2-core CPU: streaming (a collective per pass over the layers) by default, whole-base gathering slow
@pytest.mark.parametrize("gather", ["layer", pytest.param("model", marks=pytest.mark.slow)])
def test_episodes_on_a_sharded_base_train_as_on_a_whole_one(gather, tiny_model_dir, prompts_file, tmp_path):
    """Episodes of up to 1-3 turns by prompt (envs_for_tests.turns_by_number): with data.shuffle=false rank 0 plays
    prompt 0 (1 turn) and rank 1 prompt 1 (up to 2) in step 1, then prompts 2 (up to 3) and 3 (1), so the ranks call
    the sampler a different number of times, and rank 0 evaluates alone. On a sharded base the same
    episodes, adapters within 1e-6 and evaluations as with the base whole on each rank."""
    # replies end at a space (a stop string) rather than at the token limit, which would truncate the episode
    common = {"env": "{fn: envs_for_tests.turns_by_number, args: {most: 3}}", "rollout.stop": "[' ']",
              "data.shuffle": "false", "train.lr": 0.05, "train.micro_batch_size": 2, "train.threads": 1,
              "eval.before": "false", "rollout.sampler_dtype": "model", "algo.sampler_is_cap": "null",
              "rollout.weight_packs": "false"}  # the sharded base's merged copies for the whole one too
    outs = _whole_and_sharded(tiny_model_dir, prompts_file, tmp_path, common, gather)
    turns = {label: [json.loads(line)["episode/turns_mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]
             for label, out in outs.items()}
    # step 1: rank 0's 4 episodes take 1 turn; above 1 on average, some of rank 1's took 2 (a reply may end at the
    # token limit instead, which ends its episode): rank 1 called the sampler twice, rank 0 once
    assert turns["sharded"] == turns["whole"] and turns["sharded"][0] > 1
    one, two = (load_file(str(out / "adapter" / "adapter_model.safetensors")) for out in outs.values())
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-6
    assert any(float(v.abs().max()) > 0 for k, v in two.items() if "lora_B" in k)  # the adapter did move
    evals = [json.loads((out / "eval.json").read_text()) for out in outs.values()]
    assert evals[0] == evals[1]


# ~33 s on a 2-core CPU: the default suite keeps the step's sampling scope with ranks that sample unequally in the
# episodes test above and the policies' dynamic sampling below (the same scope, session.step_sampling_scope)
@pytest.mark.slow
def test_adaptive_resampling_on_a_sharded_base_trains_as_on_a_whole_one(tiny_model_dir, prompts_file, tmp_path):
    """adaptive_grpo resamples groups whose rewards are all equal: rank 0's prompt 0 (flat_for_zero) in step 1, twice
    (algo.adaptive.max_retries), while rank 1 samples once, so the ranks call the sampler a different number of
    times (one sampling scope around the step's sampling pairs their passes over the streamed layers). The same
    completions and adapter (within 1e-6) as with the base whole on each rank."""
    common = {"algo.name": "adaptive_grpo", "algo.adaptive.condition": "zero_variance",
              "rewards": "[{fn: rewards_for_tests.flat_for_zero}]", "data.shuffle": "false", "train.lr": 0.05,
              "train.micro_batch_size": 2, "train.threads": 1, "eval.before": "false", "eval.after": "false",
              "rollout.sampler_dtype": "model", "algo.sampler_is_cap": "null",
              "rollout.weight_packs": "false"}  # the sharded base's merged copies for the whole one too
    outs = _whole_and_sharded(tiny_model_dir, prompts_file, tmp_path, common, "layer")
    rows = [json.loads(line) for line in (outs["sharded"] / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["resamples"] == 2  # rank 0's flat group, both retries (merged over the ranks)
    one, two = (load_file(str(out / "adapter" / "adapter_model.safetensors")) for out in outs.values())
    # the sharded layers' products round differently (4.7e-6 here after 2 steps at lr 0.05): as the plain test's 1e-5
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
    assert any(float(v.abs().max()) > 0 for k, v in two.items() if "lora_B" in k)  # the adapter did move


# prompts 0, 1, 4, 6 and 7 flat; 4 prompts a step, one extra round: see the test below
UNEVEN_RANKS = {"algo.dynamic_sampling": "true", "algo.max_extra_rounds": 1, "rewards": "[{fn: "
                "rewards_for_tests.flat_for_answers, args: {flat: ['0', '2', '8', '12', '14']}}]", "data.shuffle": "false",
                "data.seed": 0, "train.prompts_per_step": 4, "train.steps": 3, "train.micro_batch_size": 2}


@pytest.mark.slow  # 30 s on a 2-core CPU: the default suite runs the same ranks with two policies (below)
def test_dynamic_sampling_and_replay_on_a_sharded_base_train_as_on_a_whole_one(tiny_model_dir, prompts_file, tmp_path):
    """Ranks with different numbers of rows, and a rank with none, pair their passes through the sharded layers.
    Prompts 0, 1, 4, 6 and 7 give flat groups; 4 prompts a step, one extra round (its prompts drawn as
    step_batch.ExtraPrompts draws them with data seed 0: [6, 4, 5, 7] in step 1, [1, 2, 0, 3] in step 2, [7, 6, 5, 4] in
    step 3, half to each rank). Steps 1 and 3: rank 0 drops its prompts 0 and 1, draws 6 and 4 (or 7 and 6), drops
    them too and keeps nothing, while rank 1 keeps 2 and 3 from its one draw. Step 2: rank 0 keeps 5 and 2 (8 rows),
    rank 1 only 3, and replays 2 of the groups it stored in step 1 (algo.replay.ratio=2: 4 + 8 rows), while rank
    0's buffer is empty: so rank 0 pads each phase of its 8 rows with 2 passes. Every phase runs: the frozen layer 0
    (lora.top_layers=1), the reference (beta), the old log-probs (2 iterations). The same completions, metrics and
    adapter (within 1e-5) as with the base whole on each rank."""
    common = {**UNEVEN_RANKS, "algo.replay.enabled": "true", "algo.replay.ratio": 2.0, "lora.top_layers": 1,
              "algo.beta": 0.04, "algo.num_iterations": 2, "train.lr": 0.05, "train.threads": 1, "eval.before": "false",
              "eval.after": "false", "rollout.sampler_dtype": "model", "algo.sampler_is_cap": "null",
              "rollout.weight_packs": "false"}  # the sharded base's merged copies for the whole one too
    outs = _whole_and_sharded(tiny_model_dir, prompts_file, tmp_path, common, "layer")
    rows = {label: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            for label, out in outs.items()}
    # groups kept over both ranks, and dropped: rank 0's 4 draws in steps 1 and 3; 3 + 2 in step 2
    assert [r["groups"] for r in rows["sharded"]] == [2, 3, 2]
    assert [r["groups_dropped"] for r in rows["sharded"]] == [4, 5, 4]
    assert rows["sharded"][1]["replay_groups"] == 2  # rank 1's: rank 0 stored nothing in step 1
    for whole, sharded in zip(rows["whole"], rows["sharded"]):
        for key in ("groups", "rows", "replay_groups", "reward_mean", "trained_frac"):
            assert whole[key] == sharded[key], key
        assert sharded["loss"] == pytest.approx(whole["loss"], abs=1e-5)
    one, two = (load_file(str(out / "adapter" / "adapter_model.safetensors")) for out in outs.values())
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
    assert any(float(v.abs().max()) > 0 for k, v in two.items() if "lora_B" in k)  # the adapter did move


def test_several_policies_with_dynamic_sampling_on_a_sharded_base_train_as_on_a_whole_one(tiny_model_dir,
                                                                                          prompts_file, tmp_path):
    """UNEVEN_RANKS with two policies (the flat prompts are flat for both) and replay, as the one-policy test above:
    in steps 1 and 3 rank 0 keeps no group of either policy and pads every phase with a dropped row through the
    first policy, while rank 1 trains both; in step 2 rank 0 holds 8 rows of each policy, rank 1 4 fresh and 8
    replayed (each policy's own buffer), so rank 0 pads each phase, the update's zero passes through its rows'
    policies. The same completions, each policy's metrics, adapter (within 1e-5) and held-out results (evaluated
    on the gathered base) as with the base whole on each rank."""
    from rlora.train.policies import POLICIES_FOLDER

    common = {**UNEVEN_RANKS, "lora.top_layers": 1, "algo.beta": 0.04, "algo.num_iterations": 2, "train.lr": 0.05,
              "train.threads": 1, "eval.before": "false", "rollout.sampler_dtype": "model",
              "algo.sampler_is_cap": "null", "rollout.weight_packs": "false",
              "policies": "[{name: a, seed: 1}, {name: b, lr: 0.01, seed: 2, beta: 0.0}]",
              "algo.replay.enabled": "true", "algo.replay.ratio": 2.0}
    outs = _whole_and_sharded(tiny_model_dir, prompts_file, tmp_path, common, "layer")
    for name in ("a", "b"):
        rows = {label: [json.loads(line) for line in (out / POLICIES_FOLDER / name / "metrics.jsonl").read_text()
                        .splitlines()] for label, out in outs.items()}
        assert [r["groups"] for r in rows["sharded"]] == [2, 3, 2], name  # over both ranks
        assert [r["groups_dropped"] for r in rows["sharded"]] == [4, 5, 4], name
        assert rows["sharded"][1]["replay_groups"] == 2, name  # rank 1's: rank 0 stored nothing in step 1
        for whole, sharded in zip(rows["whole"], rows["sharded"]):
            for key in ("groups", "rows", "groups_dropped", "sampling_rounds", "reward_mean", "trained_frac",
                        "replay_groups"):
                assert whole[key] == sharded[key], (name, key)
            assert sharded["loss"] == pytest.approx(whole["loss"], abs=1e-5)
        one, two = (load_file(str(out / POLICIES_FOLDER / name / "adapter" / "adapter_model.safetensors"))
                    for out in outs.values())
        assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5, name
        assert any(float(v.abs().max()) > 0 for k, v in two.items() if "lora_B" in k)  # the adapter did move
        evals = [json.loads((out / POLICIES_FOLDER / name / "eval.json").read_text()) for out in outs.values()]
        assert evals[0] == evals[1]


# ~30 s each on a 2-core CPU: the token router (a routing pass of forwards) by default, the sequence router slow
@pytest.mark.parametrize("router", ["token", pytest.param("sequence", marks=pytest.mark.slow)])
def test_a_molora_policy_on_a_sharded_base_trains_as_on_a_whole_one(router, tiny_model_dir, prompts_file, tmp_path):
    """A MoLoRA policy over the uneven ranks of the dynamic-sampling test above (rank 0 keeps no group in steps 1
    and 3, rank 1 fewer rows than rank 0 in step 2): a token router's routing pass forwards each rank's
    micro-batches before the update, and a rank with fewer adds forwards of its row 0 (or of a dropped row). The same
    completions, mixture (experts and routers, within 1e-5) and router metrics as with the base whole on each
    rank; evaluations on rank 0 too."""
    from test_molora_grpo import MOLORA

    common = {**UNEVEN_RANKS, "lora.rank": 16, "molora": json.dumps({**MOLORA, "router": router}),
              "algo.beta": 0.04, "train.lr": 0.05, "train.threads": 1, "eval.before": "false",
              "rollout.sampler_dtype": "model", "algo.sampler_is_cap": "null", "rollout.weight_packs": "false"}
    outs = _whole_and_sharded(tiny_model_dir, prompts_file, tmp_path, common, "layer")
    rows = {label: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            for label, out in outs.items()}
    assert [r["groups"] for r in rows["sharded"]] == [2, 3, 2]
    for whole, sharded in zip(rows["whole"], rows["sharded"], strict=True):
        for key in ("loss", "aux_loss", "molora/balance", "molora/util_0"):
            assert sharded[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    one, two = (load_file(str(out / "adapter" / "molora_model.safetensors")) for out in outs.values())
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
    assert any("router" in k for k in two)
    evals = [json.loads((out / "eval.json").read_text()) for out in outs.values()]
    assert evals[0] == evals[1]


@pytest.mark.slow  # ~35 s on a 2-core CPU; the default suite has PPO with a MoLoRA policy in one process (test_molora_roles)
def test_ppo_with_a_molora_policy_on_a_sharded_base_trains_as_on_a_whole_one(rm_folder, tiny_model_dir, prompts_file,
                                                                              tmp_path):
    """PPO beside a MoLoRA policy (token router) with a reward model among the rewards: the value and reward adapters
    on the mixture's base maps stay whole beside the sharded layers. Rank 0's prompts fail a reward, so it trains
    neither the policy nor the critic and pads both updates (and the routing pass) with zero passes. The same
    completions, reward-model scores, mixture, value adapter and head as with the base whole on each rank."""
    from test_molora_grpo import MOLORA

    rewards = (f"[{{fn: rewards_for_tests.fails_on_even_prompts}}, {{fn: reward_model, args: {{path: {rm_folder}}}}}, "
               "{fn: rewards_for_tests.char_count}]")
    common = {"algo.name": "ppo", "rewards": rewards, "train.max_reward_failure_frac": 1.0, "data.shuffle": "false",
              "lora.rank": 16, "molora": json.dumps({**MOLORA, "router": "token"}), "ppo.value_head_init_std": 0.1,
              "algo.beta": 0.04, "train.lr": 0.05, "train.micro_batch_size": 2, "train.threads": 1,
              "eval.before": "false", "rollout.sampler_dtype": "model", "algo.sampler_is_cap": "null",
              "rollout.weight_packs": "false"}
    outs = _whole_and_sharded(tiny_model_dir, prompts_file, tmp_path, common, "layer")
    rows = [json.loads(line) for line in (outs["sharded"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_failures"] for r in rows] == [4, 4]  # prompts 0 and 2: rank 0's
    samples = [json.loads(line) for line in (outs["sharded"] / "samples.jsonl").read_text().splitlines()]
    assert len({s["reward/reward_model"] for s in samples}) > 1  # the reward model's scores, equal in both runs
    for folder, name in (("adapter", "molora_model.safetensors"), ("value_model", "adapter_model.safetensors"),
                         ("value_model", "value_head.safetensors")):
        one, two = (load_file(str(out / folder / name)) for out in outs.values())
        assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5, (folder, name)
        assert any(float(v.abs().max()) > 0 for k, v in two.items() if "_A" not in k), (folder, name)


# ~22 s each on a 2-core CPU: streaming (the reward adapter's forwards paired with the other ranks' passes) by default,
# whole-base gathering slow
@pytest.mark.parametrize("gather", [pytest.param("model", marks=pytest.mark.slow), "layer"])
def test_ppo_with_a_reward_adapter_on_a_sharded_base_trains_as_on_a_whole_one(rm_folder, tiny_model_dir, prompts_file,
                                                                              tmp_path, gather):
    """PPO with a reward model of `rlora rm` among its rewards. Every adapter stays whole beside the sharded layers:
    the value adapter (frozen outside the critic's passes) and the reward adapter (frozen). The reward adapter scores
    through the layers' forward inside the step's sampling scope, each rank its own completions, rank 0 its
    evaluations alone: with train.fsdp_gather=model the base is gathered there and the forward makes no collective;
    with layer each forward votes and gathers its layers like a streamed pass, pairing with the other ranks' passes
    (without that vote the run hangs). Rank 0's prompts fail
    a reward (fails_on_even_prompts: prompts 0 and 2), so it has no row to train either the policy or the critic on
    while rank 1 trains 4: both updates pad with zero passes. Also on: the frozen layer 0 (lora.top_layers=1,
    shared by the reference, values and policy passes), the reference (beta), 2 iterations. The same completions
    and reward-model scores, evaluations, policy adapter, value adapter and head as with the base whole on each
    rank."""
    rewards = (f"[{{fn: rewards_for_tests.fails_on_even_prompts}}, {{fn: reward_model, args: {{path: {rm_folder}}}}}, "
               "{fn: rewards_for_tests.char_count}]")
    common = {"algo.name": "ppo", "rewards": rewards, "train.max_reward_failure_frac": 1.0, "data.shuffle": "false",
              "lora.top_layers": 1, "algo.beta": 0.04, "algo.num_iterations": 2, "train.lr": 0.05,
              "train.micro_batch_size": 2, "train.threads": 1, "rollout.sampler_dtype": "model",
              "algo.sampler_is_cap": "null", "rollout.weight_packs": "false"}
    outs = _whole_and_sharded(tiny_model_dir, prompts_file, tmp_path, common, gather)
    rows = [json.loads(line) for line in (outs["sharded"] / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["reward_failures"] == 4 and rows[1]["reward_failures"] == 4  # prompts 0 and 2: rank 0's
    samples = [json.loads(line) for line in (outs["sharded"] / "samples.jsonl").read_text().splitlines()]
    assert len({s["reward/reward_model"] for s in samples}) > 1  # the reward model's scores, equal in both runs
    evals = [json.loads((out / "eval.json").read_text()) for out in outs.values()]
    assert evals[0] == evals[1]  # rank 0's evaluations, the reward model's scores in their reward_mean
    for folder, name in (("adapter", "adapter_model.safetensors"), ("value_model", "adapter_model.safetensors"),
                         ("value_model", "value_head.safetensors")):
        one, two = (load_file(str(out / folder / name)) for out in outs.values())
        # the sharded layers' products round differently, and Adam's per-element normalisation moves an element whose
        # gradient is near 0 by more than its gradient's error (1.4e-5 seen on one lora_A entry of size 0.16 after 2
        # steps at lr 0.05 with a reward adapter, grad norms 2e-7 apart, relative; 1e-6 and less elsewhere)
        assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 5e-5, (folder, name)
        assert any(float(v.abs().max()) > 0 for k, v in two.items() if "lora_A" not in k), (folder, name)


@pytest.fixture(scope="module")
def softcapped_gemma(tmp_path_factory):
    """A Gemma 3 with attention logit soft-capping: the built-in sampler does not run it (transformers generate does)."""
    return build_random_model(tmp_path_factory.mktemp("gemma") / "gemma", family="gemma3_text", seed=4,
                              attn_logit_softcapping=50.0)


def test_layer_streaming_needs_the_builtin_sampler(softcapped_gemma):
    """The run's samplers over a sharded base (train/fsdp.py sharded_samplers, what `rlora train` calls after loading):
    with gather=layer a model sampled by transformers generate, whose FSDP all-gathers the ranks could not pair up,
    is one line; gather=model wraps it."""
    from rlora.models.loading import load_base_model, load_tokenizer
    from rlora.rollout.backends import build_generator
    from rlora.train.fsdp import sharded_samplers

    layered = load_config(None, [f"model.path={softcapped_gemma}", "train.fsdp=true", "train.fsdp_gather=layer"])
    tokenizer, tok = load_tokenizer(str(softcapped_gemma))
    model = load_base_model(layered.model, str(softcapped_gemma))
    generator = build_generator(layered.rollout, model, tokenizer, tok.eos_ids, tok.pad_id, 64, 4)
    assert generator.name == "hf"
    with pytest.raises(UserError, match="train.fsdp_gather=layer streams the layers through rlora's built-in sampler, "
                                        "which does not support this model .*: set train.fsdp_gather=model"):
        sharded_samplers(generator, generator, None, layered)
    whole = load_config(None, [f"model.path={softcapped_gemma}", "train.fsdp=true", "train.fsdp_gather=model"])
    assert [s.name for s in sharded_samplers(generator, generator, None, whole)] == ["hf", "hf"]


@pytest.mark.slow  # 14 s of torchrun; sharded_samplers' refusal itself is tested above in the default suite
def test_layer_streaming_for_a_model_the_builtin_sampler_cannot_run_is_refused(softcapped_gemma, tmp_path, prompts_file):
    """The same refusal in a run: one line on the ranks, exit code 2, nothing written (gather=model runs it)."""
    args = tiny_overrides(str(softcapped_gemma), prompts_file, str(tmp_path / "o"), **{"train.fsdp": "true",
                                                                          "train.fsdp_gather": "layer", "train.steps": 1})
    done = _run(2, args)
    assert done.returncode != 0
    assert "train.fsdp_gather=layer streams the layers through rlora's built-in sampler" in done.stderr
    assert "rlora: error: train.fsdp_gather=layer" in done.stderr and "set train.fsdp_gather=model" in done.stderr
    assert "exitcode  : 2" in done.stderr  # the ranks' own exit code (torchrun then reports the failed job)
    assert not (tmp_path / "o").exists()


def test_fsdp_in_one_process_is_one_line(tiny_model_dir, prompts_file, tmp_path, capsys):
    code = main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"), **{"train.fsdp": "true"})])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "rlora: error: train.fsdp shards the base across" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("override, message", [
    ("model.quantization=4bit", "does not shard a quantized base"),
])
def test_unsupported_combinations_are_refused(override, message):
    with pytest.raises(UserError, match=message):  # refused when the ranks start, before the model loads
        check_launch(load_config(None, ["train.fsdp=true", override]), 2)
    check_launch(load_config(None, ["train.fsdp=true"]), 2)  # the switch alone is fine under torchrun


@pytest.fixture(scope="module")
def four_layer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("four")
    return {"llama": str(build_random_model(root / "llama", layers=4, seed=2)),
            # windows of 4 tokens, shorter than the rows: each streamed layer's view must carry its window
            "mistral-window": str(build_random_model(root / "mistral", family="mistral", layers=4, seed=2,
                                                     sliding_window=4))}


# ~13 s each on a 2-core CPU; gather=model's sampling is also compared with the whole base's in the default suite by
# test_ppo_with_a_reward_adapter_on_a_sharded_base_trains_as_on_a_whole_one (same completions), so its case here is slow
@pytest.mark.parametrize("model, gather", [pytest.param("llama", "model", marks=pytest.mark.slow), ("llama", "layer"),
                                           ("mistral-window", "layer")])
def test_sampling_from_the_sharded_base_equals_the_unsharded_policy(four_layer_dirs, tmp_path, model, gather):
    """Ranks with different work: rank 0 samples 3 prompts in 2 chunks with rows ending at ragged steps, rank 1 one
    short prompt; then rank 0 alone samples twice (evaluation). Every rank gets exactly what the unsharded policy
    samples. gather=layer has one of the 4 layers gathered at any use of a layer (plus the next one's all-gather in
    flight), and none afterwards; gather=model holds all 4 while sampling (the probe sees the difference)."""
    four_layer_dir = four_layer_dirs[model]
    env = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    done = run_process_group([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              str(Path(TESTS) / "fsdp_stream_worker.py"), four_layer_dir, gather, str(tmp_path)], env,
                             timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [len(r["same"]) for r in ranks] == [3, 1]
    for rank in ranks:
        for call in rank["same"]:
            assert call["tokens"] and call["mask"] and call["reasons"] and call["logp_diff"] == 0.0, call
        assert rank["gathered_after"] == 0 and rank["layers"] == 4
        # layer: the layer in use is the only one swapped in (the next one's all-gather is in flight meanwhile)
        assert rank["max_gathered"] == (1 if gather == "layer" else 4), rank
        # merged copies alive while a layer's are built: the output layer's and that layer's 4 (q/k/v, o, gate/up,
        # down), the previous layer's released; gather=model builds every layer's up front
        assert rank["max_fused_alive"] == (1 + 4 if gather == "layer" else 1 + 4 * 4), rank
    lengths = ranks[0]["same"][0]["lengths"]
    assert len(set(lengths)) > 1, lengths  # ragged: the ranks' decode steps differ within a call, not only across
    if gather == "layer":  # every pass is paired: rank 1 made rank 0's passes, most of them empty (no layer used)
        assert ranks[0]["passes"] == ranks[1]["passes"] == ranks[0]["uses"] // 4 > ranks[1]["uses"] // 4 > 0


def test_gather_mode_without_fsdp_is_refused(tiny_model_dir, prompts_file, tmp_path, capsys):
    with pytest.raises(UserError, match="train.fsdp_gather=layer applies to a sharded base: set train.fsdp=true"):
        load_config(None, ["train.fsdp_gather=layer"])
    with pytest.raises(UserError, match="invalid value for train.fsdp_gather: Input should be 'model' or 'layer'"):
        load_config(None, ["train.fsdp_gather=layers"])
    out = tmp_path / "o"
    code = main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(out), **{"train.fsdp_gather": "layer"})])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "train.fsdp_gather=layer applies to a sharded base" in err, err
    assert not out.exists()
