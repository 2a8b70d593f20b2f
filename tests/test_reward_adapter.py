"""A reward adapter of `rlora rm` as a reward function of `rlora train` (rewards: [{fn: reward_model, ...}]):
one copy of the base, the reward adapter frozen and out of the optimizer, the policy adapter active again
after scoring (also when scoring raises), scores equal to a separately loaded reward model, tokenized as
`rlora rm` tokenized its pairs, an update identical to one with a plain reward function returning the same
scores, end to end beside a rule reward, and bad input as one line with exit code 2."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from conftest import tiny_overrides
from test_policy_model import perturb_adapter
from rlora.cli import main
from rlora.config import LoraConfig, ModelConfig, RLConfig, RMDataConfig, RewardSpec, load_config
from rlora.data.pref_data import load_preference_data
from rlora.data.prompts import PromptSets
from rlora.errors import UserError
from rlora.models.loading import attach_lora, load_base_model, load_tokenizer, save_adapter, trainable_parameters
from rlora.models.reward_model import load_reward_model, new_score_head, save_reward_model, score
from rlora.rewards.reward_adapter import RewardAdapter, attach_reward_adapters
from rlora.rewards.scoring import resolve_rewards, score_completions
from rlora.train.session import prepare
from rlora.train.policies import split_metrics
from rlora.tensors import right_padded
from rlora.train.step import grpo_step
from rlora.types import Example

PROMPTS = ["What is 1 + 1?", "Say hello", "What is 3 + 4?"]
COMPLETIONS = ["2", "hello there, how are you", "The answer is 7."]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def rm_folder(tiny_model_dir, tmp_path_factory) -> str:
    """A reward model on the tiny base whose adapter and head change the scores (random lora_B and head)."""
    model = attach_lora(load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir), LoraConfig(rank=4))
    perturb_adapter(model, scale=0.05, seed=1)
    torch.manual_seed(2)
    folder = tmp_path_factory.mktemp("rm") / "reward_model"
    save_reward_model(folder, model, new_score_head(64, init_std=0.1))
    return str(folder)


def policy_with_reward_adapter(model_dir: str, folder: str, data: dict | None = None, examples=()):
    """(tokenizer, policy peft model with the reward adapter beside 'default', the RewardFn)."""
    tokenizer, tok = load_tokenizer(model_dir)
    policy = attach_lora(load_base_model(ModelConfig(path=model_dir), model_dir), LoraConfig(rank=4))
    policy.train()
    [reward] = resolve_rewards([RewardSpec(fn="reward_model", args={"path": folder})], has_task=False)
    cfg = RLConfig(model={"path": model_dir}, data={"path": "unused.jsonl", **(data or {})}, rewards=[{"fn": "format"}])
    attach_reward_adapters([reward], policy, tokenizer, tok, cfg, PromptSets(list(examples), []))
    return tokenizer, policy, reward


def reference_scores(model_dir: str, folder: str, prompts, completions, data: dict | None = None) -> list[float]:
    """The reward model loaded on its own base, pairs tokenized by `rlora rm`'s own data code."""
    tokenizer, tok = load_tokenizer(model_dir)
    rows = [{"prompt": p, "chosen": c, "rejected": "x"} for p, c in zip(prompts, completions)]
    path = Path(folder).parent / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = load_preference_data(RMDataConfig(path=str(path), **(data or {})), tokenizer, tok.eos_ids[0], 10_000).train
    model, head = load_reward_model(folder, load_base_model(ModelConfig(path=model_dir), model_dir))
    model.eval()
    with torch.no_grad():
        ids, mask = right_padded([p.chosen_ids for p in pairs], tok.pad_id)
        return score(model, head, ids, mask).tolist()


def requires_grad_by_name(model) -> dict[str, bool]:
    return {name: p.requires_grad for name, p in model.named_parameters()}


# ---- the model: one base, frozen reward adapter, policy untouched ---------------------------------------------

