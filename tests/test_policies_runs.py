"""Several policies trained in one run (`policies:`, train/policies.py), end to end: a `policies:` run against
separate runs, bad input, resume (exactly, and across a new policy key), 2 ranks against one, and a reward adapter
beside several policies. The model-level checks (batched forward, sampler, update) are in tests/test_policies.py."""

import json

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file

from conftest import tiny_overrides
from test_policies import base_model
from test_reward_adapter import rm_folder  # noqa: F401 - the reward model fixture
from rlora.cli import main
from rlora.config import LoraConfig, ModelConfig
from rlora.errors import UserError
from rlora.models import multi_lora as mlr
from rlora.models.loading import load_base_model, load_tokenizer, peft_lora_config
from rlora.models.tiny import build_random_model

def _policies_arg(specs):
    return "policies=[" + ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in s.items()) + "}" for s in specs) + "]"


# episodes of two turns (each continued from its cache, the policies' rows in one batch): a second full run, slow
EPISODES = {"env": "{fn: envs_for_tests.scripted, args: {turns: 2}}", "rollout.stop": "[' ']"}
# adaptive resampling of the groups whose rewards are all equal: prompt 0's always are (flat_for_zero). Step 1: each
# policy's group of prompt 0 is resampled in the same retry (one batched sampler call; the per-slot seeds and keys
# make its samples what a call of its own would draw); the second retry is over each policy's own budget of one
# resample a step (a budget shared by the policies would let only one of them resample: tested to fail)
ADAPTIVE = {"algo.name": "adaptive_grpo", "algo.adaptive.condition": "zero_variance", "algo.adaptive.max_retries": 2,
            "algo.adaptive.step_budget": 1, "rewards": "[{fn: rewards_for_tests.flat_for_zero}]", "data.shuffle": "false"}

# dynamic sampling with a binary reward: whether a group is flat depends on its samples, so the policies (their own
# seeds) drop different groups: here they draw different numbers of extra rounds, each as its run alone does
DYNAMIC = {"algo.dynamic_sampling": "true", "algo.max_extra_rounds": 2,
           "rewards": "[{fn: rewards_for_tests.chance_binary, args: {share: 0.3}}]"}
# ... and without extra rounds, one policy keeps no group in step 1 while the other trains: it skips its update
DYNAMIC_EMPTY = {"algo.dynamic_sampling": "true", "algo.max_extra_rounds": 0,
                 "rewards": "[{fn: rewards_for_tests.chance_binary, args: {share: 0.1}}]"}


# batch-wide statistics: each policy's advantages whitened over its own rows; REINFORCE++ also puts each policy's own
# KL coefficient (0 and 0.1) into its rewards
BATCH_STATS = {"algo.adv_scale": "batch"}
REINFORCE_PP = {"algo.name": "reinforce_pp"}
# experience replay: each policy stores its own groups and replays them in later steps (its own buffer; 0.75 x 2 groups
# rounded at random with its own seed: the policies replay different numbers), its replayed rows weighted against
# its own sampler log-probs
REPLAY = {"algo.replay.enabled": "true", "algo.replay.ratio": 0.75, "train.steps": 3}
# transformers generate: each policy's prompts in one call through its adapter, with its seed (the call its run alone
# makes), and adaptive retries likewise
HF_ENGINE = {"rollout.engine": "hf", "rollout.merge_adapter": "true", **ADAPTIVE}
# PPO: each policy's own critic (made from its seed: a random value head here), values, GAE advantages whitened over
# its own rows with its own KL coefficient in the reward, value loss and optimizer step
PPO = {"algo.name": "ppo", "ppo.value_head_init_std": 0.1}


@pytest.mark.parametrize("extra", [{}, pytest.param(EPISODES, marks=pytest.mark.slow), ADAPTIVE, DYNAMIC, DYNAMIC_EMPTY,
                                   BATCH_STATS, REINFORCE_PP, REPLAY, HF_ENGINE, PPO,
                                   pytest.param({**EPISODES, "rollout.engine": "hf", "rollout.merge_adapter": "true"},
                                                marks=pytest.mark.slow)],
                         ids=["completions", "episodes", "adaptive", "dynamic", "dynamic-empty", "batch-stats",
                              "reinforce-pp", "replay", "hf-engine", "ppo", "hf-episodes"])
