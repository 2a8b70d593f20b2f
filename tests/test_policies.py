"""Several policies on one base (models/multi_lora.py, train/policies.py): the batched multi-LoRA forward against a
naive loop and against each adapter alone, the batched sampler against each policy sampled alone, each policy's
update against a one-policy update on the same rows, a `policies:` run against separate runs, and bad input."""

import json

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import tiny_overrides
from test_reward_adapter import rm_folder  # noqa: F401 - the reward model fixture
from rlora.algos.advantages import per_token
from rlora.algos.registry import get_algorithm
from rlora.cli import main
from rlora.config import AlgoConfig, LoraConfig, TrainConfig
from rlora.models import multi_lora as mlr
from rlora.models.loading import load_tokenizer, peft_lora_config, trainable_parameters
from rlora.models.adapters import reference_policy
from rlora.rollout.engine import BuiltinGenerator
from rlora.train.optim import build_optimizer, optimizer_step
from rlora.train.update import (
    ScoredRollout, accumulate_gradient_per_policy, accumulate_policy_gradient, batched_logprobs,
)
from rlora.types import Rollout, SamplingParams

NAMES = ["a", "b", "c"]


def base_model(model_dir, dtype=torch.float64):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.requires_grad_(False)
    return model


def policies_model(model_dir, dtype=torch.float64, names=NAMES, scale=0.2):
    """K policies with random (non-zero) B matrices, so that every adapter changes the outputs differently."""
    model = mlr.attach_policies(base_model(model_dir, dtype), LoraConfig(rank=4, alpha=8), names, [1, 2, 3][:len(names)])
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return model


def single_model(model_dir, multi, policy, folder, dtype=torch.float64, trainable=False):
    """A separate base with one policy's adapter, loaded from the folder save_policy writes."""
    mlr.save_policy(multi, policy, folder)
    return PeftModel.from_pretrained(base_model(model_dir, dtype), str(folder), is_trainable=trainable)


@pytest.mark.parametrize("policy,blocks_shape,a_view", [
    ([2, 0, 2, 2, 0, 2, 0], (2, 4), False),  # policy 1 has no row; a policy's rows are not contiguous
    ([0, 0, 0, 1, 1, 1, 2], (3, 3), False),  # grouped, but blocks of unequal size
    ([1, 1, 1, 2, 2, 2], (2, 3), True),  # grouped in equal blocks (a micro-batch of two policies): packed as a view
    ([2, 2, 2, 2], (1, 4), True),  # one policy
])
def test_packed_delta_equals_a_loop_over_rows(policy, blocks_shape, a_view):
    g = torch.Generator().manual_seed(0)
    K, R, I, O, T = 3, 4, 6, 5, 2
    A, B = torch.randn(K, R, I, generator=g, dtype=torch.float64), torch.randn(K, O, R, generator=g, dtype=torch.float64)
    scale = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    policy = torch.tensor(policy)
    x = torch.randn(len(policy), T, I, generator=g, dtype=torch.float64)
    blocks = mlr.RowBlocks(policy, K)
    assert (blocks.K, blocks.M) == blocks_shape and (blocks.flat_N is None) == a_view
    delta = mlr.multi_lora_delta(x, *map(blocks.select, (A, B, scale)), blocks)
    for n in range(len(policy)):
        k = int(policy[n])
        expected = scale[k] * (x[n] @ A[k].T @ B[k].T)
        assert torch.allclose(delta[n], expected, rtol=0, atol=1e-12)
    # 2-D rows (a decoding step: one token per row) and the gradient reaches only the rows' own adapters
    A.requires_grad_(True)
    mlr.multi_lora_delta(x[:, 0], *map(blocks.select, (A, B, scale)), blocks).sum().backward()
    with pytest.raises(RuntimeError, match="policies route whole rows"):  # tokens fed where rows are expected
        blocks.pack(x.reshape(-1, I))
    for k in range(K):
        assert bool(A.grad[k].abs().sum() > 0) == (k in policy.tolist())