def test_one_copy_of_the_base_and_a_frozen_reward_adapter(tiny_model_dir, rm_folder):
    plain = load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir)
    _, policy, reward = policy_with_reward_adapter(tiny_model_dir, rm_folder)
    base = {name: p for name, p in policy.named_parameters() if "lora_" not in name}
    plain_params = list(plain.parameters())
    # as many base tensors, as many base numbers, each its own storage: one copy of the base weights
    assert len(base) == len(plain_params)
    assert sum(p.numel() for p in base.values()) == sum(p.numel() for p in plain_params)
    assert len({p.data_ptr() for p in base.values()}) == len(base)
    all_ptrs = [p.data_ptr() for p in policy.parameters()]
    assert len(all_ptrs) == len(set(all_ptrs))
    # the reward adapter sits beside the policy's, frozen; only the policy's adapter trains
    assert set(policy.peft_config) == {"default", "reward_model"} and policy.active_adapter == "default"
    reward_params = {n: p for n, p in policy.named_parameters() if ".reward_model." in n}
    assert reward_params and not any(p.requires_grad for p in reward_params.values())
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)
    assert not reward.fn.head.weight.requires_grad and not reward.fn.head.bias.requires_grad


def test_scores_equal_a_separately_loaded_reward_model_and_the_policy_is_unchanged(tiny_model_dir, rm_folder):
    tokenizer, policy, reward = policy_with_reward_adapter(tiny_model_dir, rm_folder)
    ids = tokenizer(["What is 2 + 2? 4", "hi"], return_tensors="pt", padding=True)
    policy.eval()
    with torch.no_grad():
        logits_before = policy(**ids).logits
    policy.train()
    grads, modes = requires_grad_by_name(policy), [m.training for m in policy.modules()]

    scores = reward.fn(PROMPTS, COMPLETIONS)
    expected = reference_scores(tiny_model_dir, rm_folder, PROMPTS, COMPLETIONS)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), atol=1e-6, rtol=0)
    assert len(set(scores)) == 3  # the completions do score differently (the comparison is not vacuous)

    assert policy.active_adapter == "default"
    assert requires_grad_by_name(policy) == grads and [m.training for m in policy.modules()] == modes
    policy.eval()
    with torch.no_grad():
        assert torch.equal(policy(**ids).logits, logits_before)
        # and the policy without any reward adapter computes the same (the extra adapter is inert)
        plain = attach_lora(load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir), LoraConfig(rank=4))
        plain.load_state_dict({k: v for k, v in policy.state_dict().items() if ".reward_model." not in k}, strict=False)
        assert torch.equal(plain.eval()(**ids).logits, logits_before)


def test_small_scoring_batches_give_the_same_scores(tiny_model_dir, rm_folder):
    _, _, reward = policy_with_reward_adapter(tiny_model_dir, rm_folder)
    whole = reward.fn(PROMPTS, COMPLETIONS)
    reward.fn.batch_size = 1
    torch.testing.assert_close(torch.tensor(reward.fn(PROMPTS, COMPLETIONS)), torch.tensor(whole), atol=1e-6, rtol=0)


def test_failing_score_switches_back_to_the_policy(tiny_model_dir, rm_folder, monkeypatch):
    import rlora.rewards.reward_adapter as reward_adapter

    _, policy, reward = policy_with_reward_adapter(tiny_model_dir, rm_folder)
    grads, modes = requires_grad_by_name(policy), [m.training for m in policy.modules()]
    seen = {}

    def broken(model, *args):
        seen["active"], seen["training"] = model.active_adapter, model.training
        raise RuntimeError("out of memory")

    monkeypatch.setattr(reward_adapter, "score", broken)  # the name the reward adapter calls
    with pytest.raises(RuntimeError, match="out of memory"):
        reward.fn(PROMPTS, COMPLETIONS)
    assert seen == {"active": "reward_model", "training": False}  # it did switch, in eval mode
    assert policy.active_adapter == "default"
    assert requires_grad_by_name(policy) == grads and [m.training for m in policy.modules()] == modes
    # through score_completions: every sample fails (one by one too), recorded, and the run's state is intact
    scores = score_completions([reward], PROMPTS, COMPLETIONS, {})
    assert scores.failed_B.all() and "out of memory" in scores.errors[0]
    assert policy.active_adapter == "default" and requires_grad_by_name(policy) == grads