def test_a_policies_run_equals_separate_runs(tiny_model_dir, prompts_file, tmp_path, capsys, extra):
    """`policies:` with two learning rates, seeds and KL coefficients (0 and 0.1, algo.beta 0.04), both starting
    from one adapter, against two plain runs: the same completions, metrics (kl only where beta > 0; the sampling
    statistics, adaptive resampling's included) and (up to float32 summation order) the same adapters."""
    assert_policies_run_equals_separate_runs(tiny_model_dir, prompts_file, tmp_path, capsys, extra)


@pytest.mark.parametrize("family,extra", [("qwen3_moe", {}), ("qwen2_moe", {}), ("qwen3_moe", PPO)],
                         ids=["qwen3_moe", "qwen2_moe", "qwen3_moe-ppo"])
def test_a_policies_run_on_a_mixture_of_experts_equals_separate_runs(family, extra, prompts_file, tmp_path, capsys):
    """The same on a tiny mixture of experts with peft's all-linear LoRA: Qwen3-MoE's fused experts and router (each
    token through its row's policy, models/block_routing.py) beside a dense layer, Qwen2-MoE's shared expert (its
    linear maps fed the block's tokens). One step: its two iterations' gradients agree to float32 rounding (grad
    norms 4e-7 apart, relative), but in a second step the router's top-k over parameters that rounding moved can
    send a token to another expert (seen: Qwen3-MoE's grad norms 5e-4 apart and 2589 adapter entries moved by up
    to 1.5e-4 at lr 1e-2), a jump no tolerance of float32 rounding covers. With PPO each policy's critic (a value
    adapter on the same experts, computed on the activations as in a run alone) too."""
    folder = str(build_random_model(tmp_path / family, family=family, tie=False, seed=0))
    assert_policies_run_equals_separate_runs(folder, prompts_file, tmp_path, capsys, {**extra, "train.steps": 1})


