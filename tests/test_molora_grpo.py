"""MoLoRA in `rlora train` (GRPO), the samplers, `rlora eval` and `rlora merge`: a 2-step run with each router
writes a MoLoRA folder that reloads to the trained model exactly; the routers' auxiliary loss does not depend on
the micro-batching; the sampler routes exactly as the trainer (gates) and its log-probs equal the trainer's;
eval puts a MoLoRA folder beside the base; merge and bad combinations fail in one line with exit code 2."""

import json
import shutil

import pytest
import torch
from test_policy_model import sample, vary_lengths

from conftest import tiny_overrides
from rlora.algos.advantages import per_token
from rlora.algos.registry import get_algorithm
from rlora.cli import main
from rlora.config import AlgoConfig, ModelConfig
from rlora.models import molora as ml
from rlora.models.loading import load_base_model, load_tokenizer
from rlora.models.logprobs import completion_logprobs
from rlora.models.molora import MoLoRAConfig
from rlora.rollout.engine import BuiltinGenerator
from rlora.rollout.generator import HFGenerator
from rlora.train import grpo
from rlora.train.update import ScoredRollout, accumulate_policy_gradient
from rlora.types import SamplingParams

MOLORA = {"num_experts": 3, "top_k": 2, "rank": 4, "router_init_std": 0.3}


def molora_overrides(model_dir, prompts_file, out, router, **extra):
    """tiny_overrides with a molora section instead of the lora rank (lora.* must keep its defaults)."""
    values = {"lora.rank": 16, "molora": json.dumps({**MOLORA, "router": router}), "algo.beta": 0.04,
              "rollout.sampler_dtype": "model", "algo.sampler_is_cap": "null", **extra}
    return tiny_overrides(model_dir, prompts_file, str(out), **values)


def molora_model(model_dir, router, float64=False, balance_coef=0.5, z_coef=0.1):
    """A MoLoRA model with non-zero B and spread-out routers, so the mixture changes the outputs and routing
    differs between rows and tokens."""
    torch.manual_seed(0)
    model = load_base_model(ModelConfig(path=model_dir), model_dir)
    ml.attach_molora(model, MoLoRAConfig(**{**MOLORA, "rank": 2}, router=router, balance_coef=balance_coef,
                                         z_coef=z_coef))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("molora_B"):
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    return model.double() if float64 else model


PROMPTS = ["What", "What is 3 + 4? The answer", "Hello, how are you today?", "0 1 2"]


@pytest.mark.parametrize("router", ["sequence", "token"])
def test_grpo_trains_and_saves_a_molora_folder_that_reloads_exactly(router, tiny_model_dir, prompts_file, tmp_path,
                                                                    capsys, monkeypatch):
    kept = {}
    save = grpo.save_final

    def keep_model(s, name="adapter"):  # the model as training left it, then saved as rlora saves it
        kept["model"] = s.model
        save(s, name)

    monkeypatch.setattr(grpo, "save_final", keep_model)
    out = tmp_path / "run"
    assert main(["train", *molora_overrides(tiny_model_dir, prompts_file, out, router)]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in (out / "adapter").iterdir()) == [ml.CONFIG_FILE, ml.WEIGHTS_FILE]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        utils = [row[f"molora/util_{e}"] for e in range(3)]
        assert sum(utils) == pytest.approx(1.0) and row["aux_loss"] > 0 and row["molora/entropy"] > 0
        assert row["kl"] is not None  # the reference (mixture off) ran
    evals = json.loads((out / "eval.json").read_text())
    assert evals["before"]["n"] == 4 and evals["after"]["n"] == 4
    trained = kept["model"]
    trained_params = {n: p.detach().clone() for n, p in trained.named_parameters() if ml.PARAM_TAG in n}
    assert any(p.abs().sum() > 0 for n, p in trained_params.items() if n.endswith("molora_B")), "B never trained"
    reloaded = load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir)
    ml.load_molora(reloaded, out / "adapter")
    for name, param in reloaded.named_parameters():
        if ml.PARAM_TAG in name:
            assert torch.equal(param, trained_params[name]), name
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    rollout = sample(trained.eval(), tokenizer, tok)
    with torch.no_grad():
        want, _ = completion_logprobs(trained, rollout.select(slice(None)))
        got, _ = completion_logprobs(reloaded.eval(), rollout.select(slice(None)))
    assert torch.equal(got, want)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _scored(model, tokenizer, tok):
    """8 completions of 2 prompts (ragged lengths, left-padded prompts) with advantages (two of them 0)."""
    rollout = vary_lengths(sample(model, tokenizer, tok, seed=3), tok.pad_id)
    advantages = torch.tensor([1.0, -0.5, 0.0, 0.7, -1.2, 0.3, 0.0, 0.9])
    mask = rollout.completion_mask_BTc.clone()
    return ScoredRollout(rollout, per_token(advantages, mask), mask)