def test_saved_policy_adapter_equals_the_policy_weights(tiny_model_dir, rm_folder, tmp_path):
    from safetensors.torch import load_file

    _, policy, _ = policy_with_reward_adapter(tiny_model_dir, rm_folder)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name and ".default." in name:
                param.fill_(0.01)
    save_adapter(policy, tmp_path / "adapter")
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    policy_weights = {n: p for n, p in policy.named_parameters() if ".default." in n}
    assert len(saved) == len(policy_weights)
    assert all(torch.all(v == 0.01) for k, v in saved.items() if "lora_B" in k)


def test_saved_policy_adapter_holds_only_the_policy(tiny_model_dir, rm_folder, tmp_path):
    """peft would write the reward adapter into a subfolder of the policy's adapter folder."""
    _, policy, _ = policy_with_reward_adapter(tiny_model_dir, rm_folder)
    save_adapter(policy, tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir() if p.suffix != ".md") == [
        "adapter_config.json", "adapter_model.safetensors"]
    policy.save_pretrained(str(tmp_path / "both"), selected_adapters=["default", "reward_model"])  # still possible
    assert (tmp_path / "both" / "reward_model" / "adapter_model.safetensors").is_file()


# ---- tokenization: as `rlora rm` built its pairs -------------------------------------------------------------

def test_sequences_are_tokenized_as_rm_pairs(tiny_model_dir, rm_folder):
    example = Example(prompt=CHAT, columns={})
    text = "Be brief.\nSay hello"  # what reward functions get as the prompt of a chat-message example
    tokenizer, _, reward = policy_with_reward_adapter(tiny_model_dir, rm_folder, {"system_prompt": "Sys"}, [example])
    _, tok = load_tokenizer(tiny_model_dir)
    [chat_ids, plain_ids] = reward.fn.sequences([text, "What is 1 + 1?"], ["hi", "2"])
    # the chat example is rendered from its messages (its own system message kept), the text prompt gets the
    # run's system prompt, both with the completion as the assistant turn
    assert tokenizer.decode(chat_ids) == tokenizer.apply_chat_template(CHAT + [{"role": "assistant", "content": "hi"}],
                                                                       tokenize=False)
    rows = [{"prompt": CHAT, "chosen": "hi", "rejected": "x"},
            {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "x"}]
    path = Path(rm_folder).parent / "chat_pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = load_preference_data(RMDataConfig(path=str(path), system_prompt="Sys"), tokenizer, tok.eos_ids[0], 10_000)
    assert [p.chosen_ids for p in pairs.train] == [chat_ids, plain_ids]


def test_a_checkpoints_reward_model_reads_its_format_from_the_checkpoint(rm_folder, tmp_path):
    """A checkpoint's reward_model/ (rlora rm with train.checkpoint_every) has no config.yaml beside it: the format
    comes from the checkpoint's state.json, which holds the run's config."""
    checkpoint = tmp_path / "run" / "checkpoints" / "step-0000002"
    shutil.copytree(rm_folder, checkpoint / "reward_model")
    config = yaml.safe_dump({"data": {"path": "p.jsonl", "chosen_column": "chosen", "use_chat_template": False,
                                      "system_prompt": "Judge."}})
    (checkpoint / "state.json").write_text(json.dumps({"command": "rm", "step": 2, "train_s": 1.0, "config": config}))
    [spec] = [RewardSpec(fn="reward_model", args={"path": str(checkpoint / "reward_model")})]
    assert RewardAdapter.from_spec(spec, "reward_model", 0).trained_format() == {"use_chat_template": False,
                                                                                  "system_prompt": "Judge."}


