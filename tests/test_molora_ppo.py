"""PPO with a MoLoRA policy: the critic's value adapter sits on the base linear map inside each MoLoRA layer, switched
off outside Critic.active(), and the mixture is off inside it. So the policy's passes and samples are the mixture's
alone, the critic's values are the base plus the value adapter alone (as beside a LoRA policy), and a run trains both
and resumes exactly."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from test_molora_grpo import PROMPTS, molora_model, molora_overrides

from rlora.cli import main
from rlora.config import ModelConfig
from rlora.models import molora as ml
from rlora.models.loading import load_base_model, load_tokenizer
from rlora.models.logprobs import completion_logprobs
from rlora.models.value_model import Critic, attach_critic
from rlora.rollout.engine import BuiltinGenerator
from rlora.types import SamplingParams


def _sample(model, tokenizer, tok):
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, min_new_tokens=6)
    return BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, merge=True).sample(model, prompts, 2, params, seed=3)


def _value_weights_moved(model) -> None:
    """Random value-adapter B (it starts at 0, i.e. as the base), so that it changes what the critic computes."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B.value." in name:
                param.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))


@pytest.mark.parametrize("router", ["sequence", "token"])
def test_the_policy_stays_the_mixture_and_the_critic_reads_the_base_with_its_value_adapter(router, tiny_model_dir):
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = molora_model(tiny_model_dir, router).eval()
    rollout = _sample(model, tokenizer, tok)
    with torch.no_grad():
        policy_before, _ = completion_logprobs(model, rollout.select(slice(None)))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}

    torch.manual_seed(0)
    critic = attach_critic(model, rank=4, alpha=8.0, head_init_std=0.1)
    _value_weights_moved(critic.model)
    peft_model = critic.model
    assert peft_model is not model and ml.has_molora(peft_model)
    # the mixture still trains; the value adapter is frozen outside the critic's passes
    assert {n.removeprefix("base_model.model.") for n, p in peft_model.named_parameters() if p.requires_grad} == trainable
    assert critic.adapter_parameters() and not any(p.requires_grad for p in critic.adapter_parameters())

    # the policy: the same log-probs and the same samples as before the critic came
    with torch.no_grad():
        policy_after, _ = completion_logprobs(peft_model, rollout.select(slice(None)))
    assert torch.equal(policy_after, policy_before)
    again = _sample(peft_model, tokenizer, tok)
    assert torch.equal(again.completion_ids_BTc, rollout.completion_ids_BTc)
    assert torch.equal(again.sampling_logp_BTc, rollout.sampling_logp_BTc)

    # the critic: the values of the plain base with a LoRA of the same weights on the same maps, and the same head
    with torch.no_grad(), critic.active(trainable=False):
        values = critic.values(rollout.select(slice(None)))
    plain = load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir).eval()
    targets = [name for name, _ in ml.molora_modules(model)]
    reference = get_peft_model(plain, LoraConfig(r=4, lora_alpha=8.0, target_modules=targets), adapter_name="value")
    weights = {n.replace(".base_layer.lora_", ".lora_"): p for n, p in peft_model.named_parameters() if ".value." in n}
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if ".value." in name:
                param.copy_(weights.pop(name))
    assert not weights  # every value weight has its place in the plain model
    reference_critic = Critic(reference, critic.head)
    with torch.no_grad(), reference_critic.active(trainable=False):
        expected = reference_critic.values(rollout.select(slice(None)))
    torch.testing.assert_close(values, expected, atol=1e-6, rtol=0)
    assert values.abs().max() > 0
    # after the critic's pass the mixture is on again and the value adapter off: the policy's log-probs once more
    with torch.no_grad():
        assert torch.equal(completion_logprobs(peft_model, rollout.select(slice(None)))[0], policy_before)


def test_a_ppo_run_of_a_molora_policy_trains_both_and_resumes_exactly(tiny_model_dir, prompts_file, tmp_path):
    """3 steps straight == 2 steps, then resumed for the 3rd: the mixture and the critic (value adapter and head) the
    same, and both moved."""
    common = {"algo.name": "ppo", "ppo.value_head_init_std": 0.1, "train.lr": 0.01, "train.checkpoint_every": 1,
              "eval.before": "false", "eval.after": "false"}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for out, steps, extra in ((straight, 3, {}), (resumed, 2, {}), (resumed, 3, {"train.resume": "auto"})):
        args = molora_overrides(tiny_model_dir, prompts_file, out, "sequence", **common, **extra,
                                **{"train.steps": steps})
        assert main(["train", *args]) == 0
    mixtures = [load_file(str(out / "adapter" / ml.WEIGHTS_FILE)) for out in (straight, resumed)]
    critics = [{**load_file(str(out / "value_model" / "adapter_model.safetensors")),
                **load_file(str(out / "value_model" / "value_head.safetensors"))} for out in (straight, resumed)]
    for one, two in (mixtures, critics):
        assert one.keys() == two.keys()
        assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-6
    assert any(float(v.abs().max()) > 0 for k, v in mixtures[0].items() if k.endswith("molora_B"))  # the mixture moved
    assert any(float(v.abs().max()) > 0 for k, v in critics[0].items() if "lora_B" in k)  # the value adapter moved
    rows = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["value_loss"] > 0 and r["aux_loss"] > 0 for r in rows)
