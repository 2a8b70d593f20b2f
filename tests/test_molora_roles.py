"""The other roles beside a MoLoRA policy (models/beside_mixture.py): PPO's value adapter and a reward adapter sit on
the base linear map inside each MoLoRA layer, switched off outside their own passes, and the mixture is off inside
them. So the policy's passes and samples are the mixture's alone, the critic's values and the reward model's scores
are the base plus that adapter alone (as beside a LoRA policy), and a run trains both and resumes exactly."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from test_molora_grpo import MOLORA, PROMPTS, molora_model, molora_overrides
from test_reward_adapter import COMPLETIONS, reference_scores, rm_folder  # noqa: F401 - a fixture
from test_reward_adapter import PROMPTS as RM_PROMPTS

from conftest import tiny_overrides
from rlora.cli import main
from rlora.config import LoraConfig as RunLoraConfig
from rlora.config import ModelConfig
from rlora.models import molora as ml
from rlora.models.loading import attach_lora, load_base_model, load_tokenizer
from rlora.models.molora import MoLoRAConfig
from rlora.models.logprobs import completion_logprobs
from rlora.data.prompts import PromptSets
from rlora.config import RewardSpec, RLConfig
from rlora.models.value_model import Critic, attach_critic, load_value_model
from rlora.rewards.reward_adapter import attach_reward_adapters
from rlora.rewards.scoring import resolve_rewards
from rlora.rollout.engine import BuiltinGenerator
from rlora.types import SamplingParams


def _sample(model, tokenizer, tok):
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, min_new_tokens=6)
    return BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, merge=True).sample(model, prompts, 2, params, seed=3)


def _mixture(model_dir, router, targets):
    """molora_model's mixture on the maps `targets` selects."""
    if targets == "all-linear":
        return molora_model(model_dir, router).eval()
    torch.manual_seed(0)
    model = load_base_model(ModelConfig(path=model_dir), model_dir)
    ml.attach_molora(model, MoLoRAConfig(**{**MOLORA, "rank": 2}, router=router, target_modules=targets))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("molora_B"):
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    return model.eval()


def _value_weights_moved(model) -> None:
    """Random value-adapter B (it starts at 0, i.e. as the base), so that it changes what the critic computes."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B.value." in name:
                param.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))


def _plain_base_values(model_dir, critic: Critic, rollout) -> torch.Tensor:
    """The values of the plain base (no mixture) with a LoRA of the critic's value weights on the same maps, and the
    critic's head: what the critic beside a mixture must compute."""
    plain = load_base_model(ModelConfig(path=model_dir), model_dir).eval()
    targets = [name.removesuffix(".base_layer") for name in critic.model.peft_config[critic.adapter_name].target_modules]
    config = critic.model.peft_config[critic.adapter_name]
    reference = get_peft_model(plain, LoraConfig(r=config.r, lora_alpha=config.lora_alpha, target_modules=targets),
                               adapter_name=critic.adapter_name)
    weights = {n.replace(".base_layer.lora_", ".lora_"): p for n, p in critic.model.named_parameters()
               if f".{critic.adapter_name}." in n}
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if f".{critic.adapter_name}." in name:
                param.copy_(weights.pop(name))
    assert not weights  # every value weight has its place in the plain model
    reference_critic = Critic(reference, critic.head, critic.adapter_name)
    with torch.no_grad(), reference_critic.active(trainable=False):
        return reference_critic.values(rollout.select(slice(None)))


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
    expected = _plain_base_values(tiny_model_dir, critic, rollout)
    torch.testing.assert_close(values, expected, atol=1e-6, rtol=0)
    assert values.abs().max() > 0
    # after the critic's pass the mixture is on again and the value adapter off: the policy's log-probs once more
    with torch.no_grad():
        assert torch.equal(completion_logprobs(peft_model, rollout.select(slice(None)))[0], policy_before)