def test_the_reward_models_own_prompt_format_is_used(tiny_model_dir, rm_folder, tmp_path):
    """The `rlora rm` run's config.yaml beside the folder says how its pairs were rendered; args override it."""
    run = tmp_path / "rm_run"
    shutil.copytree(rm_folder, run / "reward_model")
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"path": "p.jsonl", "chosen_column": "chosen",
                                                              "use_chat_template": False, "system_prompt": None}}))
    folder = str(run / "reward_model")
    _, _, reward = policy_with_reward_adapter(tiny_model_dir, folder)  # the policy run uses the chat template
    assert (reward.fn.format.use_chat_template, reward.fn.format.system_prompt) == (False, None)
    scores = reward.fn(PROMPTS, COMPLETIONS)
    expected = reference_scores(tiny_model_dir, folder, PROMPTS, COMPLETIONS, {"use_chat_template": False})
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), atol=1e-6, rtol=0)

    [spec] = [RewardSpec(fn="reward_model", args={"path": folder, "use_chat_template": True, "system_prompt": "S"})]
    adapter = RewardAdapter.from_spec(spec, "reward_model", 0)
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    policy = attach_lora(load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir), LoraConfig(rank=4))
    data = RLConfig(data={"path": "x"}, rewards=[{"fn": "format"}]).data  # the policy run: chat template, no system
    adapter.attach(policy, tokenizer, tok.pad_id, tok.eos_ids[0], data, 8, [])
    assert (adapter.format.use_chat_template, adapter.format.system_prompt) == (True, "S")


# ---- training: the update, the optimizer, end to end -------------------------------------------------------

def replay_scores(prompts, completions, table, **_columns):
    """A plain reward function returning recorded scores (by prompt and completion)."""
    recorded = json.loads(Path(table).read_text())
    return [recorded[f"{p}\x00{c}"] for p, c in zip(prompts, completions)]


def one_step(model_dir, prompts_file, out: Path, rewards: str) -> Path:
    args = tiny_overrides(model_dir, prompts_file, str(out), rewards=rewards, **{
        "train.steps": 1, "eval.before": "false", "eval.after": "false", "train.lr": 0.05})
    assert main(["train", *args]) == 0
    return out


def test_update_equals_one_with_a_plain_function_returning_the_same_scores(tiny_model_dir, rm_folder, prompts_file,
                                                                          tmp_path):
    from safetensors.torch import load_file

    with_adapter = one_step(tiny_model_dir, prompts_file, tmp_path / "a",
                            f"[{{fn: reward_model, args: {{path: {rm_folder}}}}}, {{fn: rewards_for_tests.count_a}}]")
    samples = [json.loads(line) for line in (with_adapter / "samples.jsonl").read_text().splitlines()]
    table = {f"{s['prompt']}\x00{s['completion']}": s["reward/reward_model"] for s in samples}
    assert len(set(table.values())) > 1
    (tmp_path / "table.json").write_text(json.dumps(table))
    plain = one_step(tiny_model_dir, prompts_file, tmp_path / "b",
                     f"[{{fn: test_reward_adapter.replay_scores, args: {{table: {tmp_path / 'table.json'}}}}}, "
                     "{fn: rewards_for_tests.count_a}]")
    a = load_file(str(with_adapter / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(plain / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)  # the update did move the adapter


def test_reward_adapter_is_not_in_the_optimizer_and_stays_frozen(tiny_model_dir, rm_folder, prompts_file, tmp_path):
    args = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"), rewards=(
        f"[{{fn: reward_model, args: {{path: {rm_folder}}}, weight: 0.5}}, {{fn: rewards_for_tests.count_a}}]"),
        **{"eval.before": "false"})
    s = prepare(load_config(None, args))
    [policy] = s.policies  # the run's optimizer, as prepare built it
    in_optimizer = {id(p) for group in policy.optimizer.param_groups for p in group["params"]}
    reward_params = [p for n, p in s.model.named_parameters() if ".reward_model." in n]
    assert reward_params and not any(id(p) in in_optimizer for p in reward_params)
    before = [p.detach().clone() for p in reward_params]
    metrics, _ = grpo_step(s, 0)
    metrics, _ = split_metrics(metrics, s.policies)
    assert metrics["reward/reward_model"] is not None and metrics["reward/count_a"] is not None
    assert s.model.active_adapter == "default" and s.model.training
    assert not any(p.requires_grad for p in reward_params)
    assert all(torch.equal(p, q) for p, q in zip(reward_params, before))
    assert {id(p) for p in trainable_parameters(s.model)} == in_optimizer