def test_forward_and_gradients_equal_each_adapter_alone(tiny_model_dir, tmp_path):
    model = policies_model(tiny_model_dir)
    ids = torch.randint(3, 200, (5, 7), generator=torch.Generator().manual_seed(1))
    policy = torch.tensor([2, 0, 2, 1, 0])
    with mlr.policy_rows(model, policy):
        logits = model(input_ids=ids).logits
        logits.pow(2).sum().backward()
    outputs = []
    for k, name in enumerate(NAMES):
        single = single_model(tiny_model_dir, model, name, tmp_path / name, trainable=True)
        rows = (policy == k).nonzero().squeeze(-1)
        expected = single(input_ids=ids[rows]).logits
        expected.pow(2).sum().backward()
        assert torch.allclose(logits[rows], expected, rtol=0, atol=1e-10)
        grads = {n.replace(f".{mlr.PEFT_NAME.format(name)}.", ".default."): p.grad for n, p in model.named_parameters()
                 if f".{mlr.PEFT_NAME.format(name)}." in n}
        for n, p in single.named_parameters():
            if p.requires_grad:
                assert torch.allclose(grads[n], p.grad, rtol=0, atol=1e-10), n
        outputs.append(single(input_ids=ids[:1]).logits)
    assert not torch.allclose(outputs[0], outputs[1]) and not torch.allclose(outputs[1], outputs[2])


def test_reference_is_the_base_and_keeps_every_policy_trainable(tiny_model_dir):
    model = policies_model(tiny_model_dir)
    ids = torch.randint(3, 200, (2, 5), generator=torch.Generator().manual_seed(2))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    with reference_policy(model):
        reference = model(input_ids=ids).logits
    assert torch.equal(reference, base_model(tiny_model_dir)(input_ids=ids).logits)
    # peft's disable_adapter() would leave only the active adapter trainable on exit (a bug seen here once)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == trainable
    assert all(len(mlr.policy_parameters(model, name)) == 4 * 7 for name in NAMES)  # A and B on 7 modules x 2 layers


def test_a_forward_without_rows_policies_is_refused(tiny_model_dir):
    model = policies_model(tiny_model_dir)
    with pytest.raises(RuntimeError, match="without rows' policies"):
        model(input_ids=torch.tensor([[5, 6, 7]]))


@pytest.mark.parametrize("max_rows,decode", [(12, "eager"), (9, "eager"), (256, "eager"), (9, "static")])
def test_batched_sampler_samples_what_each_policy_samples_alone(tiny_model_dir, tmp_path, max_rows, decode):
    """Chunks of one policy, chunks mixing policies, one chunk; and the fixed-shape decode step that a GPU
    records as a CUDA graph (here run eagerly on the CPU)."""
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = policies_model(tiny_model_dir)
    prompts = [tokenizer(t)["input_ids"] for t in ("What is 1 + 1?", "Hello", "abab baba", "The quick brown")]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    P, G = len(prompts), 3
    sampler = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, max_rows=max_rows, decode=decode)
    seeds = [100 + k for k in range(3) for _ in range(P)]  # every policy its own seed
    together = sampler.sample(model, prompts * 3, G, params, seeds, keys=list(range(P)) * 3,
                              policies=[k for k in range(3) for _ in range(P)])
    for k, name in enumerate(NAMES):
        single = single_model(tiny_model_dir, model, name, tmp_path / name)
        alone = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, merge=False).sample(single, prompts, G, params, 100 + k)
        rows = slice(k * P * G, (k + 1) * P * G)
        assert together.completions[rows] == alone.completions
        width = alone.sampling_logp_BTc.shape[1]
        # Not the same ops: the batched rows go through packed adapter matmuls whose shapes depend on how the
        # chunk mixes policies, and CPU kernels (AVX2 vs AVX512) sum those in different orders. Seen on an AVX2
        # CPU: 1 float32 ulp (4.8e-7 at |logp| ~ 5). 1e-5 is ~20 ulps for |logp| < 16; another policy's adapter
        # moves these log-probs by far more (the policies sample different completions, checked below).
        assert torch.allclose(together.sampling_logp_BTc[rows, :width], alone.sampling_logp_BTc, rtol=0, atol=1e-5)
    assert together.completions[:P * G] != together.completions[P * G:2 * P * G]