def test_a_ppo_run_of_a_molora_policy_with_a_reward_model_trains_both_and_resumes_exactly(tiny_model_dir, rm_folder,
                                                                                        prompts_file, tmp_path):
    """A reward model among the rewards; 3 steps straight == 2 steps, then resumed for the 3rd: the same mixture and
    critic (value adapter and head), both moved; every logged sample's reward-model score is the reward model's own
    on that completion; the value model is saved under the plain base's names."""
    rewards = f"[{{fn: reward_model, args: {{path: {rm_folder}}}}}, {{fn: rewards_for_tests.char_count}}]"
    common = {"algo.name": "ppo", "rewards": rewards, "ppo.value_head_init_std": 0.1, "train.lr": 0.01,
              "train.checkpoint_every": 1, "eval.before": "false", "eval.after": "false"}
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
    assert not any("base_layer" in k for k in critics[0])
    assert "base_layer" not in (straight / "value_model" / "adapter_config.json").read_text()
    rows = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["value_loss"] > 0 and r["aux_loss"] > 0 for r in rows)
    samples = [json.loads(line) for line in (straight / "samples.jsonl").read_text().splitlines()]
    assert samples == [json.loads(line) for line in (resumed / "samples.jsonl").read_text().splitlines()]
    expected = reference_scores(tiny_model_dir, rm_folder, [s["prompt"] for s in samples],
                                [s["completion"] for s in samples])
    torch.testing.assert_close(torch.tensor([s["reward/reward_model"] for s in samples]), torch.tensor(expected),
                               atol=1e-5, rtol=0)


def test_a_saved_value_model_loads_beside_a_mixture_and_beside_a_lora_policy(tiny_model_dir, tmp_path):
    """Saved under the plain base's names, a critic made beside a mixture loads back beside a fresh mixture and beside
    a LoRA policy, and computes the same values in each (the base plus the value adapter); the mixture it loads
    beside computes what it computed without it."""
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = molora_model(tiny_model_dir, "token").eval()
    rollout = _sample(model, tokenizer, tok)
    torch.manual_seed(0)
    critic = attach_critic(model, rank=4, alpha=8.0, head_init_std=0.1)
    _value_weights_moved(critic.model)
    with torch.no_grad(), critic.active(trainable=False):
        values = critic.values(rollout.select(slice(None)))
    critic.save(tmp_path / "vm")

    fresh = molora_model(tiny_model_dir, "token").eval()
    with torch.no_grad():
        policy_before, _ = completion_logprobs(fresh, rollout.select(slice(None)))
    beside_mixture = load_value_model(tmp_path / "vm", fresh)
    lora_policy = attach_lora(load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir), RunLoraConfig(rank=4))
    beside_lora = load_value_model(tmp_path / "vm", lora_policy)
    for loaded in (beside_mixture, beside_lora):
        loaded.model.eval()
        with torch.no_grad(), loaded.active(trainable=False):
            # the same function; another module nesting (a LoRA layer inside a MoLoRA one, or not) may round apart
            torch.testing.assert_close(loaded.values(rollout.select(slice(None))), values, atol=1e-6, rtol=0)
    with torch.no_grad():
        assert torch.equal(completion_logprobs(beside_mixture.model, rollout.select(slice(None)))[0], policy_before)


@pytest.mark.parametrize("router, targets", [("sequence", "all-linear"), ("token", ["q_proj", "v_proj"])])
def test_a_reward_adapter_beside_a_molora_policy_scores_as_the_reward_model_alone(router, targets, tiny_model_dir,
                                                                                   rm_folder):
    """The reward model (on every linear map; the mixture on all of them or on q/v only) scores as the reward model
    loaded on its own base (1e-6); the policy's log-probs and samples are bit-equal before and after the reward
    adapter came, and after it scored; a critic added beside both computes the plain base's values with its own
    adapter alone."""
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = _mixture(tiny_model_dir, router, targets)
    rollout = _sample(model, tokenizer, tok)
    with torch.no_grad():
        policy_before, _ = completion_logprobs(model, rollout.select(slice(None)))
    [reward] = resolve_rewards([RewardSpec(fn="reward_model", args={"path": rm_folder})], has_task=False)
    cfg = RLConfig(model={"path": tiny_model_dir}, data={"path": "unused.jsonl"}, rewards=[{"fn": "format"}])
    with_reward = attach_reward_adapters([reward], model, tokenizer, tok, cfg, PromptSets([], []))
    assert with_reward is not model and ml.has_molora(with_reward)
    scores = reward.fn(RM_PROMPTS, COMPLETIONS)
    expected = reference_scores(tiny_model_dir, rm_folder, RM_PROMPTS, COMPLETIONS)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), atol=1e-6, rtol=0)
    assert len(set(scores)) == 3  # the completions do score differently
    with torch.no_grad():
        assert torch.equal(completion_logprobs(with_reward, rollout.select(slice(None)))[0], policy_before)
    again = _sample(with_reward, tokenizer, tok)
    assert torch.equal(again.completion_ids_BTc, rollout.completion_ids_BTc)
    assert torch.equal(again.sampling_logp_BTc, rollout.sampling_logp_BTc)

    torch.manual_seed(0)
    critic = attach_critic(with_reward, rank=4, alpha=8.0, head_init_std=0.1)
    assert critic.model is with_reward  # added to the peft model the reward adapter made
    _value_weights_moved(with_reward)
    with torch.no_grad(), critic.active(trainable=False):
        values = critic.values(rollout.select(slice(None)))
    torch.testing.assert_close(values, _plain_base_values(tiny_model_dir, critic, rollout), atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(reward.fn(RM_PROMPTS, COMPLETIONS)), torch.tensor(expected), atol=1e-6,
                               rtol=0)
    with torch.no_grad():
        assert torch.equal(completion_logprobs(with_reward, rollout.select(slice(None)))[0], policy_before)