def assert_policies_run_equals_separate_runs(tiny_model_dir, prompts_file, tmp_path, capsys, extra):
    start = tmp_path / "start"
    base = base_model(tiny_model_dir, torch.float32)
    init = get_peft_model(base, peft_lora_config(LoraConfig(rank=4), base))
    with torch.no_grad():
        for name, p in init.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    init.save_pretrained(str(start))
    # float32 sampling on both sides (the demo config samples in bf16, where the batched and the plain adapter
    # arithmetic round differently enough to flip a token)
    common = {**{"lora.init_from": str(start), "algo.beta": 0.04, "algo.num_iterations": 2,
                     "rollout.sampler_dtype": "model", "algo.sampler_is_cap": "null", "rollout.merge_adapter": "false",
                     "train.micro_batch_size": 3, "rollout.num_generations": 3,
                     # a policies run cannot pack a prompt's rows (each row has its own adapter); a plain run packed
                     # rounds its float32 attention otherwise, and AdamW's steps on near-zero gradients magnify
                     # that past 1e-5 (tests/test_packed_groups.py checks the packed pass itself)
                     "train.pack_groups": "false"}, **extra}  # extra's settings win
    # their own KL coefficients: none, and more than algo.beta (each separate run gets it as algo.beta)
    specs = [{"name": "slow", "lr": 1e-3, "seed": 4, "beta": 0.0}, {"name": "fast", "lr": 1e-2, "seed": 9, "beta": 0.1}]
    out = tmp_path / "both"
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(out), **common), _policies_arg(specs)]) == 0
    err = capsys.readouterr().err
    assert "2 policies on one base: slow, fast" in err and "held-out after fast" in err
    shared = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"slow/reward_mean", "fast/reward_mean", "slow/lr", "step_s"} <= set().union(*shared)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    rounds, skipped, replayed = {}, {}, {}
    for spec in specs:
        alone = tmp_path / spec["name"]
        args = tiny_overrides(tiny_model_dir, prompts_file, str(alone), **{**common, "train.lr": spec["lr"],
                                                                           "train.seed": spec["seed"], "algo.beta": spec["beta"]})
        assert main(["train", *args]) == 0
        capsys.readouterr()
        mine = out / "policies" / spec["name"]
        theirs = [json.loads(line) for line in (alone / "metrics.jsonl").read_text().splitlines()]
        ours = [json.loads(line) for line in (mine / "metrics.jsonl").read_text().splitlines()]
        trained = [r for r in ours if not r["skipped_update"]]
        assert len(ours) == len(theirs) == int(extra.get("train.steps", 2)) and trained and all((r["kl"] is None) == (spec["beta"] == 0) for r in trained)
        if extra is HF_ENGINE:
            assert sum(r["resamples"] for r in ours) > 0  # its retries ran, each policy's in its own call
        if extra is ADAPTIVE:
            assert [r["resamples"] for r in ours] == [1, 0] and ours[0]["frac_zero_var_after_resample"] == 0.5
        rounds[spec["name"]], skipped[spec["name"]] = [r["sampling_rounds"] for r in ours], [r["skipped_update"] for r in ours]
        replayed[spec["name"]] = [r.get("replay_groups") for r in ours]
        for a, b in zip(ours, theirs):  # every metric a run of the policy alone writes, but the timings
            assert a["lr"] == spec["lr"]
            if b["skipped_update"] and not b["trained_frac"]:  # it kept no group: beside the step's timings, 0 tokens
                assert set(a) - set(b) == {"prefix_s", "ref_s", "old_s", "train_s", "optim_s", "gen_tokens"}
                assert a["gen_tokens"] == 0
            else:
                assert set(a) == set(b)
            for key in (k for k in b if not k.endswith("_s")):
                if isinstance(b[key], float):  # float32 sums in another order; grad_norm: see the adapters below
                    assert a[key] == pytest.approx(b[key], **({"rel": 1e-4} if key == "grad_norm" else {"rel": 1e-5} if key.endswith("grad_norm") else {"abs": 1e-5})), key
                else:
                    assert a[key] == b[key], key
        # Token for token: the batched and the plain adapter arithmetic differ by float32 rounding (~1e-6 of a
        # logit), and a draw flips only if its uniform lands that close to a boundary of the cumulative
        # distribution: ~1e-6 per token, ~1e-4 for the ~100 tokens here, on any CPU.
        their_samples = [json.loads(line) for line in (alone / "samples.jsonl").read_text().splitlines()]
        assert [s["completion"] for s in samples if s["policy"] == spec["name"]] == [s["completion"] for s in their_samples]
        a = load_file(str(mine / "adapter" / "adapter_model.safetensors"))
        b = load_file(str(alone / "adapter" / "adapter_model.safetensors"))
        assert a.keys() == b.keys()
        # float32 sums in another order move the bulk of the entries by ~1e-7. AdamW moves an entry by
        # lr x m / (sqrt(v) + eps): where a gradient entry cancels to near eps (1e-8), its rounding (~1e-10 absolute)
        # changes that move by up to ~lr / 100; a few of the 8192 entries do (seen: one or two, up to 1.6e-5 at lr
        # 1e-2, and the next step's grad_norm 5e-5 apart, relative). A wrong row or normaliser moves every entry
        # by ~lr.
        diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
        # PPO's advantages carry that rounding too (its KL penalty in the reward reads the old log-probs, which the
        # batched pass computes): more entries move by such amounts (seen: 13 of 8192, at most 4.7e-6, for the
        # policy with beta 0.1; at most 8 for the one without a KL term)
        assert int((diff > 2e-6).sum()) <= (32 if extra.get("algo.name") == "ppo" else 8) and float(diff.max()) <= spec["lr"] / 100
        if extra.get("algo.name") == "ppo":  # its critic: the value adapter and head, as the run alone leaves them
            critics = [{**load_file(str(folder / "value_model" / "adapter_model.safetensors")),
                        **load_file(str(folder / "value_model" / "value_head.safetensors"))} for folder in (mine, alone)]
            assert critics[0].keys() == critics[1].keys()
            diff = torch.cat([(critics[0][k] - critics[1][k]).abs().flatten() for k in critics[0]])
            # on the tiny Qwen3-MoE the critic's values already differ by float32 rounding in step 1 (2.4e-7; on the
            # dense model only from step 2): each expert's product runs over both policies' tokens in the batched pass
            # (expert_lora.experts_forward), over one policy's alone in a separate run, and MKL's float32 product of a
            # few rows rounds otherwise than the same rows in a longer product (measured: fewer than 8 rows of a
            # 256 x 512 product 2.5e-5 apart; this model's experts, 12 of 24 tokens alone or among all: 7.5e-9). AdamW's
            # near-eps entries magnify it as above (seen: 3 entries, in attention maps, at most 1.6e-5 at lr 1e-3); a
            # wrong row or normaliser still moves every entry by ~lr
            slack = 20 if any(".experts." in k for k in critics[0]) else 100
            assert int((diff > 2e-6).sum()) <= 8 and float(diff.max()) <= spec["lr"] / slack
        assert json.loads((mine / "eval.json").read_text())["after"] == json.loads((alone / "eval.json").read_text())["after"]
    if extra is DYNAMIC:  # the case this parameter is for
        assert rounds == {"slow": [2, 1], "fast": [2, 2]}
    if extra is DYNAMIC_EMPTY:
        assert skipped == {"slow": [0, 0], "fast": [1, 0]}
    if extra is REPLAY:
        assert replayed == {"slow": [0, 1, 2], "fast": [0, 2, 1]}
    moved = [load_file(str(out / "policies" / s["name"] / "adapter" / "adapter_model.safetensors")) for s in specs]
    assert any(not torch.equal(moved[0][k], moved[1][k]) for k in moved[0])
    if any("experts" in k or "shared_expert" in k for k in moved[0]):  # a mixture's: they trained there too
        assert all(not torch.equal(moved[0][k], moved[1][k]) for k in moved[0] if "experts" in k and "lora_B" in k)
    # `rlora eval RUN` of a run of several policies evaluates the base and every policy's adapter
    assert main(["eval", str(out), "--output", str(tmp_path / "eval")]) == 0
    results = json.loads((tmp_path / "eval" / "eval.json").read_text())["results"]
    assert list(results) == ["base", "fast", "slow"]
    assert results["slow"]["adapter"] == str(out / "policies" / "slow" / "adapter")


