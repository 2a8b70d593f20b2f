"""PPO's critic reads the right positions: V_t, the value of completion position t, is the value head applied to
the final hidden state at the position that predicts completion token t (the state after the prompt and tokens
0..t-1: models/value_model.py READS = "before_each_completion_token", docs/algorithms.md), with the value adapter
active, 0 on padding. The reference runs each row alone and unpadded through the peft model (the value adapter
switched on here with peft's own set_adapter) and applies the head's weight and bias by hand at position
len(prompt) - 1 + t; the code under test runs left-padded prompts and right-padded completions of different
lengths in micro-batches. A value read one position late (the state holding token t), padding attended to,
padding left unzeroed, or the policy adapter instead of the value adapter gives other numbers. (Position ids
that ignore the left padding do not: on a RoPE model a row-wide shift of positions changes no attention score.)"""

import json
from contextlib import contextmanager

import torch

from conftest import tiny_overrides
from rlora.cli import main
from rlora.models.value_model import attach_critic
from rlora.train import ppo_step
from rlora.types import Rollout
from test_policy_model import make_policy

PROMPT_LENGTHS = [3, 6, 1, 4]  # real prompt tokens per row, left-padded to 6
COMPLETION_LENGTHS = [5, 2, 1, 4]  # real completion tokens per row, right-padded to 5


@contextmanager
def adapter_on(model, name: str):
    """peft's set_adapter(name) for the block; afterwards the previous adapter, every requires_grad and the
    training flag as they were (written here rather than borrowed from rlora, whose switch is under test)."""
    previous, training = model.active_adapter, model.training
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    model.set_adapter(name)
    try:
        yield
    finally:
        model.set_adapter(previous)
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])
        model.train(training)


@torch.no_grad()
def reference_values(model, head, prompts: list[list[int]], completions: list[list[int]], width: int,
                     adapter: str = "value", shift: int = 0) -> torch.Tensor:
    """[B, width] float64: w . h + b at position len(prompt) - 1 + t (+ shift) of each row run alone, unpadded."""
    weight, bias = head.weight.double()[0], float(head.bias.double()[0])
    values = torch.zeros(len(prompts), width, dtype=torch.float64)
    with adapter_on(model, adapter):
        model.eval()
        for b, (prompt, completion) in enumerate(zip(prompts, completions)):
            out = model(input_ids=torch.tensor([prompt + completion]), output_hidden_states=True)
            hidden_TH = out.hidden_states[-1][0]
            # hidden_states[-1] is the final (normed) state the output layer reads: it gives the logits
            assert torch.allclose(model.get_base_model().get_output_embeddings()(hidden_TH), out.logits[0], atol=1e-5)
            for t in range(len(completion)):
                values[b, t] = float(hidden_TH[len(prompt) - 1 + t + shift].double() @ weight) + bias
    return values