def test_policies_evaluated_together_equal_each_evaluated_alone(tiny_model_dir):
    """evaluate_policies (every sampler call decodes all policies' rows) against evaluate() of one policy at a time:
    the same completions, rows and metrics per policy, with batches of 2 over 5 prompts (a short last batch) and
    2 samples per prompt; the policies do sample differently."""
    from rlora.rewards.scoring import resolve_rewards
    from rlora.config import RewardSpec
    from rlora.train.evaluate import evaluate, evaluate_policies
    from rlora.types import Example

    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = policies_model(tiny_model_dir)
    texts = ["What is 1 + 1?", "Hello", "abab baba", "The quick brown", "a"]
    examples = [Example(prompt=t, columns={}) for t in texts]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    rewards = resolve_rewards([RewardSpec(fn="rewards_for_tests.count_a")], has_task=False)
    sampler = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, max_rows=8)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    seen = []
    together = evaluate_policies(model, sampler, examples, ids, texts, rewards, params, 2, [2, 0, 1], num_samples=2,
                                 pass_k=(1, 2), seed=11, progress=seen.append)
    assert seen == [6, 12, 15]  # prompts done, counted for every policy (5 prompts x 3 policies)
    for (result, rows), policy in zip(together, [2, 0, 1]):
        alone = evaluate(model, sampler, examples, ids, texts, rewards, params, 2, num_samples=2, pass_k=(1, 2),
                         seed=11, policy=policy)
        assert (result, rows) == alone
    assert together[0][1] != together[1][1]


def test_sampler_refuses_a_policies_model_without_policies(tiny_model_dir):
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = policies_model(tiny_model_dir)
    with pytest.raises(ValueError, match="policies="):
        BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(model, [[5, 6]], 2, SamplingParams(4), 0)


def _rollout(model, tokenizer, tok, policies, G=4):
    prompts = [tokenizer(f"What is {i} + {i}?")["input_ids"] for i in range(1, 3)]
    sampler = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    K = len(policies)
    rollout = sampler.sample(model, prompts * K, G, SamplingParams(max_new_tokens=6, temperature=1.0), 5,
                             keys=list(range(2)) * K, policies=[k for k in range(K) for _ in prompts])
    for row, length in enumerate([6, 2, 5, 1, 6, 3, 4, 6] * K):  # ragged lengths, as if EOS had been drawn
        rollout.completion_mask_BTc[row, length:] = 0
    return rollout


@pytest.mark.parametrize("loss_agg,beta,iterations", [("token_mean", 0.0, 1), ("seq_mean", 0.04, 2),
                                                      ("constant", 0.04, 1), ("token_mean", [0.0, 0.1], 1),
                                                      ("seq_mean", [0.05, 0.0], 2)])
def test_each_policy_update_equals_its_update_alone(tiny_model_dir, tmp_path, loss_agg, beta, iterations):
    """Several policies trained on a shared batch (micro-batches of 3 rows straddle policies) end where each one
    ends when trained alone on its own rows, AdamW steps included; also with a KL coefficient per policy (a list:
    policy k's beta, and its run alone has it as algo.beta)."""
    betas = beta if isinstance(beta, list) else None
    beta = max(betas) if betas else beta  # the reference pass runs when any policy has a KL term
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = policies_model(tiny_model_dir, names=NAMES[:2], scale=0.05)
    singles = [single_model(tiny_model_dir, model, name, tmp_path / name, trainable=True) for name in NAMES[:2]]
    rollout = _rollout(model, tokenizer, tok, NAMES[:2])
    policy_B = torch.arange(2).repeat_interleave(8)
    advantages = torch.linspace(-1, 1, 16, dtype=torch.float64).float()
    cfg = AlgoConfig(loss_agg=loss_agg, beta=beta, num_iterations=iterations)
    algo = get_algorithm("grpo")
    with reference_policy(model):
        ref = batched_logprobs(model, rollout, 5)
    old = batched_logprobs(model, rollout, 5, policy_B=policy_B)
    scored = ScoredRollout(rollout, per_token(advantages, rollout.completion_mask_BTc), rollout.completion_mask_BTc,
                           old, ref if beta else None, policy_B=policy_B, betas=betas)
    lrs = [1e-3, 3e-3]
    optims = [build_optimizer(mlr.policy_parameters(model, n), TrainConfig(lr=lr), 4) for n, lr in zip(NAMES, lrs)]
    for _ in range(iterations):
        updates = accumulate_gradient_per_policy(model, algo, cfg, scored, 3, 6)
        for name, (opt, sched), update in zip(NAMES, optims, updates):
            update |= optimizer_step(mlr.policy_parameters(model, name), opt, sched, 1.0, update["loss"])
    for k, (single, lr) in enumerate(zip(singles, lrs)):
        rows = slice(8 * k, 8 * (k + 1))
        part = rollout.select(rows)
        own = Rollout(part.prompt_ids_BTp, part.prompt_mask_BTp, part.completion_ids_BTc, part.completion_mask_BTc,
                      rollout.completions[rows], rollout.finish_reasons[rows], part.temperature_B)
        own_beta = betas[k] if betas else beta
        alone = ScoredRollout(own, per_token(advantages[rows], own.completion_mask_BTc), own.completion_mask_BTc,
                              old[rows], ref[rows] if own_beta else None)
        params = trainable_parameters(single)
        opt, sched = build_optimizer(params, TrainConfig(lr=lr), 4)
        own_cfg = cfg.model_copy(update={"beta": own_beta})
        for _ in range(iterations):
            metrics = accumulate_policy_gradient(single, algo, own_cfg, alone, 3, 6)
            metrics |= optimizer_step(params, opt, sched, 1.0, metrics["loss"])
        # log-softmax runs in float32 whatever the model's dtype, and the two sides batch other rows together
        assert updates[k]["loss"] == pytest.approx(metrics["loss"], abs=1e-6)
        assert updates[k]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
        assert (updates[k]["kl"] is None) == (metrics["kl"] is None) == (own_beta == 0)
        mine = {n.replace(f".{mlr.PEFT_NAME.format(NAMES[k])}.", ".default."): p for n, p in model.named_parameters()}
        for n, p in single.named_parameters():
            if p.requires_grad:
                assert torch.allclose(mine[n], p, rtol=0, atol=1e-7), n