@pytest.mark.parametrize("extra,message", [
    ({}, "policies: the name 'a' is given twice"),
    ({"molora.num_experts": 2, "lora.rank": 16}, "do not support a molora section yet"),
])
def test_bad_policies_input_is_one_line_exit_2(tiny_model_dir, prompts_file, tmp_path, capsys, extra, message):
    specs = [{"name": "a"}, {"name": "a" if not extra else "b"}]
    args = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "run"), **extra)
    assert main(["train", *args, _policies_arg(specs)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_from_before_a_new_policy_key_still_resumes(tmp_path):
    """A checkpoint written before policies had `beta` records no beta: the comparison fills this version's
    defaults, so the same policies resume; other policies are still refused."""
    import yaml

    from rlora.config import load_config, to_yaml
    from rlora.train.resume import check_same_run

    cfg = load_config(None, [_policies_arg([{"name": "a"}, {"name": "b", "lr": 0.001}])])
    saved = yaml.safe_load(to_yaml(cfg))
    for policy in saved["policies"]:
        del policy["beta"]
    (tmp_path / "state.json").write_text(json.dumps({"step": 1, "config": yaml.safe_dump(saved)}))
    assert check_same_run(cfg, tmp_path)["step"] == 1
    other = load_config(None, [_policies_arg([{"name": "a"}, {"name": "b", "lr": 0.002}])])
    with pytest.raises(UserError, match="different policies"):
        check_same_run(other, tmp_path)


def test_one_policy_and_a_bad_name_are_one_line(tiny_model_dir, prompts_file, tmp_path, capsys):
    args = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "run"))
    assert main(["train", *args, _policies_arg([{"name": "base"}, {"name": "b"}])]) == 2
    err = capsys.readouterr().err.strip()
    assert "the name 'base' is reserved" in err and len(err.splitlines()) == 1
    assert main(["train", *args, _policies_arg([{"name": "a"}])]) == 2
    assert "policies lists one policy" in capsys.readouterr().err
    assert main(["train", *args, _policies_arg([{"name": "a.b"}, {"name": "c"}])]) == 2
    err = capsys.readouterr().err.strip()
    assert "policies.0.name" in err and "pattern" in err and len(err.splitlines()) == 1
    assert main(["train", *args, "lora.target_modules=[q_proj, lm_head]", _policies_arg([{"name": "a"}, {"name": "c"}])]) == 2
    err = capsys.readouterr().err.strip()
    assert "an adapter on 'lm_head' (outside the decoder layers) is not supported" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_an_adapter_outside_the_decoder_layers_is_refused_on_the_model(tiny_model_dir):
    """The config refuses `lm_head` by name before the model loads; the model's own modules are checked too (an
    output layer under another name, or a pattern that matches it)."""
    base = load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir)
    with pytest.raises(UserError, match="an adapter on 'lm_head' .outside the decoder layers. is not supported"):
        mlr.attach_policies(base, LoraConfig(rank=4, target_modules=["q_proj", "lm_head"]), ["a", "b"], [1, 2])