def ragged_rollout(pad_id: int, seed: int = 3) -> tuple[Rollout, list[list[int]], list[list[int]]]:
    """Left-padded prompts and right-padded completions of the lengths above, random ordinary token ids."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    completions = [torch.randint(3, 300, (n,), generator=g).tolist() for n in COMPLETION_LENGTHS]
    Tp, Tc = max(PROMPT_LENGTHS), max(COMPLETION_LENGTHS)
    rollout = Rollout(
        prompt_ids_BTp=torch.tensor([[pad_id] * (Tp - len(p)) + p for p in prompts]),
        prompt_mask_BTp=torch.tensor([[0] * (Tp - len(p)) + [1] * len(p) for p in prompts]),
        completion_ids_BTc=torch.tensor([c + [pad_id] * (Tc - len(c)) for c in completions]),
        completion_mask_BTc=torch.tensor([[1] * len(c) + [0] * (Tc - len(c)) for c in completions]),
        completions=[""] * len(prompts), finish_reasons=["stop"] * len(prompts),
        temperature_B=torch.ones(len(prompts)),
    )
    return rollout, prompts, completions


def critic_with_effect(model_dir):
    """The policy with its critic; the value adapter's lora_B (0 at the start) made non-zero, so that the value
    adapter changes the hidden states, and a head with random weights."""
    _, tok, model = make_policy(model_dir)
    critic = attach_critic(model, rank=2, alpha=4, head_init_std=0.5)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # both adapters: the policy's must differ from the value adapter's
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return tok, model, critic


def test_values_read_the_state_before_each_completion_token_with_padding(tiny_model_dir):
    tok, model, critic = critic_with_effect(tiny_model_dir)
    rollout, prompts, completions = ragged_rollout(tok.pad_id)
    Tc = rollout.completion_ids_BTc.shape[1]
    expected = reference_values(model, critic.head, prompts, completions, Tc)
    # what ppo_step uses as the old values (micro-batches of 4, 3 and 1 rows: trimmed to their own widths) ...
    for micro_batch_size in (4, 3, 1):
        got = ppo_step.batched_values(critic, rollout, micro_batch_size)
        assert got.shape == expected.shape
        assert torch.allclose(got.double(), expected, atol=2e-5), (micro_batch_size, got, expected)
    # ... and what the value loss differentiates (Critic.values on the whole batch)
    with torch.no_grad(), critic.active(trainable=False):
        model.eval()
        live = critic.values(rollout.select(slice(None)))
    assert torch.allclose(live.double(), expected, atol=2e-5)
    # the check is informative: one position later, or the policy adapter's states, give other values
    real = rollout.completion_mask_BTc.bool()
    late = reference_values(model, critic.head, prompts, completions, Tc, shift=1)
    policy = reference_values(model, critic.head, prompts, completions, Tc, adapter="default")
    assert (late - expected)[real].abs().max() > 1e-2 and (policy - expected)[real].abs().max() > 1e-2


def test_a_ppo_step_computes_gae_from_the_values_at_those_positions(tiny_model_dir, tmp_path, monkeypatch):
    """A real `rlora train algo.name=ppo` step on prompts of different lengths: the values the step passes to GAE
    equal the reference values of the rollout it sampled (computed when the step computes its own, before the
    update moves the critic)."""
    seen = {}
    real_values, real_gae = ppo_step.batched_values, ppo_step.ppo_advantages

    def values_spy(critic, rollout, micro_batch_size, prefix=None, block=None):
        assert block in (None, (0, rollout.num_completions))  # one policy: all its rows
        real_ids = lambda ids, mask: [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        prompts = real_ids(rollout.prompt_ids_BTp, rollout.prompt_mask_BTp)
        completions = real_ids(rollout.completion_ids_BTc, rollout.completion_mask_BTc)
        seen["expected"] = reference_values(critic.model, critic.head, prompts, completions,
                                            rollout.completion_ids_BTc.shape[1])
        seen["prompt_lengths"] = sorted({len(p) for p in prompts})
        return real_values(critic, rollout, micro_batch_size, prefix, block)

    def gae_spy(rewards_B, values_BT, mask_BT, *args, **kwargs):
        seen["values"], seen["mask"] = values_BT.clone(), mask_BT.clone()
        return real_gae(rewards_B, values_BT, mask_BT, *args, **kwargs)

    monkeypatch.setattr(ppo_step, "batched_values", values_spy)
    monkeypatch.setattr(ppo_step, "ppo_advantages", gae_spy)
    data = tmp_path / "prompts.jsonl"
    words = ["Hi", "What is 2 + 2?", "Add three and four, then say the answer in words please.", "Count: 1 2 3"]
    data.write_text("".join(json.dumps({"prompt": w, "answer": "a"}) + "\n" for w in words))
    out = tmp_path / "run"
    assert main(["train", *tiny_overrides(tiny_model_dir, str(data), str(out), **{
        "algo.name": "ppo", "rollout.num_generations": 1, "train.prompts_per_step": 2, "train.micro_batch_size": 2,
        "rollout.max_new_tokens": 6,
        "train.steps": 1, "eval.before": "false", "eval.after": "false", "ppo.value_head_init_std": 0.5,
        "rollout.sampler_dtype": "model", "data.shuffle": "false"})]) == 0
    assert len(seen["prompt_lengths"]) > 1  # left padding was in play
    expected = seen["expected"] * seen["mask"].double()  # the step zeroes what leaves the loss
    assert seen["values"].abs().max() > 1e-3
    assert torch.allclose(seen["values"].double(), expected, atol=2e-5), (seen["values"], expected)