def test_a_zero_pass_changes_no_gradient_and_creates_none(tiny_model_dir):
    """train.fsdp's padding pass (zero_pass) through row 0's policy: the gradients a policy has are unchanged to
    the bit, and a policy that had none (here the one row 0 goes through) still has none, so its optimizer
    skips the step as it would without the padding."""
    from rlora.models.logprobs import completion_logprobs
    from rlora.batching import trim
    from rlora.train.fsdp import zero_pass

    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = policies_model(tiny_model_dir, names=NAMES[:2], dtype=torch.float32)
    rollout = _rollout(model, tokenizer, tok, NAMES[:2])
    with mlr.policy_rows(model, torch.zeros(2, dtype=torch.long)):  # a gradient for policy a only
        completion_logprobs(model, trim(rollout.select(slice(0, 2))))[0].sum().backward()
    a, b = (mlr.policy_parameters(model, name) for name in NAMES[:2])
    assert all(p.grad is not None for p in a) and all(p.grad is None for p in b)
    before = [p.grad.clone() for p in a]
    zero_pass(model, rollout, 256, None, torch.ones(rollout.num_completions, dtype=torch.long))  # row 0 through b
    assert all(torch.equal(p.grad, g) for p, g in zip(a, before))
    assert all(p.grad is None for p in b)


def _policies_arg(specs):
    return "policies=[" + ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in s.items()) + "}" for s in specs) + "]"


def test_a_policies_run_equals_separate_runs(tiny_model_dir, prompts_file, tmp_path, capsys):
    """`policies:` with two learning rates, seeds and KL coefficients (0 and 0.1, algo.beta 0.04), both starting
    from one adapter, against two plain runs: the same completions, metrics (kl only where beta > 0) and (up to
    float32 summation order) the same adapters."""
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
    common = dict(**{"lora.init_from": str(start), "algo.beta": 0.04, "algo.num_iterations": 2,
                     "rollout.sampler_dtype": "model", "algo.sampler_is_cap": "null", "rollout.merge_adapter": "false",
                     "train.micro_batch_size": 3, "rollout.num_generations": 3})
    # their own KL coefficients: none, and more than algo.beta (each separate run gets it as algo.beta)
    specs = [{"name": "slow", "lr": 1e-3, "seed": 4, "beta": 0.0}, {"name": "fast", "lr": 1e-2, "seed": 9, "beta": 0.1}]
    out = tmp_path / "both"
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(out), **common), _policies_arg(specs)]) == 0
    err = capsys.readouterr().err
    assert "2 policies on one base: slow, fast" in err and "held-out after fast" in err
    shared = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"slow/reward_mean", "fast/reward_mean", "slow/lr", "step_s"} <= set(shared[0])
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for spec in specs:
        alone = tmp_path / spec["name"]
        args = tiny_overrides(tiny_model_dir, prompts_file, str(alone), **{**common, "train.lr": spec["lr"],
                                                                           "train.seed": spec["seed"], "algo.beta": spec["beta"]})
        assert main(["train", *args]) == 0
        capsys.readouterr()
        mine = out / "policies" / spec["name"]
        theirs = [json.loads(line) for line in (alone / "metrics.jsonl").read_text().splitlines()]
        ours = [json.loads(line) for line in (mine / "metrics.jsonl").read_text().splitlines()]
        assert len(ours) == len(theirs) == 2 and (ours[0]["kl"] is None) == (spec["beta"] == 0)
        for a, b in zip(ours, theirs):  # every metric a run of the policy alone writes, but the timings
            assert a["lr"] == spec["lr"] and set(a) == set(b)
            for key in (k for k in b if not k.endswith("_s")):
                if isinstance(b[key], float):  # float32 sums in another order
                    assert a[key] == pytest.approx(b[key], abs=1e-5), key
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
        assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
        assert json.loads((mine / "eval.json").read_text())["after"] == json.loads((alone / "eval.json").read_text())["after"]
    moved = [load_file(str(out / "policies" / s["name"] / "adapter" / "adapter_model.safetensors")) for s in specs]
    assert any(not torch.equal(moved[0][k], moved[1][k]) for k in moved[0])
    # `rlora eval RUN` of a run of several policies evaluates the base and every policy's adapter
    assert main(["eval", str(out), "--output", str(tmp_path / "eval")]) == 0
    results = json.loads((tmp_path / "eval" / "eval.json").read_text())["results"]
    assert list(results) == ["base", "fast", "slow"]
    assert results["slow"]["adapter"] == str(out / "policies" / "slow" / "adapter")