# dynamic sampling without extra rounds keeps on 2 ranks the groups one process keeps; with this binary reward a
# policy may keep its group on one rank and drop it on the other (each policy's statistics then join an empty block)
DYNAMIC_RANKS = {"algo.name": "reinforce_pp", "algo.dynamic_sampling": "true", "algo.max_extra_rounds": 0,
                 "rewards": "[{fn: rewards_for_tests.chance_binary, args: {share: 0.3}}]"}


@pytest.mark.slow  # 20-46 s each: the default suite keeps the policies on 2 data-parallel ranks in tests/test_fsdp.py
@pytest.mark.parametrize("algo", [{"algo.name": "grpo"}, {"algo.name": "reinforce_pp"}, DYNAMIC_RANKS, PPO],
                         ids=["grpo", "reinforce-pp", "reinforce-pp-dynamic", "ppo"])
def test_two_ranks_train_the_policies_as_one_rank(tiny_model_dir, prompts_file, tmp_path, algo):
    """torchrun with 2 ranks x 3 policies against 1 rank: each rank samples and trains its share of the step's
    prompts for every policy, and each policy's metrics are merged over the ranks (reinforce_pp: each policy's
    batch-wide statistics summed over the ranks; with dynamic sampling, a policy whose only group on a rank was
    dropped adds an empty block to them). One micro-batch per group (see test_distributed.py): the adapters
    agree to 1e-6, the completions, per-policy losses, grad norms, rewards and held-out results too; every
    policy's adapter is the same on both ranks after every step (adapter_rank_divergence 0)."""
    from test_distributed import _run

    common = {"train.prompts_per_step": 2, "rollout.num_generations": 4, "train.micro_batch_size": 4,
              "train.steps": 2, "train.lr": 0.05, "algo.beta": 0.04, "train.threads": 1, **algo,
              "rollout.sampler_dtype": "model", "algo.sampler_is_cap": "null", "eval.before": "false"}
    specs = _policies_arg([{"name": "a", "seed": 1}, {"name": "b", "lr": 0.01, "seed": 2}, {"name": "c", "seed": 3}])
    outs = {}
    for nproc in (1, 2):
        outs[nproc] = tmp_path / f"ranks{nproc}"
        done = _run(nproc, [*tiny_overrides(tiny_model_dir, prompts_file, str(outs[nproc]), **common), specs])
        assert done.returncode == 0, done.stderr[-3000:]
    for name in ("a", "b", "c"):
        one, two = (load_file(str(outs[n] / "policies" / name / "adapter" / "adapter_model.safetensors")) for n in (1, 2))
        assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-6, name
        rows = {n: [json.loads(line) for line in (outs[n] / "policies" / name / "metrics.jsonl").read_text().splitlines()]
                for n in (1, 2)}
        for a, b in zip(rows[1], rows[2]):
            for key in ("loss", "grad_norm", "lr", "reward_mean", "trained_frac", "gen_tokens", "kl", "entropy",
                        "clip_frac", "completion_len_mean", "frac_groups_zero_std"):
                assert a.get(key) == pytest.approx(b.get(key), abs=1e-6), (name, key)
        evals = {n: json.loads((outs[n] / "policies" / name / "eval.json").read_text()) for n in (1, 2)}
        assert evals[1] == evals[2]
    samples = {n: [(json.loads(s)["policy"], json.loads(s)["completion"])
                   for s in (outs[n] / "samples.jsonl").read_text().splitlines()] for n in (1, 2)}
    assert sorted(samples[1]) == sorted(samples[2])
    if algo is DYNAMIC_RANKS:  # the case it is for: some policy kept one of its two groups in a step
        dropped = [json.loads(line)[f"{name}/groups_dropped"] for line in (outs[2] / "metrics.jsonl").read_text()
                   .splitlines() for name in ("a", "b", "c")]
        assert 1 in dropped
    else:
        assert len(samples[2]) == 2 * 3 * 2 * 4
    shared = [json.loads(line) for line in (outs[2] / "metrics.jsonl").read_text().splitlines()]
    assert all(r["world_size"] == 2 and r["adapter_rank_divergence"] == 0.0 for r in shared)


