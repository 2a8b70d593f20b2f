"""Several policies on one base (models/multi_lora.py, train/policies.py): the batched multi-LoRA forward against a
naive loop and against each adapter alone, the batched sampler against each policy sampled alone, each policy's
update against a one-policy update on the same rows. Whole runs of several policies: tests/test_policies_runs.py."""


import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from rlora.algos.advantages import per_token
from rlora.algos.registry import get_algorithm
from rlora.config import AlgoConfig, LoraConfig, TrainConfig
from rlora.models import multi_lora as mlr
from rlora.models.loading import load_tokenizer, trainable_parameters
from rlora.models.adapters import reference_policy
from rlora.models.shared_prompts import set_prompt_sharing
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


def test_generate_samples_each_policy_as_its_own_call_with_the_rows_in_their_places(tiny_model_dir, tmp_path):
    """rollout.engine=hf with several policies: each policy's prompts in one generate call through its adapter, with
    its seed and the prompts' keys, as the call of a run of that policy alone (a plain adapter); the rows come back in
    the prompts' order, also where the policies' prompts interleave."""
    from rlora.rollout.generator import HFGenerator

    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = policies_model(tiny_model_dir)
    prompts = [tokenizer(t)["input_ids"] for t in ("What is 1 + 1?", "Hello", "abab baba", "The quick brown")]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    G, sampler = 2, HFGenerator(tokenizer, tok.eos_ids, tok.pad_id, batch_size=3)
    policy_of = [2, 0, 2, 1]  # interleaved
    together = sampler.sample(model, prompts, G, params, [100 + k for k in policy_of], policies=policy_of)
    for k, name in enumerate(NAMES):
        mine = [i for i, p in enumerate(policy_of) if p == k]
        single = single_model(tiny_model_dir, model, name, tmp_path / name)
        alone = sampler.sample(single, [prompts[i] for i in mine], G, params, 100 + k, keys=mine)
        assert [together.completions[i * G + j] for i in mine for j in range(G)] == alone.completions
    # the adapters matter: prompt 1 drawn with policy 0's seed through policy 2's adapter comes out otherwise
    other = sampler.sample(single_model(tiny_model_dir, model, NAMES[2], tmp_path / "other"), [prompts[1]], G, params,
                           100, keys=[1])
    assert other.completions != together.completions[G:2 * G]


def test_policies_evaluated_together_equal_each_evaluated_alone(tiny_model_dir):
    """evaluate_policies (every sampler call decodes all policies' rows) against evaluate() of one policy at a time:
    the same completions, rows and metrics per policy, with batches of 2 over 5 prompts (a short last batch) and
    2 samples per prompt; the policies do sample differently."""
    from rlora.rewards.scoring import resolve_rewards
    from rlora.config import RewardSpec
    from rlora.train.evaluate import evaluate, evaluate_policies
    from rlora.train.sources import Completions
    from rlora.types import Example

    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = policies_model(tiny_model_dir)
    texts = ["What is 1 + 1?", "Hello", "abab baba", "The quick brown", "a"]
    examples = [Example(prompt=t, columns={}) for t in texts]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    rewards = resolve_rewards([RewardSpec(fn="rewards_for_tests.count_a")], has_task=False)
    sampler = Completions(BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, max_rows=8), rewards)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    seen = []
    together = evaluate_policies(model, sampler, examples, ids, texts, params, 2, [2, 0, 1], num_samples=2,
                                 pass_k=(1, 2), seed=11, progress=seen.append)
    assert seen == [6, 12, 15]  # prompts done, counted for every policy (5 prompts x 3 policies)
    for (result, rows), policy in zip(together, [2, 0, 1]):
        alone = evaluate(model, sampler, examples, ids, texts, params, 2, num_samples=2, pass_k=(1, 2),
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
    for single in singles:  # a model of several policies runs every row's prompt (models/shared_prompts.py)
        set_prompt_sharing(single, False)
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
