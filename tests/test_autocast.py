"""train.autocast: the trainer's passes under bf16 autocast on a bfloat16 base (float32 adapters), against the
same passes in the model's own precision: the GRPO loss and gradient change by bf16 rounding only, the passes
keep less for backward, and a run resolves `auto` from the machine (bf16 only where it is native)."""

import pytest
import torch
import yaml
from conftest import tiny_overrides
from test_machine import BF16, NO_BF16
from test_policy_model import perturb_adapter, sample, vary_lengths

from rlora import machine
from rlora.algos.advantages import per_token
from rlora.algos.registry import get_algorithm
from rlora.cli import main
from rlora.config import AlgoConfig, LoraConfig, ModelConfig, load_config
from rlora.models.adapters import reference_policy
from rlora.models.loading import attach_lora, load_base_model, load_tokenizer, trainable_parameters
from rlora.models.precision import SavedForBackward, trainer_precision
from rlora.train.session import resolve_machine_settings
from rlora.train.update import ScoredRollout, accumulate_policy_gradient, batched_logprobs


def _bf16_policy(model_dir):
    tokenizer, tok = load_tokenizer(model_dir)
    base = load_base_model(ModelConfig(path=model_dir, dtype="bfloat16"), model_dir)
    model = attach_lora(base, LoraConfig(rank=4, alpha=8))
    perturb_adapter(model, scale=0.3)
    return tokenizer, tok, model


def _update(model, rollout, autocast: str) -> tuple[dict, torch.Tensor, SavedForBackward]:
    """One GRPO update (beta 0.04: the reference pass too) -> its metrics, the flat gradient, and the distinct
    storages the autograd graph kept for backward (their bytes, in all and by dtype)."""
    model.zero_grad()
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.3, 0.0, -0.3, 0.2])
    with trainer_precision(model, autocast):
        with reference_policy(model):
            ref = batched_logprobs(model, rollout, 8)
        scored = ScoredRollout(rollout, per_token(advantages, rollout.completion_mask_BTc), rollout.completion_mask_BTc,
                               None, ref)
        with SavedForBackward() as kept:
            metrics = accumulate_policy_gradient(model, get_algorithm("grpo"), AlgoConfig(beta=0.04), scored, 8, 6)
    gradient = torch.cat([p.grad.flatten() for p in trainable_parameters(model)])
    return metrics, gradient, kept