def test_policies_resume_exactly(tiny_model_dir, prompts_file, tmp_path, capsys):
    """4 steps straight == 3 steps (checkpoints at 2 and 3), the step-3 checkpoint lost, resume from 2, on to 4:
    every policy's adapter, optimizer and replay buffer come back, the same completions are drawn and the same
    groups replayed, step 3 is logged once."""
    import shutil

    common = {"train.checkpoint_every": 2, "train.sample_every": 1, "algo.beta": 0.04, "eval.after": "false",
              "algo.replay.enabled": "true", "algo.replay.ratio": 0.75}
    specs = _policies_arg([{"name": "a", "lr": 0.01}, {"name": "b", "lr": 0.03, "seed": 2}])
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(straight), **common, **{"train.steps": 4}),
                 specs]) == 0
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(resumed), **common, **{"train.steps": 3}),
                 specs]) == 0
    assert (resumed / "checkpoints" / "step-0000002" / "policies" / "b" / "adapter" / "adapter_model.safetensors").is_file()
    shutil.rmtree(resumed / "checkpoints" / "step-0000003")  # as if killed after step 3 was logged
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(resumed), **common, **{
        "train.steps": 4, "train.resume": "auto"}), specs]) == 0
    assert "resuming from" in capsys.readouterr().err
    for name in ("a", "b"):
        logged = [(out / "policies" / name / "metrics.jsonl").read_text().splitlines() for out in (straight, resumed)]
        assert [json.loads(line)["step"] for line in logged[1]] == [1, 2, 3, 4]
        for key in ("reward_mean", "replay_groups", "replay_buffer", "loss"):
            assert [json.loads(line)[key] for line in logged[0]] == [json.loads(line)[key] for line in logged[1]], key
        assert sum(json.loads(line)["replay_groups"] for line in logged[1][2:]) > 0  # groups stored before the resume
        a, b = (load_file(str(out / "policies" / name / "adapter" / "adapter_model.safetensors")) for out in (straight, resumed))
        assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    samples = [[(json.loads(line)["step"], json.loads(line)["policy"], json.loads(line)["completion"])
                for line in (out / "samples.jsonl").read_text().splitlines()] for out in (straight, resumed)]
    assert samples[0] == samples[1] and {p for _, p, _ in samples[0]} == {"a", "b"}
    # a checkpoint of other policies is refused
    other = _policies_arg([{"name": "a", "lr": 0.01}, {"name": "c"}])
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(resumed), **common, **{
        "train.steps": 5, "train.resume": "auto"}), other]) == 2
    assert "different policies" in capsys.readouterr().err