@pytest.mark.parametrize("router", ["sequence", "token"])
def test_micro_batching_does_not_change_the_grpo_gradient_with_aux_loss(router, tiny_model_dir):
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    scored = _scored(molora_model(tiny_model_dir, router), tokenizer, tok)
    algo, cfg = get_algorithm("grpo"), AlgoConfig(beta=0.0)
    grads, metrics = {}, {}
    for micro in (8, 4, 1):
        # float64 weights: other micro-batchings differ only by rounding (routing softmax stays float32)
        model = molora_model(tiny_model_dir, router, float64=True)
        metrics[micro] = accumulate_policy_gradient(model, algo, cfg, scored, micro, 6)
        grads[micro] = _grads(model)
    assert grads[8] and grads[8].keys() == grads[1].keys()
    for micro in (4, 1):
        for name in grads[8]:
            torch.testing.assert_close(grads[micro][name], grads[8][name], atol=1e-6, rtol=0)
        for key in ("aux_loss", "molora/balance", "molora/z_loss", "molora/entropy", "molora/util_0"):
            assert metrics[micro][key] == pytest.approx(metrics[8][key], rel=1e-6, abs=1e-9), key
    # every row was trained (the aux loss covers the zero-advantage rows too), and the aux loss is in the gradient
    assert metrics[8]["trained_frac"] == 1.0 and metrics[8]["aux_loss"] > 0
    model = molora_model(tiny_model_dir, router, float64=True, balance_coef=0.0, z_coef=0.0)
    without = accumulate_policy_gradient(model, algo, cfg, scored, 8, 6)
    routers = [n for n in grads[8] if "molora_router" in n]
    assert without["trained_frac"] == 0.75  # two rows with advantage 0 skipped: no aux loss to cover them
    assert routers and all(not torch.allclose(_grads(model)[n], grads[8][n], atol=1e-6) for n in routers)


class GateLog:
    """Every routing record of one MoLoRA module, in call order (the sampler's prefill, then decoding steps)."""

    def __init__(self, module):
        self.records = []
        module.register_forward_hook(lambda m, args, out: self.records.append((args[0].shape, m.last)))


@pytest.mark.parametrize("router", ["sequence", "token"])
@pytest.mark.parametrize("decode", ["eager", "static"])
def test_sampler_routes_as_the_trainer_and_its_logprobs_equal_the_trainers(router, decode, tiny_model_dir):
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = molora_model(tiny_model_dir, router).eval()
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
    name, module = ml.molora_modules(model)[3]
    log = GateLog(module)
    G, T = 3, 8
    params = SamplingParams(max_new_tokens=T, temperature=1.0, min_new_tokens=T)
    rollout = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, merge=True, decode=decode).sample(
        model, prompts, G, params, seed=4)
    sampled = list(log.records)
    log.records.clear()
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, rollout.select(slice(None)))
    [(_, train_record)] = log.records
    mask = rollout.completion_mask_BTc.bool()
    assert mask.all()
    gap = (trainer - rollout.sampling_logp_BTc).abs()
    assert gap.max() < 1e-4, gap.max()
    P, B, Tp = len(prompts), len(prompts) * G, rollout.prompt_ids_BTp.shape[1]
    (prefill_shape, prefill), steps = sampled[0], sampled[1:]
    assert prefill_shape[:2] == (P, Tp) and len(steps) == T - 1
    if router == "sequence":  # one decision per row: the prompt's, at prefill, every step and in training
        row_gates = prefill.gates_UE.repeat_interleave(G, dim=0)
        torch.testing.assert_close(train_record.gates_UE, row_gates, atol=1e-6, rtol=0)
        assert torch.equal(train_record.chosen_UK.sort(-1).values,
                           prefill.chosen_UK.repeat_interleave(G, dim=0).sort(-1).values)
        for _, step in steps:
            torch.testing.assert_close(step.gates_UE, row_gates, atol=1e-6, rtol=0)
        assert not torch.allclose(prefill.gates_UE[0], prefill.gates_UE[1]), "rows must route differently"
        return
    # token router: the gates of each prompt token and each fed completion token, sampler vs trainer
    train_gates = train_record.gates_UE.view(B, Tp + T, -1)
    prompt_mask = rollout.prompt_mask_BTp.bool()
    prefill_gates = prefill.gates_UE.view(P, Tp, -1).repeat_interleave(G, dim=0)
    torch.testing.assert_close(train_gates[:, :Tp][prompt_mask], prefill_gates[prompt_mask], atol=1e-5, rtol=0)
    for t, (_, step) in enumerate(steps):  # step t feeds completion token t (position Tp + t)
        torch.testing.assert_close(train_gates[:, Tp + t], step.gates_UE, atol=1e-5, rtol=0)
    assert not torch.allclose(train_gates[0, -1], train_gates[0, -2]), "tokens must route differently"


