"""rlora on a CUDA GPU: the model is placed there, every pass runs there, and the results equal the CPU's.

Skipped where torch sees no GPU (CI). On a GPU machine the other test files run there too: model.device
defaults to auto, so test_engine, test_logprobs, test_frozen_prefix, test_sft and test_rm check the same
equalities on the GPU (see docs/benchmarks.md for the command)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides
from safetensors.torch import load_file
from test_engine import policy, tokens_of
from test_policy_model import perturb_adapter
from test_rollout_device import CONFIGS

from rlora.cli import main
from rlora.models.logprobs import completion_logprobs
from rlora.rollout.engine import BuiltinGenerator
from rlora.rollout.generator import HFGenerator
from rlora.types import SamplingParams

LR = 1e-4
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(model_dir, data, out: Path, device: str) -> list[dict]:
    code = main(["train", *tiny_overrides(model_dir, data, str(out), **{
        "model.device": device, "train.steps": 1, "train.lr": LR, "algo.beta": 0.04, "eval.before": "false", "eval.after": "false"})])
    assert code == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_step_on_the_gpu_equals_a_step_on_the_cpu(tiny_model_dir, prompts_file, tmp_path):
    """Same weights, seeds and counter-based draws: the same completions and rewards, and (to fp32 rounding)
    the same KL, loss and updated adapter. One step: after an update, rounding differences of ~1e-7 in the
    weights can flip a draw of the next step (near-uniform distributions of a random model), so later
    steps are not expected to match token for token."""
    gpu = _run(tiny_model_dir, prompts_file, tmp_path / "gpu", "cuda")[0]
    cpu = _run(tiny_model_dir, prompts_file, tmp_path / "cpu", "cpu")[0]
    assert gpu["gpu_peak_gb"] > 0 and "gpu_peak_gb" not in cpu
    samples = [(tmp_path / side / "samples.jsonl").read_text() for side in ("gpu", "cpu")]
    assert samples[0] == samples[1] and samples[0]
    for key in ("reward_mean", "gen_tokens"):
        assert gpu[key] == cpu[key], key
    # (the step's loss is a sum of advantage-weighted terms that cancel to ~1e-4: rounding noise, not compared)
    assert gpu["kl"] == pytest.approx(cpu["kl"], abs=1e-7)
    # the gradient is also a cancelling sum: measured on an H100, 0.92715 against 0.92732 on the CPU (1.8e-4)
    assert gpu["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=1e-3) and cpu["grad_norm"] > 0
    a, b = (load_file(str(tmp_path / side / "adapter" / "adapter_model.safetensors")) for side in ("gpu", "cpu"))
    assert a.keys() == b.keys()
    diff = torch.cat([(a[name].float() - b[name].float()).abs().flatten() for name in a])
    # Adam's first step moves each weight by lr x sign(gradient) (almost exactly): weights whose gradient is
    # ~0 may move either way on the two devices, so a few may differ by up to 2 lr; all others agree.
    assert (diff <= 1e-6).float().mean() > 0.99 and diff.max() <= 2 * LR + 1e-6, diff.max()
    assert any(a[name].abs().max() > 0 for name in a if "lora_B" in name), "the adapter must have trained"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_configuration_trains_on_the_gpu(name, tiny_model_dir, prompts_file, tmp_path):
    """The configurations tests/test_rollout_device.py checks with a simulated device, on the real one: a tensor
    on the wrong device raises here."""
    values = {"model.device": "cuda", "eval.before": "false", "eval.after": "false", **CONFIGS[name]}
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "run"), **values)]) == 0


@pytest.mark.parametrize("decode", ["eager", "graph"])
def test_model_and_sampler_run_on_the_gpu(tiny_model_dir, decode):
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    assert all(p.is_cuda for p in model.parameters())
    greedy = SamplingParams(max_new_tokens=16, greedy=True)
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, merge=True, decode=decode)
    ours = engine.sample(model, prompts, 2, greedy, seed=0)
    hf = HFGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    for i, prompt in enumerate(prompts):
        want = hf.sample(model, [prompt], 1, greedy, seed=0)
        assert tokens_of(ours, 2 * i) == tokens_of(want, 0) == tokens_of(ours, 2 * i + 1)
    assert ours.completion_ids_BTc.device.type == "cpu"  # rollouts live on the CPU, micro-batches move


@pytest.mark.parametrize("decode", ["eager", "graph"])
def test_sampler_logprobs_equal_the_trainers_on_the_gpu(tiny_model_dir, decode):
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, min_new_tokens=12)
    rollout = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, decode=decode).sample(model, prompts, 3, params, seed=7)
    model.eval()
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, rollout.select(slice(None)))
    mask = rollout.completion_mask_BTc.bool()
    gap = (trainer.cpu()[mask] - rollout.sampling_logp_BTc[mask]).abs()
    assert gap.mean() < 1e-4 and gap.max() < 1e-3, (gap.mean(), gap.max())


@pytest.mark.parametrize("max_rows", [None, 2])
def test_sliding_windows_in_the_cuda_graph_equal_the_trainer(tmp_path, max_rows):
    """A Gemma 3 with windows of 4 on its sliding layers, rows past them: the recorded step builds its window masks
    from the slots' steps and KVCache.prompt_back_ST (written in place when a slot takes a prompt: max_rows=2)."""
    from rlora.models.tiny import build_random_model

    tokenizer, tok, model, prompts = policy(str(build_random_model(tmp_path / "gemma", family="gemma3_text",
                                                                    sliding_window=4, seed=3)))
    params = SamplingParams(max_new_tokens=12, temperature=0.8, min_new_tokens=12)
    rollout = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, decode="graph", max_rows=max_rows).sample(
        model, prompts, 2, params, seed=7)
    model.eval()
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, rollout.select(slice(None)))
    mask = rollout.completion_mask_BTc.bool()
    assert (trainer.cpu()[mask] - rollout.sampling_logp_BTc[mask]).abs().max() < 1e-4


