"""lora.init_from is honoured by every command that takes it (rlora train, with one policy and with several;
rlora sft; rlora rm): a run starts from the adapter it names. The reference is independent of rlora: a PEFT
adapter with random non-zero A and B written here by peft itself, and the saved results read back with
safetensors. One step at lr 1e-12 moves no weight by more than ~1e-12 (Adam's step is about lr per weight), so
the saved adapter must equal the init adapter to 1e-6, while the same run without lora.init_from (B = 0 at the
start) ends ~0.05 away from it; and the first step's logged numbers, computed by the model that was loaded,
differ from the plain run's."""

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides
from safetensors.torch import load_file

from rlora.cli import main


@pytest.fixture(scope="module")
def init_adapter(tiny_model_dir, tmp_path_factory) -> Path:
    """A rank-4 PEFT adapter on every linear layer of the tiny base, A and B drawn N(0, 0.05^2): it changes
    the model's outputs (B != 0), unlike a fresh adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("init") / "adapter"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(str(folder))
    return folder


def _distance(init: Path, saved: Path) -> float:
    """max |saved - init| over the init adapter's tensors; the saved adapter holds exactly the same ones."""
    want, got = load_file(str(init / "adapter_model.safetensors")), load_file(str(saved / "adapter_model.safetensors"))
    assert set(got) == set(want) and len(want) > 0
    assert any(float(v.abs().min()) > 0 for k, v in want.items() if "lora_B" in k)  # the init's B is not zero
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _cli(args: list[str], capsys) -> None:
    code = main(args)
    err = capsys.readouterr().err
    assert code == 0, err


# lr 1e-12: the one optimizer step moves each weight by ~1e-12, far below the 1e-6 tolerance (float32 rounding
# of a weight of size ~0.1 is ~1e-8); the init's B is ~0.05 from a fresh adapter's 0, far above it.
TINY_LR = 1e-12


def test_train_starts_from_init_from(tiny_model_dir, prompts_file, init_adapter, tmp_path, capsys):
    """rlora train: the saved adapter after one step at lr 1e-12 equals the init adapter, and the first step's
    KL to the reference (the base, adapter off) is > 0, where a fresh adapter (B = 0) is the base: KL 0."""
    common = {"train.steps": 1, "train.lr": TINY_LR, "algo.beta": 0.04, "eval.before": "false", "eval.after": "false"}
    runs = {}
    for name, extra in (("init", {"lora.init_from": str(init_adapter)}), ("fresh", {})):
        runs[name] = tmp_path / name
        _cli(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(runs[name]), **common, **extra)], capsys)
    assert _distance(init_adapter, runs["init"] / "adapter") <= 1e-6
    assert _distance(init_adapter, runs["fresh"] / "adapter") > 1e-2
    [started], [fresh] = _rows(runs["init"]), _rows(runs["fresh"])
    assert fresh["kl"] == 0.0 and started["kl"] > 1e-4, (started["kl"], fresh["kl"])  # 6.6e-3 on 2026-11-26


def test_policies_start_from_init_from(tiny_model_dir, prompts_file, init_adapter, tmp_path, capsys):
    """rlora train with two policies on one base (models/multi_lora.py loads the adapter once per policy):
    each policy's saved adapter equals the init adapter, and each one's first KL is > 0."""
    out = tmp_path / "both"
    args = tiny_overrides(tiny_model_dir, prompts_file, str(out), **{
        "lora.init_from": str(init_adapter), "train.steps": 1, "train.lr": TINY_LR, "algo.beta": 0.04,
        "eval.before": "false", "eval.after": "false", "rollout.merge_adapter": "false"})
    _cli(["train", *args, "policies=[{name: p, seed: 4}, {name: q, seed: 9}]"], capsys)
    for name in ("p", "q"):
        assert _distance(init_adapter, out / "policies" / name / "adapter") <= 1e-6, name
        [row] = _rows(out / "policies" / name)
        assert row["kl"] > 1e-4, (name, row["kl"])  # 5-7e-3 on 2026-11-26: a fresh adapter's is 0.0


def test_sft_starts_from_init_from(tiny_model_dir, init_adapter, tmp_path, capsys):
    """rlora sft: the saved adapter equals the init adapter after one step at lr 1e-12, and the first step's
    loss (the init model's cross-entropy) differs from the fresh adapter's (the base's)."""
    from test_sft import REPETITIVE, sft_config, write_jsonl

    data = write_jsonl(tmp_path / "rows.jsonl", REPETITIVE)
    runs = {}
    for name, extra in (("init", [f"lora.init_from={init_adapter}"]), ("fresh", [])):
        runs[name], folder = tmp_path / name, tmp_path / f"{name}-config"
        folder.mkdir()
        config = sft_config(folder, tiny_model_dir, data, steps=1, lr=TINY_LR, output_dir=str(runs[name]))
        _cli(["sft", config, *extra], capsys)
    assert _distance(init_adapter, runs["init"] / "adapter") <= 1e-6
    assert _distance(init_adapter, runs["fresh"] / "adapter") > 1e-2
    [started], [fresh] = _rows(runs["init"]), _rows(runs["fresh"])
    # 5.9225 and 5.9277 on 2026-11-26; the two runs see the same batch, so an ignored init_from gives equal losses
    assert abs(started["loss"] - fresh["loss"]) > 1e-4, (started["loss"], fresh["loss"])


def test_rm_starts_from_init_from(tiny_model_dir, init_adapter, tmp_path, capsys):
    """rlora rm: the reward model's adapter equals the init adapter after one step at lr 1e-12; with a random
    score head (the same seed in both runs), the first step's loss differs from the fresh adapter's."""
    from test_rm import PAIRS, rm_config, write_jsonl

    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    runs = {}
    for name, extra in (("init", [f"lora.init_from={init_adapter}"]), ("fresh", [])):
        runs[name], folder = tmp_path / name, tmp_path / f"{name}-config"
        folder.mkdir()
        config = rm_config(folder, tiny_model_dir, data, steps=1, lr=TINY_LR, head_init_std=0.5,
                           output_dir=str(runs[name]))
        _cli(["rm", config, *extra], capsys)
    assert _distance(init_adapter, runs["init"] / "reward_model") <= 1e-6
    assert _distance(init_adapter, runs["fresh"] / "reward_model") > 1e-2
    [started], [fresh] = _rows(runs["init"]), _rows(runs["fresh"])
    assert abs(started["loss"] - fresh["loss"]) > 1e-4, (started["loss"], fresh["loss"])  # 0.88 and 0.66 that day


def test_a_missing_init_from_folder_says_not_found(tiny_model_dir, prompts_file, tmp_path, capsys):
    from conftest import tiny_overrides
    from rlora.cli import main

    missing = tmp_path / "run" / "adapter"
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"),
                                          **{"lora.init_from": str(missing)})]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"rlora: error: lora.init_from '{missing}' not found: train that run first (e.g. the SFT warm-up a "
                   "config names), or set lora.init_from=null to start from a fresh adapter"), err
    assert not (tmp_path / "o").exists()
    run = tmp_path / "done"  # a run folder given where its adapter is meant
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"),
                                          **{"lora.init_from": str(run)})]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"rlora: error: lora.init_from '{run}' is a run folder: give the adapter inside it, '{run / 'adapter'}'"
