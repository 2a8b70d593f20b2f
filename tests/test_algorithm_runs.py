"""Every algorithm end to end on the tiny model, the replay buffer, the entropy bonus's gradient."""

import json
import math

import pytest
import torch
from test_policy_model import make_policy, perturb_adapter, sample

from conftest import tiny_overrides
from rlora.algos.advantages import per_token
from rlora.algos.registry import ALGORITHMS, get_algorithm
from rlora.cli import main
from rlora.config import AlgoConfig, ReplayConfig
from rlora.models.loading import trainable_parameters
from rlora.batching import concat_rollouts, select_rows
from rlora.train.replay import ReplayBuffer, StoredGroup
from rlora.train.update import ScoredRollout, accumulate_policy_gradient


def run(model_dir, data, out, **extra):
    values = {"eval.before": "false", "eval.after": "false", **extra}
    code = main(["train", *tiny_overrides(model_dir, data, str(out), **values)])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return code, rows


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_each_algorithm_trains_two_steps(name, tiny_model_dir, prompts_file, tmp_path):
    # count_a (share of the letter a) is dense: groups are rarely flat and never fully successful
    code, rows = run(tiny_model_dir, prompts_file, tmp_path / "run", **{"algo.name": name, "train.lr": 0.01})
    assert code == 0 and [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["skipped_update"] == 0 and r["grad_norm"] > 0
    if name == "dapo":
        assert all(r["sampling_rounds"] >= 1 and "groups_dropped" in r for r in rows)
    if name == "adaptive_grpo":  # no sample reaches reward 1: every group is resampled max_retries = 2 times
        assert all(r["resamples"] == 2 * r["groups_sampled"] for r in rows)
    if name.startswith("reinforce_pp"):
        assert rows[-1]["kl"] is not None  # the reference ran: its KL went into the token reward


def test_dynamic_sampling_and_adaptive_counts_in_a_real_run(tiny_model_dir, prompts_file, tmp_path):
    # success_reward 2 is out of reach of has_a (0 or 1): every group is resampled max_retries = 2 times
    code, rows = run(tiny_model_dir, prompts_file, tmp_path / "run", **{
        "algo.name": "adaptive_grpo", "algo.dynamic_sampling": "true", "algo.adaptive.success_reward": 2.0,
        "rewards": "[{fn: rewards_for_tests.has_a}]", "train.steps": 3, "rollout.temperature": 0.3})
    assert code == 0
    for r in rows:
        assert r["sampling_rounds"] >= 1
        assert r["groups_sampled"] == 2 * r["sampling_rounds"]
        assert r["resamples"] == 2 * r["groups_sampled"] and r["rescued_groups"] == 0


def test_dynamic_sampling_with_only_flat_groups_skips_the_update(tiny_model_dir, prompts_file, tmp_path):
    code, rows = run(tiny_model_dir, prompts_file, tmp_path / "run", **{
        "algo.name": "dapo", "algo.max_extra_rounds": 1, "rewards": "[{fn: rewards_for_tests.constant}]"})
    assert code == 0
    for r in rows:
        assert r["skipped_update"] == 1 and r["sampling_rounds"] == 2 and r["groups_dropped"] == 4
        assert r["reward_mean_sampled"] == 1.0
    from safetensors.torch import load_file
    weights = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    assert all(float(w.abs().sum()) == 0 for name, w in weights.items() if "lora_B" in name)  # never updated


@pytest.mark.parametrize("name", ["grpo", "reinforce_pp"])  # advantages per completion; per token
def test_replay_mixes_stored_groups_with_importance_weights(name, tiny_model_dir, prompts_file, tmp_path):
    code, rows = run(tiny_model_dir, prompts_file, tmp_path / "run", **{
        "algo.name": name, "algo.replay.enabled": "true", "algo.replay.ratio": 1.0, "train.steps": 3,
        "train.lr": 0.01})
    assert code == 0
    assert rows[0]["replay_groups"] == 0 and rows[0]["replay_stored"] > 0
    assert rows[1]["replay_groups"] > 0 and rows[1]["is_weight_mean"] is not None
    assert rows[2]["replay_buffer"] <= 64


def test_a_replay_run_sampling_with_generate_equals_the_engines(tiny_model_dir, prompts_file, tmp_path):
    """rollout.engine=hf draws every token as the built-in engine does and returns its log-probs
    (rollout/generate_draw.py), so replay and algo.sampler_is_cap run on it, and a float32 run of both equals the
    engine's: the same completions, metrics and adapter (to float32 rounding: the samplers' forwards differ)."""
    from safetensors.torch import load_file

    common = {"algo.replay.enabled": "true", "algo.replay.ratio": 1.0, "train.steps": 3, "train.lr": 0.01,
              "rollout.sampler_dtype": "model", "algo.sampler_is_cap": 2.0, "rollout.min_new_tokens": 2,
              "rollout.top_p": 0.9}
    runs = {}
    for engine in ("builtin", "hf"):
        code, rows = run(tiny_model_dir, prompts_file, tmp_path / engine, **{**common, "rollout.engine": engine})
        assert code == 0
        samples = [json.loads(line) for line in (tmp_path / engine / "samples.jsonl").read_text().splitlines()]
        runs[engine] = rows, samples, load_file(str(tmp_path / engine / "adapter" / "adapter_model.safetensors"))
    (ours, our_samples, our_adapter), (theirs, their_samples, their_adapter) = runs["hf"], runs["builtin"]
    assert [s["completion"] for s in our_samples] == [s["completion"] for s in their_samples]
    assert ours[1]["replay_groups"] > 0 and ours[2]["replay_groups"] > 0
    for a, b in zip(ours, theirs):
        assert a["sampler_logp_gap"] < 1e-5  # is_weight_mean also weighs the replayed rows: compared below
        for key in (k for k in b if not k.endswith("_s") and k != "sampler_logp_gap"):
            assert a[key] == (pytest.approx(b[key], rel=1e-4, abs=1e-6) if isinstance(b[key], float) else b[key]), key
    assert max(float((our_adapter[k] - their_adapter[k]).abs().max()) for k in our_adapter) < 1e-5


@pytest.mark.parametrize("override, message", [
    (["algo.name=gspo", "algo.loss_agg=token_mean"], "gspo clips one ratio per sequence"),
    (["algo.overlong_buffer=100"], "exceeds rollout.max_new_tokens"),
    (["rollout.temperature_schedule=linear"], "needs rollout.temperature_end"),
    (["algo.name=reinforce_pp", "algo.adaptive.adv_stats=all"], "adv_stats=kept"),
    (["algo.name=drgrpo"], "did you mean 'dr_grpo'"),
])
def test_bad_algorithm_combinations_are_one_line_errors(override, message, capsys):
    assert main(["train", *override, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def _group(rollout, rows, adv, step):
    mask = rollout.completion_mask_BTc[rows]
    return StoredGroup(select_rows(rollout, rows), per_token(torch.tensor(adv), mask), mask, step)


def test_replay_buffer_keeps_informative_groups_evicts_oldest_and_counts_uses(tiny_model_dir):
    tokenizer, tok, model = make_policy(tiny_model_dir)
    rollout = sample(model, tokenizer, tok, n_prompts=2, G=2)
    rollout.sampling_logp_BTc = torch.zeros(rollout.completion_ids_BTc.shape)
    buffer = ReplayBuffer(ReplayConfig(capacity=2, max_uses=2), seed=0)
    assert not buffer.add(_group(rollout, [0, 1], [0.0, 0.0], 1))  # zero advantages: nothing to learn
    assert buffer.add(_group(rollout, [0, 1], [0.5, -0.5], 1))
    assert buffer.add(_group(rollout, [2, 3], [1.0, -1.0], 2))
    assert buffer.add(_group(rollout, [0, 1], [0.2, -0.2], 3))
    assert len(buffer) == 2 and [g.step for g in buffer.groups] == [2, 3]  # step 1 left: capacity 2
    first = buffer.draw(1, step=4)
    again = ReplayBuffer(ReplayConfig(capacity=2, max_uses=2), seed=0)
    again.groups.extend(_group(rollout, [0, 1], [0.1, -0.1], s) for s in (2, 3))
    assert [g.step for g in again.draw(1, step=4)] == [g.step for g in first]  # seeded by (seed, step)
    buffer.draw(2, step=5)
    assert len(buffer) == 1 and buffer.groups[0].uses == 1  # the group used twice has left
    rollout.sampling_logp_BTc = None
    with pytest.raises(ValueError, match="sampler's log-probs"):
        buffer.add(_group(rollout, [0, 1], [0.5, -0.5], 6))


def test_concat_rollouts_keeps_every_row_aligned(tiny_model_dir):
    tokenizer, tok, model = make_policy(tiny_model_dir)
    a = sample(model, tokenizer, tok, n_prompts=1, G=2, max_new=3)
    b = sample(model, tokenizer, tok, n_prompts=2, G=2, max_new=6, seed=1)
    joined = concat_rollouts([a, b], tok.pad_id)
    assert joined.num_completions == 6
    for part, offset in ((a, 0), (b, 2)):
        for row in range(part.num_completions):
            got, want = joined.completion_ids_BTc[offset + row], part.completion_ids_BTc[row]
            assert got[joined.completion_mask_BTc[offset + row].bool()].tolist() == want[part.completion_mask_BTc[row].bool()].tolist()
            got_prompt = joined.prompt_ids_BTp[offset + row][joined.prompt_mask_BTp[offset + row].bool()]
            assert got_prompt.tolist() == part.prompt_ids_BTp[row][part.prompt_mask_BTp[row].bool()].tolist()


def test_reinforce_pp_puts_no_kl_into_the_loss(tiny_model_dir):
    """kl_in_reward: with a reference and beta > 0 the loss gradient equals the beta = 0 one (the KL is in
    the advantages instead), while GRPO with the same beta adds the k3 term."""
    tokenizer, tok, model = make_policy(tiny_model_dir)
    perturb_adapter(model, scale=0.2)
    rollout = sample(model, tokenizer, tok, n_prompts=2, G=2, max_new=5)
    adv = torch.randn(rollout.completion_ids_BTc.shape)
    ref = torch.randn(rollout.completion_ids_BTc.shape) - 3.0
    grads = {}
    for label, algo, beta, ref_logp in (("pp", "reinforce_pp", 0.5, ref), ("none", "grpo", 0.0, None),
                                         ("grpo", "grpo", 0.5, ref)):
        model.zero_grad(set_to_none=True)
        scored = ScoredRollout(rollout, adv, rollout.completion_mask_BTc, ref_logp_BTc=ref_logp)
        accumulate_policy_gradient(model, get_algorithm(algo), AlgoConfig(name=algo, beta=beta), scored, 2, 5)
        grads[label] = _grads(model)
    assert torch.equal(grads["pp"], grads["none"])
    assert not torch.allclose(grads["grpo"], grads["none"])


def test_replayed_groups_of_other_widths_train_with_their_weights(tiny_model_dir):
    """A batch of fresh rows and replayed rows of another prompt and completion width: the replayed rows'
    loss is weighted by min(exp(old - behaviour), cap), and their gradient equals the weighted per-row one."""
    tokenizer, tok, model = make_policy(tiny_model_dir)
    perturb_adapter(model, scale=0.2)
    fresh = sample(model, tokenizer, tok, n_prompts=1, G=2, max_new=3)
    old = sample(model, tokenizer, tok, n_prompts=2, G=1, max_new=7, seed=5)
    joined = concat_rollouts([fresh, old], tok.pad_id)
    assert joined.completion_ids_BTc.shape[1] == max(fresh.completion_ids_BTc.shape[1], old.completion_ids_BTc.shape[1])
    B, T = joined.completion_ids_BTc.shape
    behaviour = torch.full((B, T), float("nan"))
    behaviour[2:] = -50.0  # far below any real log-prob: the weight hits the cap
    mask = joined.completion_mask_BTc
    scored = ScoredRollout(joined, per_token(torch.tensor([0.5, -0.5, 1.0, -1.0]), mask), mask,
                           behaviour_logp_BTc=behaviour, is_cap_B=torch.tensor([9.0, 9.0, 1.5, 1.5]),
                           fresh_B=torch.tensor([True, True, False, False]))
    model.zero_grad(set_to_none=True)
    stats = accumulate_policy_gradient(model, get_algorithm("grpo"), AlgoConfig(), scored, 4, 7)
    weighted = _grads(model)
    assert stats["is_weight_mean"] == pytest.approx(1.5)  # only the replayed rows are weighted, all at the cap
    # the same batch without weights, replayed rows' advantages scaled by 1.5 instead: the same gradient
    model.zero_grad(set_to_none=True)
    plain = ScoredRollout(joined, per_token(torch.tensor([0.5, -0.5, 1.5, -1.5]), mask), mask)
    accumulate_policy_gradient(model, get_algorithm("grpo"), AlgoConfig(), plain, 4, 7)
    assert torch.allclose(weighted, _grads(model), rtol=1e-5, atol=1e-8)


def _grads(model):
    return torch.cat([p.grad.flatten() for p in trainable_parameters(model)])


def test_entropy_bonus_adds_minus_coef_times_entropy_gradient(tiny_model_dir):
    """grad(loss with bonus c) = grad(loss) - c * grad(token-mean entropy), checked with c = 0 and c = 1."""
    tokenizer, tok, model = make_policy(tiny_model_dir)
    perturb_adapter(model, scale=0.2)
    rollout = sample(model, tokenizer, tok, n_prompts=2, G=2, max_new=5)
    mask = rollout.completion_mask_BTc
    scored = ScoredRollout(rollout, per_token(torch.tensor([0.5, -0.5, 1.0, -1.0]), mask), mask)
    grads = {}
    for coef in (0.0, 1.0, 2.0):
        model.zero_grad(set_to_none=True)
        accumulate_policy_gradient(model, get_algorithm("grpo"), AlgoConfig(entropy_coef=coef), scored, 2, 5)
        grads[coef] = _grads(model)
    bonus_1, bonus_2 = grads[0.0] - grads[1.0], grads[0.0] - grads[2.0]
    assert bonus_1.abs().max() > 1e-6  # the entropy term moves the gradient
    # float32 differences of gradients: compare relative to the largest entry
    tol = 1e-3 * float(bonus_1.abs().max())
    assert torch.allclose(bonus_2, 2 * bonus_1, rtol=1e-3, atol=tol)
    # and it is the gradient of the token-mean entropy: compare with a direct computation
    from rlora.models.logprobs import completion_logprobs
    model.zero_grad(set_to_none=True)
    _, entropy = completion_logprobs(model, rollout.select(slice(None)), with_entropy=True, chunk_tokens=0, entropy_grad=True)
    mask = rollout.completion_mask_BTc.float()
    ((entropy * mask).sum() / mask.sum()).backward()
    assert torch.allclose(bonus_1, _grads(model), rtol=1e-3, atol=tol)
    assert math.isfinite(float(bonus_1.sum()))


def test_a_prompt_twice_in_one_step_gets_two_different_groups(tiny_model_dir, tmp_path):
    """With 2 prompts and 3 per step, step 0 holds one prompt twice: its two groups are drawn from different
    slots, so they are different samples (a key by prompt index would give two identical groups)."""
    import json as _json

    data = tmp_path / "two.jsonl"
    data.write_text("".join(_json.dumps({"prompt": f"Say {w}", "answer": "a"}) + "\n" for w in ("hi", "yo")))
    out = tmp_path / "run"
    code = main(["train", *tiny_overrides(tiny_model_dir, str(data), str(out), **{
        "train.prompts_per_step": 3, "train.micro_batch_size": 4, "train.steps": 1, "eval.before": "false",
        "eval.after": "false", "data.shuffle": "false", "rollout.max_new_tokens": 8})])
    assert code == 0
    rows = [_json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    by_prompt = {}
    for i in range(0, len(rows), 4):
        by_prompt.setdefault(rows[i]["prompt"], []).append([r["completion"] for r in rows[i:i + 4]])
    repeated = [groups for groups in by_prompt.values() if len(groups) == 2]
    assert len(repeated) == 1 and repeated[0][0] != repeated[0][1]