def test_hf_generate_routes_by_the_prompt_and_samples_what_the_engine_samples(tiny_model_dir):
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = molora_model(tiny_model_dir, "sequence").eval()
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
    greedy = SamplingParams(max_new_tokens=10, greedy=True)
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(model, prompts, 1, greedy, seed=0)
    hf = HFGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    base_differs = False
    for i, prompt in enumerate(prompts):
        want = hf.sample(model, [prompt], 1, greedy, seed=0)
        row = engine.completion_ids_BTc[i][engine.completion_mask_BTc[i].bool()].tolist()
        assert want.completion_ids_BTc[0][want.completion_mask_BTc[0].bool()].tolist() == row, i
        with ml.molora_disabled(model):
            base = hf.sample(model, [prompt], 1, greedy, seed=0)
        base_differs |= base.completions[0] != want.completions[0]
    assert base_differs, "the mixture must change some greedy completion, or this test proves nothing"


def test_route_by_routes_rows_by_other_prompts_in_both_samplers(tiny_model_dir):
    """route_by (an episode's later turn: its first prompt): each prompt's rows are routed by route_by's prompt.
    The engine (fresh and continuing no cache) and transformers generate sample the same greedy tokens, and
    routing by the prompts reversed changes some of them."""
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = molora_model(tiny_model_dir, "sequence").eval()
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
    others = prompts[::-1]
    greedy = SamplingParams(max_new_tokens=10, greedy=True)
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    hf = HFGenerator(tokenizer, tok.eos_ids, tok.pad_id)

    def tokens(rollout):
        return [row[mask.bool()].tolist() for row, mask in zip(rollout.completion_ids_BTc, rollout.completion_mask_BTc)]

    routed = tokens(engine.sample(model, prompts, 1, greedy, seed=0, route_by=others))
    continued, _ = engine.sample_continued(model, prompts, 1, greedy, seed=0, route_by=others)
    assert tokens(continued) == routed
    assert tokens(hf.sample(model, prompts, 1, greedy, seed=0, route_by=others)) == routed
    assert routed != tokens(engine.sample(model, prompts, 1, greedy, seed=0)), "routing by other prompts changed nothing"
    with pytest.raises(ValueError, match="3 routing prompts for 4 prompts"):
        hf.sample(model, prompts, 1, greedy, seed=0, route_by=others[:3])


@pytest.fixture()
def molora_folder(tiny_model_dir, tmp_path):
    folder = tmp_path / "molora"
    ml.save_molora(molora_model(tiny_model_dir, "sequence"), folder)
    return str(folder)


def test_eval_puts_a_molora_folder_beside_the_base(tiny_model_dir, prompts_file, molora_folder, tmp_path, capsys):
    out = tmp_path / "eval"
    args = ["eval", *tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "unused")),
            "--adapter", f"mix={molora_folder}", "--output", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    report = json.loads((out / "eval.json").read_text())
    assert list(report["results"]) == ["base", "mix"] and report["results"]["mix"]["adapter"] == molora_folder
    rows = {name: [json.loads(x)["completion"] for x in (out / f"samples_{name}.jsonl").read_text().splitlines()]
            for name in ("base", "mix")}
    assert rows["base"] != rows["mix"]  # the mixture was on for 'mix' and off for 'base'