def test_bf16_autocast_changes_the_update_by_rounding_and_keeps_less_for_backward(tiny_model_dir):
    tokenizer, tok, model = _bf16_policy(tiny_model_dir)
    assert {p.dtype for p in trainable_parameters(model)} == {torch.float32}  # peft's float32 adapters
    rollout = vary_lengths(sample(model, tokenizer, tok, seed=5), tok.pad_id)
    plain, plain_grad, plain_kept = _update(model, rollout, "off")
    mixed, mixed_grad, mixed_kept = _update(model, rollout, "bfloat16")
    assert plain_grad.abs().max() > 0
    # The adapters' products change from float32 to bf16 (8 significant bits: up to 2^-9 relative rounding per
    # value); the base's matmuls were bf16 before. Through two layers of adapters (perturbed to be large here) the
    # policy's log-probs move by ~1e-3 nats: the loss by ~1e-4 of itself (seen 4e-5), the KL, a small difference
    # of two log-probs, and the gradient's norm by a few percent (seen 0.8 % and 1.7 %), its direction by less
    # than 1e-3 (cosine; seen 2e-4). Any other change (a pass in another precision, a lost adapter) is larger.
    assert abs(mixed["loss"] - plain["loss"]) <= 1e-3 * abs(plain["loss"]), (mixed["loss"], plain["loss"])
    assert abs(mixed["kl"] - plain["kl"]) <= 5e-2 * abs(plain["kl"]), (mixed["kl"], plain["kl"])
    cosine = torch.nn.functional.cosine_similarity(mixed_grad, plain_grad, dim=0)
    assert cosine > 0.999 and 0.95 < float(mixed_grad.norm() / plain_grad.norm()) < 1.05, cosine
    assert not torch.equal(mixed_grad, plain_grad), "autocast must change what the adapters compute"
    # the float32 copies of every adapted module's input are gone (the float32 bytes kept drop by 0.48x of themselves:
    # what stays is the log-prob head's float32 work and a packed pass's attention, which runs in float32 on a CPU,
    # models/packed_attention.py), and no bf16 copy replaces them: the adapters take the activations the base layers
    # keep. The bf16 bytes kept grow by 0.34x of the float32 bytes dropped (the adapters' bf16
    # intermediate outputs, the weights' casts); autocast alone, peft still casting each input to float32 and
    # autocast back to bf16 (peft's input casting left on), keeps a bf16 copy per module as well: seen 0.50x
    plain_f32, mixed_f32 = (kept.bytes_by_dtype[torch.float32] for kept in (plain_kept, mixed_kept))
    plain_bf16, mixed_bf16 = (kept.bytes_by_dtype[torch.bfloat16] for kept in (plain_kept, mixed_kept))
    assert plain_f32 - mixed_f32 > 0.4 * plain_f32, (mixed_f32, plain_f32)
    assert mixed_bf16 - plain_bf16 < 0.42 * (plain_f32 - mixed_f32), (mixed_bf16, plain_bf16, plain_f32, mixed_f32)
    # in all: seen 0.79x (0.74x where a packed pass attended with the dense mask in bf16; 0.82x autocast alone)
    assert mixed_kept.bytes < 0.81 * plain_kept.bytes, (mixed_kept.bytes, plain_kept.bytes)


def test_a_policy_equal_to_its_reference_has_ratio_1_and_kl_0_under_autocast(tiny_model_dir):
    """lora_B at zero (a fresh adapter): the policy's log-probs under autocast equal the reference's, bit for bit,
    so the first update's ratio is exactly 1 and its KL exactly 0, as in the model's own precision."""
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = attach_lora(load_base_model(ModelConfig(path=tiny_model_dir, dtype="bfloat16"), tiny_model_dir),
                        LoraConfig(rank=4, alpha=8))
    rollout = sample(model, tokenizer, tok, seed=2)
    mask = rollout.completion_mask_BTc
    with trainer_precision(model, "bfloat16"):
        policy = batched_logprobs(model, rollout, 8)
        with reference_policy(model):
            ref = batched_logprobs(model, rollout, 8)
        assert torch.equal(policy[mask.bool()], ref[mask.bool()])
        scored = ScoredRollout(rollout, per_token(torch.linspace(-1, 1, 8), mask), mask, policy, ref)
        stats = accumulate_policy_gradient(model, get_algorithm("grpo"), AlgoConfig(beta=0.04), scored, 8, 6)
    assert stats["kl"] == 0.0 and stats["ratio_mean"] == 1.0
    assert any(p.grad.abs().max() > 0 for p in trainable_parameters(model))


@pytest.mark.parametrize("flags,overrides,want", [
    (BF16, ["model.dtype=bfloat16"], "bfloat16"), (NO_BF16, ["model.dtype=bfloat16"], "off"),
    (BF16, [], "off"), (BF16, ["model.dtype=bfloat16", "train.autocast=off"], "off"),
    (NO_BF16, ["model.dtype=bfloat16", "train.autocast=bfloat16"], "bfloat16")])  # an explicit choice is kept
def test_auto_autocast_follows_the_model_and_the_machine(flags, overrides, want, monkeypatch):
    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    cfg = load_config(None, ["model.device=cpu", *overrides])
    resolve_machine_settings(cfg)
    assert cfg.train.autocast == want