def test_bf16_base_bit_identical_after_50_merge_cycles_on_the_gpu(tiny_model_dir):
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    model.to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, merge=True)
    for cycle in range(50):
        perturb_adapter(model, scale=0.5, seed=cycle)
        engine.sample(model, prompts[:2], 2, SamplingParams(max_new_tokens=2), seed=cycle)
    after = dict(model.named_parameters())
    assert all(after[n].is_cuda and torch.equal(after[n], p) for n, p in before.items())


@pytest.mark.parametrize("merge", [True, False])
def test_cuda_graph_decode_samples_what_the_eager_step_samples(tiny_model_dir, merge):
    """The replayed graph against the eager step, with rows ending at ragged steps (several replays of one
    recorded graph, different t each time) and per-prompt settings."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    free = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, decode="eager").sample(
        model, prompts, 1, SamplingParams(max_new_tokens=16, greedy=True), seed=0)
    eos = tokens_of(free, 1)[3]
    per_prompt = [SamplingParams(max_new_tokens=n, temperature=t, top_p=p) for n, t, p in
                  [(14, 0.7, 0.9), (6, 1.0, 1.0), (11, 1.3, 0.8), (14, 0.5, 1.0)]]
    eager, graph = (BuiltinGenerator(tokenizer, [eos], tok.pad_id, merge=merge, decode=mode).sample(
        model, prompts, 3, per_prompt, seed=5) for mode in ("eager", "graph"))
    assert torch.equal(eager.completion_ids_BTc, graph.completion_ids_BTc)
    assert eager.finish_reasons == graph.finish_reasons and "stop" in eager.finish_reasons
    assert (eager.sampling_logp_BTc - graph.sampling_logp_BTc).abs().max() < 1e-5


def test_graph_decode_draws_inside_the_graph_and_syncs_only_at_reads(tiny_model_dir, monkeypatch):
    """Plain temperature sampling with min_new_tokens, a greedy prompt and ragged limits through 2 slots (continuous
    batching): the draw is recorded in the CUDA graph, the tokens equal the eager host loop's, and the decode
    loop's steps (decode_loop.advance, once per token) make no device-to-host sync: torch's sync debug mode
    raises on one. The loop syncs only where it reads the finished flags and admits prompts."""
    from test_decode_loop import _per_prompt, _prompts

    from rlora.rollout import decode_loop, graphed

    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    prompts = _prompts(prompts)
    eager = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, decode="eager").sample(model, prompts, 3, _per_prompt(), seed=11)

    def syncs_allowed(function):
        def run(*args, **kwargs):
            torch.cuda.set_sync_debug_mode(0)
            try:
                return function(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("error")
        return run

    def in_error_mode(function):
        def run(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return function(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return run

    monkeypatch.setattr(graphed.StaticDecoder, "_record", syncs_allowed(graphed.StaticDecoder._record))
    monkeypatch.setattr(decode_loop, "advance", in_error_mode(decode_loop.advance))
    graph = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, decode="graph", max_rows=6).sample(
        model, prompts, 3, _per_prompt(), seed=11)
    assert torch.equal(eager.completion_ids_BTc, graph.completion_ids_BTc)
    assert eager.finish_reasons == graph.finish_reasons
    assert (eager.sampling_logp_BTc - graph.sampling_logp_BTc).abs().max() < 1e-5


def test_packed_groups_on_the_gpu_give_the_unshared_logprobs(tiny_model_dir):
    """train.pack_groups on CUDA (sdpa with a 4-D boolean mask, the layout's index tensors on the device): the
    float64 policy's log-probs and gradients equal the unshared pass's (tests/test_packed_groups.py on the CPU)."""
    from test_packed_groups import _packed_and_unshared
    from test_shared_prompts import _gradients, _policy, _rollout

    from rlora.batching import trim
    from rlora.models.packed_groups import plan_packing
    from rlora.models.shared_prompts import prompt_groups

    model = _policy(tiny_model_dir, pack=True).cuda()
    batch = trim(_rollout(model, tiny_model_dir)).to(torch.device("cuda"))
    assert plan_packing(model, batch, prompt_groups(batch)) is not None
    params = [p for p in model.parameters() if p.requires_grad]
    mask = batch.completion_mask_BTc.bool()

    def run():
        logp_BT = completion_logprobs(model, batch, chunk_tokens=5)[0]
        loss = lambda: completion_logprobs(model, batch, chunk_tokens=5)[0].sum()  # noqa: E731
        return logp_BT.detach(), _gradients(model, params, loss)

    (logp, grads), (logp_ref, grads_ref) = _packed_and_unshared(model, run)
    assert torch.allclose(logp[mask], logp_ref[mask], atol=1e-6, rtol=0)
    scale = max(float(g.abs().max()) for g in grads_ref)
    assert all(torch.allclose(g, r, atol=1e-6 * scale, rtol=0) for g, r in zip(grads, grads_ref))