def test_the_value_and_reward_heads_are_made_on_the_runs_device(tiny_model_dir, rm_folder, prompts_file, tmp_path,
                                                               monkeypatch):
    """train.fsdp loads the base on the CPU and moves it to the run's device only as it shards it, after the heads
    are made; the heads sit beside the model, so a head made where the model was stayed on the CPU (on a GPU, PPO or
    a reward model under train.fsdp would have failed at its first value or score). prepare() makes them on the
    run's device. "meta" stands in for a GPU the model is not on (train.fsdp=false here: load_base_model resolves
    the device itself and keeps the model on the CPU)."""
    import rlora.train.session as session
    from rlora.models.loading import model_device

    monkeypatch.setattr(session, "resolve_device", lambda _name: torch.device("meta"))
    args = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"), rewards=(
        f"[{{fn: reward_model, args: {{path: {rm_folder}}}}}]"), **{"algo.name": "ppo", "rollout.sampler_dtype": "model"})
    s = prepare(load_config(None, args))
    [reward] = [r for r in s.rewards if isinstance(r.fn, RewardAdapter)]
    assert model_device(s.model).type == "cpu"
    heads = [s.critics[0].head, reward.fn.head]
    assert [p.device.type for head in heads for p in head.parameters()] == ["meta"] * 4


def test_frozen_lower_layers_stay_shared_beside_a_reward_adapter(tiny_model_dir, rm_folder, prompts_file, tmp_path):
    """Policy on the top layer only, reward adapter on every layer: the lower layer is still shared (the reward
    adapter is never active in a log-prob pass), and the shared path computes what the plain forward does."""
    from rlora.models.frozen_prefix import FrozenPrefix
    from rlora.train.step_batch import step_params
    from rlora.train.update import batched_logprobs

    args = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"), rewards=(
        f"[{{fn: reward_model, args: {{path: {rm_folder}}}}}]"), **{"lora.top_layers": 1})
    s = prepare(load_config(None, args))
    assert s.num_frozen == 1
    assert any(".layers.0." in n for n, _ in s.model.named_parameters() if ".reward_model." in n)
    with torch.no_grad():
        for name, param in s.model.named_parameters():
            if "lora_B" in name and ".default." in name:
                param.fill_(0.02)  # a policy that differs from the base
    rollout = s.generator.sample(s.model, s.train_ids[:2], 4, step_params(s.cfg, 0), seed=0)
    shared = batched_logprobs(s.model, rollout, 4, 256, FrozenPrefix(s.model, rollout, s.num_frozen, 4))
    torch.testing.assert_close(shared, batched_logprobs(s.model, rollout, 4, 256), atol=1e-5, rtol=0)


def test_train_end_to_end_with_a_reward_adapter_and_a_rule_reward(tiny_model_dir, rm_folder, prompts_file, tmp_path,
                                                                   capsys):
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, prompts_file, str(out), rewards=(
        f"[{{fn: reward_model, args: {{path: {rm_folder}}}, weight: 0.5}}, {{fn: rewards_for_tests.count_a}}]"),
        **{"train.checkpoint_every": 1, "eval.before": "false"})
    code = main(["train", *args])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["reward/reward_model"] is not None and r["reward/count_a"] is not None for r in rows)
    assert all(r["reward_failures"] == 0 for r in rows)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 16
    for s in samples:  # the weighted sum of both rewards
        assert s["reward"] == pytest.approx(0.5 * s["reward/reward_model"] + s["reward/count_a"], abs=1e-9)
    assert json.loads((out / "eval.json").read_text())["after"]["n"] == 4
    for folder in (out / "adapter", out / "checkpoints" / "step-0000002" / "adapter"):  # the policy's alone
        assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
        assert (folder / "adapter_model.safetensors").is_file() and not [p for p in folder.iterdir() if p.is_dir()]


# ---- bad input: one line, exit code 2, before the model loads --------------------------------------------------

def _broken_copy(rm_folder: str, tmp_path: Path, edit) -> str:
    folder = tmp_path / "broken" / "reward_model"
    shutil.copytree(rm_folder, folder)
    edit(folder)
    return str(folder)


def _set_base(folder: Path) -> None:
    meta = json.loads((folder / "reward_model.json").read_text())
    (folder / "reward_model.json").write_text(json.dumps({**meta, "base_model": "/models/another-base"}))