def test_a_bf16_run_under_autocast_trains_and_saves_the_choice(monkeypatch, tiny_model_dir, prompts_file, tmp_path,
                                                               capsys):
    monkeypatch.setattr(machine, "cpu_flags", lambda: BF16)
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, prompts_file, str(out), **{
        "model.dtype": "bfloat16", "train.steps": 2, "algo.beta": 0.04, "eval.before": "false", "eval.after": "false"})
    assert main(["train", *args]) == 0
    err = capsys.readouterr().err
    assert err.count("train.autocast=auto -> bfloat16") == 1, err
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["autocast"] == "bfloat16"
    rows = [yaml.safe_load(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["grad_norm"] > 0 for r in rows)


PPO = {"algo.name": "ppo", "rollout.num_generations": 1, "train.prompts_per_step": 4}


@pytest.mark.parametrize("algo", [{"algo.beta": 0.04}, PPO], ids=["grpo", "ppo"])
def test_the_passes_run_under_autocast_and_the_optimizer_steps_outside_it(algo, monkeypatch, tiny_model_dir,
                                                                          prompts_file, tmp_path):
    """The gradient passes run under bf16 autocast; the float32 adapters' update (clipping, AdamW) does not."""
    from rlora.train import ppo_step, step

    monkeypatch.setattr(machine, "cpu_flags", lambda: BF16)
    autocast_in = {"passes": [], "optimizer": []}

    def recording(real, where):
        def wrapped(*args, **kwargs):
            autocast_in[where].append(torch.is_autocast_enabled("cpu"))
            return real(*args, **kwargs)
        return wrapped

    for module, passes in ((step, "accumulate_gradient_per_policy"), (ppo_step, "accumulate_gradient_per_policy")):
        monkeypatch.setattr(module, passes, recording(getattr(module, passes), "passes"))
        monkeypatch.setattr(module, "optimizer_step", recording(module.optimizer_step, "optimizer"))
    args = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "run"), **{
        "model.dtype": "bfloat16", "train.steps": 2, "eval.before": "false", "eval.after": "false", **algo})
    assert main(["train", *args]) == 0
    assert autocast_in["passes"] == [True, True] and autocast_in["optimizer"] == [False, False], autocast_in


@pytest.mark.parametrize("saved,want", [({"autocast": "bfloat16"}, "bfloat16"), ({}, "off")])
def test_a_resumed_run_keeps_its_checkpoints_autocast(saved, want, monkeypatch, tmp_path):
    """`auto` resumes with the checkpoint's choice on any machine; a checkpoint from before the key ran off."""
    import json

    monkeypatch.setattr(machine, "cpu_flags", lambda: BF16 if want == "off" else NO_BF16)  # the machine would differ
    (tmp_path / "state.json").write_text(json.dumps({"config": yaml.safe_dump({"train": saved})}))
    cfg = load_config(None, ["model.device=cpu", "model.dtype=bfloat16"])
    resolve_machine_settings(cfg, resume_from=tmp_path)
    assert cfg.train.autocast == want


def test_a_critics_values_stay_float32_under_autocast(tiny_model_dir):
    """PPO's value passes run inside trainer_precision too: the value head (a float32 linear) must not return bf16
    values there, or returns and the value loss would carry ~3 significant digits."""
    from rlora.models.value_model import attach_critic
    from rlora.train.ppo_step import batched_values

    tokenizer, tok, model = _bf16_policy(tiny_model_dir)
    critic = attach_critic(model, rank=2, alpha=4, head_init_std=0.1)
    rollout = sample(model, tokenizer, tok, n_prompts=1, G=2)
    off = batched_values(critic, rollout, 2)
    with trainer_precision(model, "bfloat16"):
        on = batched_values(critic, rollout, 2)
    assert off.dtype == on.dtype == torch.float32
    # the decoder's bf16 passes move the hidden states a little; the head's product itself is float32
    torch.testing.assert_close(on, off, rtol=0, atol=0.05)