def test_a_ppo_run_of_policies_resumes_exactly(tiny_model_dir, prompts_file, tmp_path, capsys):
    """PPO with two policies: 3 steps straight == 2 steps (a checkpoint), then resumed to 3: each policy's adapter,
    critic (policies/NAME/value_model in the checkpoint) and optimizer with its critic's param group come back."""
    common = {"train.checkpoint_every": 2, "eval.after": "false", **PPO}
    specs = _policies_arg([{"name": "a", "lr": 0.01}, {"name": "b", "lr": 0.03, "seed": 2, "beta": 0.1}])
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(straight), **common, **{"train.steps": 3}),
                 specs]) == 0
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(resumed), **common, **{"train.steps": 2}),
                 specs]) == 0
    checkpoint = resumed / "checkpoints" / "step-0000002" / "policies"
    assert all((checkpoint / name / "value_model" / "value_head.safetensors").is_file() for name in ("a", "b"))
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(resumed), **common, **{
        "train.steps": 3, "train.resume": "auto"}), specs]) == 0
    assert "resuming from" in capsys.readouterr().err
    for name in ("a", "b"):
        logged = [[json.loads(line) for line in (out / "policies" / name / "metrics.jsonl").read_text().splitlines()]
                  for out in (straight, resumed)]
        for key in ("reward_mean", "loss", "value_loss", "explained_variance", "value_lr"):
            assert [r[key] for r in logged[0]] == pytest.approx([r[key] for r in logged[1]], abs=1e-6), (name, key)
        for folder, file in [("adapter", "adapter_model.safetensors"), ("value_model", "adapter_model.safetensors"),
                             ("value_model", "value_head.safetensors")]:
            a, b = (load_file(str(out / "policies" / name / folder / file)) for out in (straight, resumed))
            assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6, (name, folder, file)


def test_a_reward_adapter_scores_beside_several_policies(tiny_model_dir, rm_folder, prompts_file, tmp_path, capsys):
    """The reward adapter on the policies' base scores what the reward model loaded alone scores; every policy
    stays trainable; a run with it trains both policies."""
    from rlora.config import RewardSpec, RLConfig
    from rlora.data.prompts import PromptSets
    from rlora.rewards.reward_adapter import attach_reward_adapters
    from rlora.rewards.scoring import resolve_rewards
    from test_reward_adapter import reference_scores

    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = mlr.attach_policies(load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir), LoraConfig(rank=4),
                                ["a", "b"], [0, 1])
    [reward] = resolve_rewards([RewardSpec(fn="reward_model", args={"path": rm_folder})], has_task=False)
    cfg = RLConfig(model={"path": tiny_model_dir}, data={"path": "unused.jsonl"}, rewards=[{"fn": "format"}])
    attach_reward_adapters([reward], model, tokenizer, tok, cfg, PromptSets([], []))
    prompts, completions = ["What is 1 + 1?", "Hello", "abab"], ["2", "abab baba aaa", "zzz"]
    scores = reward.fn(prompts, completions)
    assert scores == pytest.approx(reference_scores(tiny_model_dir, rm_folder, prompts, completions), abs=1e-6)
    assert len(set(scores)) == 3  # the completions score differently (the comparison is not vacuous)
    assert all(len(mlr.policy_parameters(model, name)) == 28 for name in ("a", "b"))  # still trainable
    out = tmp_path / "run"
    rewards = f"[{{fn: reward_model, args: {{path: {rm_folder}}}, weight: 0.5}}, {{fn: rewards_for_tests.count_a}}]"
    args = tiny_overrides(tiny_model_dir, prompts_file, str(out), rewards=rewards, **{"eval.before": "false"})
    assert main(["train", *args, _policies_arg([{"name": "a", "lr": 0.01}, {"name": "b", "lr": 0.02}])]) == 0, \
        capsys.readouterr().err
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["policy"] for s in samples} == {"a", "b"}
    for s in samples:
        assert s["reward"] == pytest.approx(0.5 * s["reward/reward_model"] + s["reward/count_a"], abs=1e-9)
    for name in ("a", "b"):
        weights = load_file(str(out / "policies" / name / "adapter" / "adapter_model.safetensors"))
        assert any(float(v.abs().max()) > 0 for k, v in weights.items() if "lora_B" in k)  # it trained
        assert not any("reward" in k for k in weights)