def _truncate(name: str):
    def edit(folder: Path) -> None:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) // 2])
    return edit


BAD = [
    ("no path", lambda f, t: "{fn: reward_model}", "needs args.path"),
    ("unknown arg", lambda f, t: f"{{fn: reward_model, args: {{path: {f}, pth: x}}}}", "unknown args.pth"),
    ("missing folder", lambda f, t: f"{{fn: reward_model, args: {{path: {t / 'nope'}}}}}", "is not a folder"),
    ("missing relative folder", lambda f, t: "{fn: reward_model, args: {path: runs/nope/reward_model}}",
     "is not a folder (the folder `rlora rm` wrote (OUTPUT/reward_model), relative to the current folder "),
    ("plain adapter folder", lambda f, t: "{fn: reward_model, args: {path: " + _broken_copy(
        f, t, lambda d: (d / "reward_model.json").unlink()) + "}}", "is not a reward model folder"),
    ("other base", lambda f, t: "{fn: reward_model, args: {path: " + _broken_copy(f, t, _set_base) + "}}",
     "was trained on base '/models/another-base'"),
    ("damaged adapter", lambda f, t: "{fn: reward_model, args: {path: " + _broken_copy(
        f, t, _truncate("adapter_model.safetensors")) + "}}", "is damaged"),
    ("damaged head", lambda f, t: "{fn: reward_model, args: {path: " + _broken_copy(
        f, t, _truncate("score_head.safetensors")) + "}}", "score_head.safetensors is damaged"),
    ("bad batch size", lambda f, t: f"{{fn: reward_model, args: {{path: {f}, batch_size: 0}}}}",
     "args.batch_size must be a positive integer"),
]


@pytest.mark.parametrize("name, make, message", BAD, ids=[b[0] for b in BAD])
def test_bad_reward_model_is_one_line_exit_2(name, make, message, tiny_model_dir, rm_folder, prompts_file, tmp_path,
                                             capsys, monkeypatch):
    import rlora.train.session as session

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load for bad input")

    monkeypatch.setattr(session, "load_base_model", no_model)
    rewards = f"[{make(rm_folder, tmp_path)}, {{fn: rewards_for_tests.count_a}}]"
    code = main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"), rewards=rewards)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlora: error:")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_reward_model_for_another_hidden_size_is_one_line(tiny_model_dir, rm_folder, tmp_path, capsys):
    """Recorded as this base, but built for another width: refused when it is loaded (before training)."""
    def other_width(folder: Path) -> None:
        meta = json.loads((folder / "reward_model.json").read_text())
        (folder / "reward_model.json").write_text(json.dumps({**meta, "hidden_size": 32}))
        from safetensors.torch import save_file
        save_file({"weight": torch.zeros(1, 32), "bias": torch.zeros(1)}, str(folder / "score_head.safetensors"))

    folder = _broken_copy(rm_folder, tmp_path, other_width)
    with pytest.raises(UserError, match="built for a base with hidden size 32"):
        policy_with_reward_adapter(tiny_model_dir, folder)


@pytest.fixture(scope="module")
def policy_folder(tiny_model_dir, tmp_path_factory) -> str:
    """A LoRA policy on the tiny base that changes the samples (random lora_B)."""
    model = attach_lora(load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir), LoraConfig(rank=4))
    perturb_adapter(model, scale=0.3, seed=5)
    folder = tmp_path_factory.mktemp("policy") / "adapter"
    save_adapter(model, folder)
    return str(folder)