def test_merge_refuses_a_molora_folder(molora_folder, tmp_path, capsys):
    assert main(["merge", molora_folder, "--output", str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "MoLoRA mixture" in err and "per sequence" in err
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("router", ["sequence", "token"])
def test_a_molora_run_resumes_exactly(router, tiny_model_dir, prompts_file, tmp_path, capsys):
    """4 steps straight == 3 steps (checkpoints at 2 and 3), the step-3 checkpoint lost, resume from 2, on to 4: the
    same MoLoRA folder (experts and routers), the same completions and the same routers' losses; a resume with
    other molora settings, or without the molora section, is one line and exit code 2."""
    from safetensors.torch import load_file

    from rlora.train.checkpoint import checkpoints

    common = {"train.checkpoint_every": 2, "train.sample_every": 1, "train.lr": 0.01, "eval.after": "false"}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"

    def run(out, steps, **extra):
        return main(["train", *molora_overrides(tiny_model_dir, prompts_file, out, router, **common,
                                                **{"train.steps": steps}, **extra)])

    assert run(straight, 4) == 0 and run(resumed, 3) == 0
    assert [p.name for p in checkpoints(resumed / "checkpoints")] == ["step-0000002", "step-0000003"]
    assert sorted(p.name for p in (resumed / "checkpoints" / "step-0000002" / "adapter").iterdir()) == [
        ml.CONFIG_FILE, ml.WEIGHTS_FILE]
    shutil.rmtree(resumed / "checkpoints" / "step-0000003")  # as if killed after step 3 was logged
    capsys.readouterr()
    other = "token" if router == "sequence" else "sequence"
    assert main(["train", *molora_overrides(tiny_model_dir, prompts_file, resumed, other, **common,
                                            **{"train.steps": 4, "train.resume": "auto"})]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"different molora.router ('{router}' there, '{other}' now)" in err, err
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(resumed), **common, **{
        "train.steps": 4, "train.resume": "auto", "lora.rank": 16, "rollout.sampler_dtype": "model", "algo.sampler_is_cap": "null",
        "algo.beta": 0.04})]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "different molora (" in err, err
    assert run(resumed, 4, **{"train.resume": "auto"}) == 0
    assert "resuming from" in capsys.readouterr().err
    a, b = (load_file(str(out / "adapter" / ml.WEIGHTS_FILE)) for out in (straight, resumed))
    assert a.keys() == b.keys() and any("router" in k for k in a)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    rows = {out: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            for out in (straight, resumed)}
    assert [m["step"] for m in rows[resumed]] == [1, 2, 3, 4]
    for x, y in zip(rows[straight], rows[resumed], strict=True):
        for key in ("loss", "aux_loss", "molora/balance", "reward_mean", "kl", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-9), key
    samples = [[(json.loads(s)["step"], json.loads(s)["completion"]) for s in (out / "samples.jsonl").read_text()
                .splitlines()] for out in (straight, resumed)]
    assert samples[0] == samples[1]


@pytest.mark.parametrize("router, algo", [("sequence", "grpo"), ("sequence", "ppo"), ("token", "grpo")])
def test_gradient_checkpointing_recomputes_each_layer_in_the_routing_of_its_forward(router, algo, tiny_model_dir,
                                                                                   prompts_file, tmp_path):
    """train.gradient_checkpointing: the backward recomputes each layer in the routing its forward ran in (a sequence
    router's prompt summaries, the mixture on or off: PPO's value passes run with it off), although the forward's
    routing context has ended by then. 2 steps equal the same run without checkpointing: the same completions,
    mixture (and critic) within 1e-6."""
    from safetensors.torch import load_file

    common = {"algo.name": algo, "train.lr": 0.01, "eval.before": "false", "eval.after": "false"}
    outs = {}
    for label, checkpointing in (("plain", "false"), ("checkpointed", "true")):
        outs[label] = tmp_path / label
        args = molora_overrides(tiny_model_dir, prompts_file, outs[label], router, **common,
                                **{"train.gradient_checkpointing": checkpointing})
        assert main(["train", *args]) == 0
    assert (outs["plain"] / "samples.jsonl").read_text() == (outs["checkpointed"] / "samples.jsonl").read_text()
    files = [("adapter", ml.WEIGHTS_FILE)] + ([("value_model", "adapter_model.safetensors")] if algo == "ppo" else [])
    for folder, name in files:
        one, two = (load_file(str(out / folder / name)) for out in outs.values())
        assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-6, (folder, name)
        assert any(float(v.abs().max()) > 0 for k, v in two.items() if "_B" in k), (folder, name)


@pytest.mark.parametrize("extra, message", [
    ({"lora.rank": 4}, "lora.rank does not apply with molora"),
])
def test_bad_grpo_combinations_are_one_line(extra, message, tiny_model_dir, prompts_file, tmp_path, capsys):
    assert main(["train", *molora_overrides(tiny_model_dir, prompts_file, tmp_path / "run", "sequence", **extra)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def _one_and_two_ranks(model_dir, prompts_file, tmp_path, router, extra) -> dict:
    """The same molora run in one process and on 2 ranks (torchrun) -> {1: folder, 2: folder}."""
    from test_distributed import _run

    outs = {}
    for nproc in (1, 2):
        outs[nproc] = tmp_path / f"ranks{nproc}"
        done = _run(nproc, molora_overrides(model_dir, prompts_file, outs[nproc], router, **extra))
        assert done.returncode == 0, done.stderr[-3000:]
    return outs


# 27 s each on a 2-core CPU: one router per case by default, the other in the slow target
@pytest.mark.parametrize("router", [pytest.param("sequence", marks=pytest.mark.slow), "token"])
def test_two_ranks_train_a_molora_policy_as_one_rank(router, tiny_model_dir, prompts_file, tmp_path):
    """torchrun, 2 ranks x 1 prompt against 1 rank x 2 prompts, one micro-batch per group: the routers' balance
    loss uses the whole batch's utilisation and unit count over both ranks (a routing pass on each rank, summed),
    so the mixture (experts and routers) ends within 1e-5 and the aux loss and router metrics agree. On a sharded
    base: tests/test_fsdp.py."""
    from safetensors.torch import load_file

    extra = {"train.prompts_per_step": 2, "rollout.num_generations": 4, "train.micro_batch_size": 4,
             "train.steps": 2, "train.lr": 0.05, "eval.before": "false", "eval.after": "false", "train.threads": 1}
    outs = _one_and_two_ranks(tiny_model_dir, prompts_file, tmp_path, router, extra)
    one, two = (load_file(str(outs[n] / "adapter" / "molora_model.safetensors")) for n in (1, 2))
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
    assert any("router" in k for k in one)
    rows = {n: [json.loads(line) for line in (outs[n] / "metrics.jsonl").read_text().splitlines()] for n in (1, 2)}
    for a, b in zip(rows[1], rows[2], strict=True):
        for key in ("loss", "aux_loss", "grad_norm", "molora/balance", "molora/util_0"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("router", ["sequence", pytest.param("token", marks=pytest.mark.slow)])
def test_a_rank_without_groups_joins_the_routers_sums(router, tiny_model_dir, prompts_file, tmp_path):
    """DAPO drops rank 0's only group (flat_for_zero): rank 0 trains nothing but still takes part in the routers'
    sums (an empty RolloutRouting in contribute_nothing); the run equals one process dropping the same group."""
    from safetensors.torch import load_file

    from test_distributed import DAPO_EMPTY_RANK

    outs = _one_and_two_ranks(tiny_model_dir, prompts_file, tmp_path, router,
                              {**DAPO_EMPTY_RANK, "train.micro_batch_size": 4})
    one, two = (load_file(str(outs[n] / "adapter" / "molora_model.safetensors")) for n in (1, 2))
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
    [a], [b] = ([json.loads(line) for line in (outs[n] / "metrics.jsonl").read_text().splitlines()] for n in (1, 2))
    assert b["groups_dropped"] == 1
    for key in ("loss", "aux_loss", "molora/balance", "trained_frac", "grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("router", ["sequence", "token"])
def test_a_molora_policy_trains_on_episodes(router, tiny_model_dir, prompts_file, tmp_path, capsys):
    """Three-turn episodes (envs_for_tests.scripted): each turn continues the episode's rows from the sampler's KV
    cache. The trainer routes an episode's row by its first prompt (sequence) or each token by itself (token), and
    so does the sampler in every turn (route_by), so the float32 sampler's log-probs equal the trainer's over all
    turns' policy tokens (sampler_logp_gap < 1e-5) also once the experts have moved. Routed by each turn's own
    prompt instead, the sequence router's gap is 0.07-0.09 from step 2. The run saves a MoLoRA folder and evaluates."""
    from safetensors.torch import load_file

    episodes = {"env": "{fn: envs_for_tests.scripted, args: {turns: 3}}", "rollout.stop": "[' ']",
                "train.steps": 3, "train.lr": 0.05}
    out = tmp_path / "run"
    assert main(["train", *molora_overrides(tiny_model_dir, prompts_file, out, router, **episodes)]) == 0, \
        capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["episode/turns_mean"] > 1 and r["sampler_logp_gap"] < 1e-5 and r["aux_loss"] > 0 for r in rows)
    weights = load_file(str(out / "adapter" / ml.WEIGHTS_FILE))
    assert any(float(v.abs().max()) > 0 for k, v in weights.items() if k.endswith("molora_B"))  # the experts moved
    assert json.loads((out / "eval.json").read_text())["after"]["n"] == 4


def test_a_molora_folder_beside_other_adapters_is_one_line(tiny_model_dir, prompts_file, molora_folder, tmp_path,
                                                          capsys):
    args = ["eval", *tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "unused")),
            "--adapter", f"a={molora_folder}", "--adapter", f"b={molora_folder}", "--output", str(tmp_path / "e")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "loaded alone" in err, err