def test_rlora_eval_scores_a_molora_candidate_and_the_base_with_a_reward_model(tiny_model_dir, rm_folder, prompts_file,
                                                                              tmp_path, capsys):
    """`rlora eval` with a MoLoRA folder beside the base and a reward model among the rewards: each candidate samples
    what it samples without the reward model (the mixture on for 'mix', off for 'base'), and every sample's score is
    the reward model's own on that completion."""
    folder = tmp_path / "molora"
    ml.save_molora(molora_model(tiny_model_dir, "sequence"), folder)
    outs = {}
    for label, rewards in (("rule", "[{fn: rewards_for_tests.char_count}]"),
                           ("rm", f"[{{fn: reward_model, args: {{path: {rm_folder}}}}}]")):
        outs[label] = tmp_path / label
        # sampled, not greedy: the tiny base's greedy completions are blank, which `rlora rm`'s pairs cannot hold
        args = ["eval", *tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "unused"), rewards=rewards,
                                        **{"eval.temperature": 1.0, "eval.num_samples": 2}),
                "--adapter", f"mix={folder}", "--output", str(outs[label])]
        assert main(args) == 0, capsys.readouterr().err
    for name in ("base", "mix"):
        rows = {label: [json.loads(x) for x in (out / f"samples_{name}.jsonl").read_text().splitlines()]
                for label, out in outs.items()}
        assert [r["completion"] for r in rows["rm"]] == [r["completion"] for r in rows["rule"]], name
        scored = [r for r in rows["rm"] if r["completion"].strip()]  # `rlora rm`'s pairs cannot hold an empty response
        assert len(scored) >= 4, name
        expected = reference_scores(tiny_model_dir, rm_folder, [r["prompt"] for r in scored],
                                    [r["completion"] for r in scored])
        assert [r["reward"] for r in scored] == pytest.approx(expected, abs=1e-5), name
    completions = {name: (outs["rm"] / f"samples_{name}.jsonl").read_text() for name in ("base", "mix")}
    assert completions["base"] != completions["mix"]


def test_a_pattern_that_would_match_the_routers_places_the_adapter_on_the_maps_alone(tiny_model_dir):
    """A saved adapter's target_modules may be a regex (peft allows one): the MoLoRA routers (nn.Linear too) stay the
    mixture's, and each MoLoRA map gets the adapter on its base map."""
    from rlora.models.beside_mixture import add_beside_mixture

    model = molora_model(tiny_model_dir, "token")
    routers = {name: p.detach().clone() for name, p in model.named_parameters() if "molora_router" in name}
    wrapped = add_beside_mixture(model, LoraConfig(r=2, target_modules=r".*self_attn.*"), "other")
    placed = wrapped.peft_config["other"].target_modules
    assert placed and all(name.endswith("_proj.base_layer") and ".self_attn." in name for name in placed)
    assert {n.removeprefix("base_model.model."): p for n, p in wrapped.named_parameters() if "molora_router" in n
            }.keys() == routers.keys()