@pytest.mark.parametrize("extra,message", [
    ({}, "policies: the name 'a' is given twice"),
    ({"algo.name": "ppo"}, "do not support algo.name=ppo yet"),
    ({"algo.dynamic_sampling": "true"}, "do not support algo.dynamic_sampling yet"),
    ({"algo.adv_scale": "batch"}, "do not support batch-wide advantage statistics"),
    ({"algo.name": "reinforce_pp"}, "do not support batch-wide advantage statistics"),
    ({"algo.name": "adaptive_grpo"}, "do not support adaptive resampling yet"),
    ({"algo.replay.enabled": "true"}, "do not support algo.replay yet"),
    ({"molora.num_experts": 2, "lora.rank": 16}, "do not support a molora section yet"),
    ({"rollout.engine": "hf", "rollout.sampler_dtype": "model", "algo.sampler_is_cap": "null"},
     "do not support rollout.engine=hf yet"),
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
    from rlora.errors import UserError
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


def test_two_ranks_train_the_policies_as_one_rank(tiny_model_dir, prompts_file, tmp_path):
    """torchrun with 2 ranks x 3 policies against 1 rank: each rank samples and trains its share of the step's
    prompts for every policy, and each policy's metrics are merged over the ranks. One micro-batch per group (see
    test_distributed.py): the adapters agree to 1e-6, the completions, per-policy losses, grad norms, rewards and
    held-out results too; every policy's adapter is the same on both ranks after every step
    (adapter_rank_divergence 0)."""
    from test_distributed import _run

    common = {"train.prompts_per_step": 2, "rollout.num_generations": 4, "train.micro_batch_size": 4,
              "train.steps": 2, "train.lr": 0.05, "algo.beta": 0.04, "train.threads": 1,
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
    assert sorted(samples[1]) == sorted(samples[2]) and len(samples[2]) == 2 * 3 * 2 * 4
    shared = [json.loads(line) for line in (outs[2] / "metrics.jsonl").read_text().splitlines()]
    assert all(r["world_size"] == 2 and r["adapter_rank_divergence"] == 0.0 for r in shared)


def test_policies_resume_exactly(tiny_model_dir, prompts_file, tmp_path, capsys):
    """4 steps straight == 3 steps (checkpoints at 2 and 3), the step-3 checkpoint lost, resume from 2, on to 4:
    every policy's adapter and optimizer come back, the same completions are drawn, step 3 is logged once."""
    import shutil

    common = {"train.checkpoint_every": 2, "train.sample_every": 1, "algo.beta": 0.04, "eval.after": "false"}
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
        assert [json.loads(line)["reward_mean"] for line in logged[0]] == [json.loads(line)["reward_mean"] for line in logged[1]]
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


def test_a_reward_adapter_scores_beside_several_policies(tiny_model_dir, rm_folder, prompts_file, tmp_path, capsys):
    """The reward adapter on the policies' base scores what the reward model loaded alone scores; every policy
    stays trainable; a run with it trains both policies."""
    from rlora.config import ModelConfig, RewardSpec, RLConfig
    from rlora.data.prompts import PromptSets
    from rlora.models.loading import load_base_model
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
