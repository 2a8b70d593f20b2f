"""A step's rollout stays on the model's device, and no code mixes host and device tensors (what a GPU refuses),
checked on a CPU-only machine with a simulated second device (tests/device_guard.py): `rlora train` runs with
the model's parameters on that device, in each of the configurations that build their own tensors (reference and
old passes, importance weights, replay and its checkpoint, PPO's values, several policies, MoLoRA, frozen lower
layers, episodes, transformers generate, evaluation)."""

import json

import pytest
import torch

from conftest import tiny_overrides
from device_guard import SimulatedDevice
from rlora.cli import main
from rlora.models import loading
from rlora.train import grpo

CONFIGS = {
    "grpo with importance weights": {"eval.before": "true", "eval.after": "true"},
    "reference and old passes": {"algo.beta": 0.04, "algo.num_iterations": 2},
    "replay and its checkpoint": {"algo.replay.enabled": "true", "algo.replay.ratio": 1.0, "train.steps": 3,
                                  "train.checkpoint_every": 1},
    "kl in the reward": {"algo.name": "reinforce_pp", "algo.beta": 0.04},
    "dynamic sampling, adaptive": {"algo.name": "adaptive_grpo", "algo.dynamic_sampling": "true",
                                   "algo.max_extra_rounds": 1},
    "ppo": {"algo.name": "ppo", "rollout.num_generations": 1, "train.prompts_per_step": 4, "train.micro_batch_size": 2,
            "algo.num_iterations": 2},
    "several policies": {"policies": "[{name: a, lr: 0.01}, {name: b, beta: 0.1}]", "algo.beta": 0.04},
    "molora": {"lora.rank": 16, "molora": json.dumps({"num_experts": 3, "top_k": 2, "rank": 4, "router": "sequence"}),
               "algo.beta": 0.04, "rollout.sampler_dtype": "model", "algo.sampler_is_cap": "null"},
    "ppo beside a mixture": {"algo.name": "ppo", "lora.rank": 16, "rollout.sampler_dtype": "model",
                             "molora": json.dumps({"num_experts": 2, "top_k": 2, "rank": 4, "router": "sequence"}),
                             "algo.sampler_is_cap": "null", "train.gradient_checkpointing": "true"},
    "frozen lower layers": {"lora.top_layers": 1, "algo.beta": 0.04},
    "episodes": {"env": "{fn: envs_for_tests.scripted, args: {turns: 2}}", "rollout.stop": "[' ']"},
    "transformers generate": {"rollout.engine": "hf", "rollout.sampler_dtype": "model", "algo.sampler_is_cap": "null"},
}


def _float_tensors(transfers):
    """Transfers of float32 tensors of two or more dimensions: log-probs, advantages, masks, values. (Token ids
    reach the host once, to be decoded; the rewards, float64 and made on the host from text, reach the device.)"""
    return [t for t in transfers if len(t.shape) >= 2 and t.dtype == torch.float32]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_run_keeps_its_rollout_on_the_device_and_never_mixes_host_and_device(name, tiny_model_dir, prompts_file,
                                                                                tmp_path, monkeypatch):
    guard = SimulatedDevice()
    load_base = loading.load_base_model

    def load_on_device(*args, **kwargs):
        model = load_base(*args, **kwargs)
        guard.place(model)
        return model

    for module in ("rlora.train.session", "rlora.evaluation"):
        monkeypatch.setattr(f"{module}.load_base_model", load_on_device, raising=False)
    guard.recording = False  # transfers are counted inside the steps only (loading and saving adapters move weights)
    steps = []
    for step_fn in ("grpo_step", "ppo_step"):
        real_step = getattr(grpo, step_fn)

        def recorded(*args, _real=real_step, **kwargs):
            guard.recording = True
            steps.append(1)
            try:
                return _real(*args, **kwargs)
            finally:
                guard.recording = False

        monkeypatch.setattr(grpo, step_fn, recorded)
    values = {"eval.before": "false", "eval.after": "false", **CONFIGS[name]}
    with guard:
        code = main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "run"), **values)])
    assert code == 0 and steps
    assert guard.placed, "the model never reached the simulated device: the check would see nothing"
    assert not guard.mixed, "\n".join(dict.fromkeys(guard.mixed))
    crossed = _float_tensors(guard.to_host) + _float_tensors(guard.to_device)
    if name == "episodes":  # built on the host between turns: each turn read back once, the batch moved once
        assert {t.what for t in crossed} <= {"TensorBase.tolist", "TensorBase.to"}, crossed
        turns, steps_run = 2, len(steps)
        assert sum(t.what == "TensorBase.tolist" for t in crossed) <= turns * steps_run
        assert sum(t.what == "TensorBase.to" for t in crossed) <= steps_run * 2  # log-probs, per-token temperatures
        crossed = []
    if name.startswith("replay"):  # the buffer keeps its groups on the host: a group's rows cross, never a batch's
        G = 4
        assert crossed and all(t.shape[0] == G for t in crossed), [t.shape for t in crossed]
        crossed = []
    assert not crossed, "\n".join(dict.fromkeys(f"{t.what} {t.shape}{t.where}" for t in crossed))
    if name.startswith("dynamic sampling"):  # the check covered resampled groups: count_a never scores 1.0
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert all(row["resamples"] > 0 for row in rows), [row.get("resamples") for row in rows]


def test_the_guard_sees_what_a_gpu_refuses():
    """The simulated device flags what CUDA refuses, and lets pass what it allows."""
    weight = torch.nn.Linear(4, 3)
    with SimulatedDevice().place(weight) as guard:
        x_host = torch.randn(2, 4)
        weight(x_host)  # a host input into a device layer
        y = weight(x_host.to(weight.weight.device))
        y * torch.tensor(2.0)  # a 0-dim host tensor mixes freely
        y[torch.tensor([1, 0])]  # a host index into a device tensor is allowed
        torch.arange(3)[torch.tensor([0, 1], device=y.device)]  # a device index into a host tensor is not
        y.cpu() + torch.ones(2, 3)  # back on the host: fine
    assert len(guard.mixed) == 2, guard.mixed
    assert "linear" in guard.mixed[0] and "device index into a host tensor" in guard.mixed[1]
    assert [t.shape for t in guard.to_host] == [(2, 3)] and [t.shape for t in guard.to_device] == [(2, 4)]
