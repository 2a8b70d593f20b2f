"""`rlora train` end to end on the tiny model, and the bad-input contract: one line, exit code 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides
from rlora.cli import main
from rlora.config import load_config
from rlora.errors import UserError
from rlora.train.sources import check_context


def run_cli(args, capsys):
    code = main(args)
    err = capsys.readouterr().err
    return code, err


def test_train_end_to_end_writes_every_output(tiny_model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "run"
    code, err = run_cli(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(out))], capsys)
    assert code == 0, err
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "eval.json", "summary.json",
                 "adapter/adapter_config.json", "adapter/adapter_model.safetensors"):
        assert (out / name).is_file(), name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    required = {"step", "reward_mean", "reward_std", "kl", "loss", "clip_frac", "entropy", "completion_len_mean",
                "lr", "step_s", "rollout_s", "train_s", "gen_tokens", "reward/count_a"}
    assert required <= set(rows[0])
    assert rows[0]["gen_tokens"] > 0 and rows[0]["completion_len_mean"] <= 8
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 2 * 4 and {"prompt", "completion", "reward", "advantage"} <= set(samples[0])
    evals = json.loads((out / "eval.json").read_text())
    assert evals["before"]["n"] == 4 and evals["after"]["n"] == 4
    assert "held-out before" in err and "rlora train: done" in err
    # the resolved config reloads and equals what ran
    assert main(["train", str(out / "config.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out == (out / "config.yaml").read_text()


def test_beta_and_reused_rollouts_log_kl_and_ratio(tiny_model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, prompts_file, str(out), **{
        "algo.beta": 0.04, "algo.num_iterations": 2, "algo.loss_agg": "seq_mean", "train.lr": 0.05,
        "eval.before": "false", "eval.after": "false", "train.steps": 1})
    code, err = run_cli(["train", *args], capsys)
    assert code == 0, err
    [row] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # two updates on one rollout: the second sees a moved policy, so KL > 0 and the ratio departs from 1
    assert row["kl"] is not None and row["kl"] > 0
    assert row["ratio_mean"] != 1.0
    assert not (out / "eval.json").exists()


def test_bf16_sampler_with_importance_correction(tiny_model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, prompts_file, str(out), **{
        "rollout.sampler_dtype": "bfloat16", "algo.sampler_is_cap": 2.0, "train.steps": 2})
    code, err = run_cli(["train", *args], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["is_weight_mean"] is not None]
    assert trained, "at least one step must train (a group with reward variance)"
    # bf16 sampling of an fp32 policy: a small but non-zero log-prob gap, weights near 1 and <= the cap
    assert all(0 < r["sampler_logp_gap"] < 0.5 and 0 < r["is_weight_mean"] <= 2.0 for r in trained)
    assert json.loads((out / "eval.json").read_text())["after"]["n"] == 4


def test_continue_from_saved_adapter(tiny_model_dir, prompts_file, tmp_path, capsys):
    first = tmp_path / "first"
    assert run_cli(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(first), **{"train.steps": 1})], capsys)[0] == 0
    second = tmp_path / "second"
    args = tiny_overrides(tiny_model_dir, prompts_file, str(second), **{"train.steps": 1, "lora.init_from": str(first / "adapter")})
    code, err = run_cli(["train", *args], capsys)
    assert code == 0, err


def test_reward_failures_stop_the_run_and_keep_the_adapter(tiny_model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, prompts_file, str(out), rewards="[{fn: rewards_for_tests.always_raises}]",
                          **{"eval.before": "false"})
    code, err = run_cli(["train", *args], capsys)
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("rlora: error: stopped at step 1: rewards failed for 8/8 samples")
    assert "reward server unreachable" in last
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((out / "summary.json").read_text())["status"] == "stopped: reward failures"


def test_some_reward_failures_are_logged_and_training_goes_on(tiny_model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, prompts_file, str(out), **{
        "rewards": "[{fn: rewards_for_tests.count_a}, {fn: rewards_for_tests.fails_on_even_prompts}]",
        "train.max_reward_failure_frac": 1.0, "train.steps": 4, "eval.before": "false", "eval.after": "false"})
    code, err = run_cli(["train", *args], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # 4 steps x 2 prompts = one epoch of the 8 prompts: the 4 failing prompts (x 4 samples) all appear
    assert len(rows) == 4 and sum(r["reward_failures"] for r in rows) == 16
    errors = [e for r in rows for e in r.get("reward_errors", [])]
    assert errors and all("even prompt" in e for e in errors)


def test_failing_rewards_during_eval_do_not_crash(tiny_model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, prompts_file, str(out), rewards="[{fn: rewards_for_tests.always_raises}]")
    code, err = run_cli(["train", *args], capsys)
    assert code == 2 and "Traceback" not in err
    assert "reward -  (n=4, 4 reward failures)" in err  # the eval before training reported, then step 1 stopped
    assert "stopped at step 1" in err


def test_overwrite_replaces_the_previous_run(tiny_model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(out), **{"train.steps": 3})], capsys)[0] == 0
    (out / "notes.txt").write_text("mine")
    args = tiny_overrides(tiny_model_dir, prompts_file, str(out), **{"train.steps": 1, "train.overwrite": "true",
                                                                     "eval.before": "false", "eval.after": "false"})
    assert run_cli(["train", *args], capsys)[0] == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert not (out / "eval.json").exists() and (out / "notes.txt").read_text() == "mine"


def _config_file(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


BAD_INPUTS = [
    ("unknown key", lambda t, m, p: ["train.stpes=2"], "did you mean 'train.steps'"),
    ("wrong type", lambda t, m, p: ["train.steps=two"], "invalid value for train.steps"),
    ("indivisible micro-batch", lambda t, m, p: ["train.micro_batch_size=3"], "not divisible"),
    ("yaml syntax", lambda t, m, p: [_config_file(t, "train: [1, 2\n")], "YAML syntax error"),
    ("missing config", lambda t, m, p: [str(t / "missing.yaml")], "config file not found"),
    ("stray argument", lambda t, m, p: ["train.steps=2", "extra"], "unexpected argument 'extra'"),
    ("missing data file", lambda t, m, p: tiny_overrides(m, str(t / "no.jsonl"), str(t / "o")), "data file not found"),
    ("missing prompt column", lambda t, m, p: tiny_overrides(m, p, str(t / "o"), **{"data.prompt_column": "question"}),
     "no column 'question'"),
    ("model folder without config", lambda t, m, p: tiny_overrides(str(t), p, str(t / "o")), "not a Hugging Face model folder"),
    ("adapter folder without config", lambda t, m, p: tiny_overrides(m, p, str(t / "o"), **{"lora.init_from": str(t)}),
     "not a PEFT adapter folder"),
    ("unknown reward", lambda t, m, p: tiny_overrides(m, p, str(t / "o"), rewards="[{fn: rewards_for_tests.nope}]"),
     "has no function 'nope'"),
    ("unknown task", lambda t, m, p: ["data.task=chain_sm"], "did you mean 'chain_sum'"),
    ("bad LoRA target", lambda t, m, p: tiny_overrides(m, p, str(t / "o"), **{"lora.target_modules": "[nope_proj]"}),
     "lora.target_modules ['nope_proj'] match no module of this model: choose from "),
    ("unknown engine", lambda t, m, p: ["rollout.engine=vllm"], "invalid value for rollout.engine"),
    ("humaneval scored by gym", lambda t, m, p: ["data.task=humaneval", "data.task_args={}", f"train.output_dir={t / 'o'}"],
     "use rewards: [{fn: code}]"),
    ("unknown device", lambda t, m, p: ["model.device=gpu"], "invalid value for model.device"),
    # the tiny model has 2048 positions: past them a run once filled the memory with its KV cache and was killed
    ("completions past the model's positions", lambda t, m, p: tiny_overrides(
        m, p, str(t / "o"), **{"rollout.max_new_tokens": 5000}), "rollout.max_new_tokens=5000 does not fit the model's 2048"),
    ("evaluations past the model's positions", lambda t, m, p: tiny_overrides(
        m, p, str(t / "o"), **{"eval.max_new_tokens": 2048}), "eval.max_new_tokens=2048 does not fit the model's 2048"),
]


def test_the_completion_budget_is_checked_against_the_longest_prompt():
    cfg = load_config(None, ["rollout.max_new_tokens=90", "eval.max_new_tokens=50"])
    prompts = [[1] * 7, [1] * 10]
    check_context(cfg, None, prompts, 100)  # 10 + 90 = 100 positions: fits exactly
    check_context(cfg, None, prompts, None)  # a model that states no limit: nothing to check
    with pytest.raises(UserError, match=r"^rollout.max_new_tokens=90 does not fit the model's 99 positions after the "
                                        r"longest prompt \(10 tokens\): set rollout.max_new_tokens <= 89$"):
        check_context(cfg, None, prompts, 99)
    cfg.eval.max_new_tokens = 95
    with pytest.raises(UserError, match=r"eval.max_new_tokens=95 .* set eval.max_new_tokens <= 90$"):
        check_context(cfg, None, prompts, 100)
    with pytest.raises(UserError, match=r"after the longest prompt \(10 tokens\): shorten the prompts$"):
        check_context(cfg, None, prompts, 10)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_asked_for_on_a_machine_without_one_is_one_line(tiny_model_dir, prompts_file, tmp_path, capsys):
    for command, args in (("train", tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"), **{"model.device": "cuda"})),
                          ("eval", [*tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "t"), **{
                              "model.device": "cuda:1"}), "-o", str(tmp_path / "o")])):
        code, err = run_cli([command, *args], capsys)
        assert code == 2 and "rlora: error: model.device=cuda" in err and "set model.device=cpu" in err, err
        assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_quantization_without_bitsandbytes_is_one_line(tiny_model_dir, prompts_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what `import bitsandbytes` sees when it is missing
    args = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"), **{"model.quantization": "4bit"})
    code, err = run_cli(["train", *args], capsys)
    assert code == 2 and "rlora: error: model.quantization=4bit needs bitsandbytes" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name, make_args, message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_one_line_exit_2(name, make_args, message, tiny_model_dir, prompts_file, tmp_path, capsys):
    code, err = run_cli(["train", *make_args(tmp_path, tiny_model_dir, prompts_file)], capsys)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("rlora: error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "o").exists(), "no output folder is created for a run that never started"


def test_existing_output_dir_is_not_overwritten(tiny_model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "used"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    code, err = run_cli(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(out))], capsys)
    assert code == 2 and "already holds files" in err
    assert (out / "metrics.jsonl").read_text() == "{}\n"


_USED = ("train.output_dir '{out}' already holds files: choose a new folder or set train.overwrite=true")


@pytest.mark.parametrize("command, message", [
    (["train", "train.output_dir={out}"], _USED),
    (["sft", "configs/sft_math.yaml", "train.output_dir={out}"], _USED),
    (["rm", "configs/rm_pairs.yaml", "train.output_dir={out}"], _USED),
    (["eval", "-o", "{out}"], "--output '{out}' already holds files: choose another folder or pass --overwrite"),
    (["merge", "runs/x/adapter", "-o", "{out}"],
     "output folder '{out}' already holds files: choose another or pass --overwrite"),
])
def test_a_used_output_folder_is_refused_before_torch_loads(command, message, tmp_path):
    """The commonest bad input of a rerun, refused in about a second, not after importing the training stack."""
    out = tmp_path / "used"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    script = ("import sys; from rlora.cli import main; code = main(sys.argv[1:]); "
              "print(code, 'torch' in sys.modules)")
    args = [arg.format(out=out) for arg in command]
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], env={**os.environ, "WORLD_SIZE": "1"})
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert done.stderr.strip() == "rlora: error: " + message.format(out=out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine\n"


def test_module_entry_point_and_help():
    done = subprocess.run([sys.executable, "-m", "rlora", "train", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "embedded demo" in done.stdout and "train.prompts_per_step" in done.stdout
    done = subprocess.run([sys.executable, "-m", "rlora", "train", "lora.rnak=4"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == "rlora: error: unknown config key 'lora.rnak' (did you mean 'lora.rank'?)"
    assert Path(sys.executable).with_name("rlora").exists()


def test_hanging_reward_times_out_with_one_line(tiny_model_dir, prompts_file, tmp_path, capsys):
    args = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"), **{
        "rewards": "[{fn: rewards_for_tests.hangs, timeout_s: 0.5}]", "eval.before": "false"})
    code, err = run_cli(["train", *args], capsys)
    assert code == 2 and "rlora: error: reward fn 'hangs' did not return within 0.5 s" in err
    assert (tmp_path / "o" / "adapter" / "adapter_model.safetensors").is_file()  # what was learnt is kept


def test_debug_shows_the_traceback(capsys):
    code, err = run_cli(["train", "train.stpes=2", "--debug"], capsys)
    assert code == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("rlora: error: unknown config key")


def test_truncated_adapter_file_and_adapter_for_another_base(tiny_model_dir, prompts_file, tmp_path, capsys):
    from rlora.models.tiny import build_random_model

    first = tmp_path / "first"
    assert run_cli(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(first), **{
        "train.steps": 1, "eval.before": "false", "eval.after": "false"})], capsys)[0] == 0
    adapter = first / "adapter"
    other = str(build_random_model(tmp_path / "qwen", family="qwen2", hidden=96, seed=2))
    code, err = run_cli(["train", *tiny_overrides(other, prompts_file, str(tmp_path / "o1"), **{
        "lora.init_from": str(adapter)})], capsys)
    assert code == 2 and "does not fit model" in err and len(err.strip().splitlines()) == 1, err
    weights = adapter / "adapter_model.safetensors"
    data = weights.read_bytes()
    for cut in (100, len(data) - 64):  # inside the header; inside the tensor data
        weights.write_bytes(data[:cut])
        code, err = run_cli(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o2"), **{
            "lora.init_from": str(adapter)})], capsys)
        assert code == 2 and "is damaged" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("bad, message", [
    ({"data.path": "no.jsonl"}, "data file not found"),
    ({"model.path": "tiny-modle"}, "is not a local folder or a built-in alias"),
    ({"rollout.max_new_tokens": 5000}, "rollout.max_new_tokens=5000 does not fit"),
])
def test_a_bad_input_under_auto_settings_prints_one_line(bad, message, tiny_model_dir, prompts_file, tmp_path, capsys):
    """`auto` settings say what they chose, but only once every input check has passed (the model path and the
    completion budget are checked after the tokenizer loads): a bad input prints its error and nothing else."""
    args = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"), **{"rollout.sampler_dtype": "auto",
                                                                               "algo.sampler_is_cap": 2.0, **bad})
    code, err = run_cli(["train", *args], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("rlora: error:") and message in lines[0], err
    assert not (tmp_path / "o").exists()


def test_auto_settings_are_announced_once_the_inputs_pass(tiny_model_dir, prompts_file, tmp_path, capsys):
    args = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"), **{"rollout.sampler_dtype": "auto",
                                                                               "train.steps": 1, "eval.before": "false"})
    code, err = run_cli(["train", *args], capsys)
    assert code == 0 and err.count("rollout.sampler_dtype=auto ->") == 1, err


def test_resume_auto_into_a_run_without_checkpoints_says_so(tiny_model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "done"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    code, err = run_cli(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(out), **{"train.resume": "auto"})],
                        capsys)
    assert code == 2 and err.strip() == (
        f"rlora: error: train.resume=auto: '{out}' holds a run but no checkpoint to resume from "
        "(train.checkpoint_every=N writes them): choose a new folder, or set train.overwrite=true to replace that run")
    assert [p.name for p in out.iterdir()] == ["metrics.jsonl"]


def test_a_target_typo_on_a_model_without_decoder_layers_lists_its_leaf_modules():
    """GPT-2-like paths (transformer.h.N.attn.c_attn) hold no `.layers.`: the hint named no module at all."""
    from collections import OrderedDict

    from torch import nn

    from rlora.config import LoraConfig
    from rlora.models.loading import peft_lora_config

    block = nn.Sequential(OrderedDict(c_attn=nn.Linear(2, 2), c_proj=nn.Linear(2, 2)))
    model = nn.Sequential(OrderedDict(h=nn.Sequential(block)))
    with pytest.raises(UserError, match=r"^lora.target_modules \['q_proj'\] match no module of this model: choose "
                                        r"from c_attn, c_proj \(its leaf modules\)"):
        peft_lora_config(LoraConfig(target_modules=["q_proj"]), model)
    assert peft_lora_config(LoraConfig(target_modules=["c_attn"]), model).target_modules == {"c_attn"}