def test_rlora_eval_scores_with_a_reward_adapter(tiny_model_dir, rm_folder, policy_folder, prompts_file, tmp_path):
    """`rlora eval` of the base and a policy adapter with a reward adapter beside them: every completion's reward
    is what the reward model loaded alone scores (1e-5), also for the base's completions (sampled with every
    adapter off, scored with the reward adapter on), and the completions are those of the same evaluation with a
    rule reward: the reward adapter is never on while sampling."""
    rm_reward = f"[{{fn: reward_model, args: {{path: {rm_folder}}}}}]"
    outs = {}
    for label, rewards in (("rm", rm_reward), ("rule", "[{fn: rewards_for_tests.count_a}]")):
        outs[label] = tmp_path / label
        args = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "unused"), rewards=rewards,
                              **{"eval.max_new_tokens": 6, "eval.temperature": 1.0, "eval.num_samples": 2})
        assert main(["eval", *args, "--adapter", f"pol={policy_folder}", "--output", str(outs[label])]) == 0
    for name in ("base", "pol"):
        rows = {label: [json.loads(line) for line in (out / f"samples_{name}.jsonl").read_text().splitlines()]
                for label, out in outs.items()}
        assert [r["completion"] for r in rows["rm"]] == [r["completion"] for r in rows["rule"]]
        expected = reference_scores(tiny_model_dir, rm_folder, [r["prompt"] for r in rows["rm"]],
                                    [r["completion"] for r in rows["rm"]])
        assert [r["reward"] for r in rows["rm"]] == pytest.approx(expected, abs=1e-5)
        report = json.loads((outs["rm"] / "eval.json").read_text())["results"][name]
        assert report["reward_mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    base, pol = ([r["completion"] for r in map(json.loads, (outs["rm"] / f"samples_{n}.jsonl").read_text().splitlines())]
                 for n in ("base", "pol"))
    assert base != pol  # the policy adapter is on for its candidate (and off for the base)


def test_rlora_eval_of_the_base_alone_with_a_reward_adapter(tiny_model_dir, rm_folder, prompts_file, tmp_path):
    """No candidate adapter: the reward adapter wraps the plain base in a peft model; the base's samples are those
    of the base with a rule reward, and the rewards those of the reward model alone."""
    outs = {}
    for label, rewards in (("rm", f"[{{fn: reward_model, args: {{path: {rm_folder}}}}}]"),
                           ("rule", "[{fn: rewards_for_tests.count_a}]")):
        outs[label] = tmp_path / label
        args = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "unused"), rewards=rewards,
                              **{"eval.max_new_tokens": 6, "eval.temperature": 1.0})  # greedy: an empty completion
        assert main(["eval", *args, "--output", str(outs[label])]) == 0
    rows = {label: [json.loads(line) for line in (out / "samples_base.jsonl").read_text().splitlines()]
            for label, out in outs.items()}
    assert [r["completion"] for r in rows["rm"]] == [r["completion"] for r in rows["rule"]]
    expected = reference_scores(tiny_model_dir, rm_folder, [r["prompt"] for r in rows["rm"]],
                                [r["completion"] for r in rows["rm"]])
    assert [r["reward"] for r in rows["rm"]] == pytest.approx(expected, abs=1e-5)


def test_a_reward_model_is_refused_where_a_policy_adapter_is_expected(tiny_model_dir, rm_folder, tmp_path, capsys):
    """chat --adapter, merge and lora.init_from took a reward model's folder as a policy (its score head dropped)."""
    from rlora.models.loading import check_adapter_folder

    for args in (["merge", rm_folder, "-o", str(tmp_path / "merged")],
                 ["merge", str(Path(rm_folder).parent), "-o", str(tmp_path / "merged")],  # its run folder
                 ["train", f"model.path={tiny_model_dir}", f"lora.init_from={rm_folder}",
                  f"train.output_dir={tmp_path / 'run'}"]):
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert "is a reward model (it holds reward_model.json), not a policy adapter: score with it through " \
               "`rewards: [{fn: reward_model" in err and err.count("\n") == 1, err
    assert not (tmp_path / "merged").exists() and not (tmp_path / "run").exists()
    check_adapter_folder(rm_folder, key="reward model")  # where a reward model is asked for, it is one
    # rlora rm would put a new score head on its LoRA: the hint to score with it does not fit there
    from test_rm import PAIRS, rm_config, write_jsonl
    config = rm_config(tmp_path, tiny_model_dir, write_jsonl(tmp_path / "pairs.jsonl", PAIRS))
    assert main(["rm", config, f"lora.init_from={rm_folder}"]) == 2
    err = capsys.readouterr().err
    assert "is a reward model (it holds reward_model.json), not a policy adapter: rlora rm starts a new score " \
           "head, so it cannot continue a reward model" in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()
