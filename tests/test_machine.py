"""`auto` settings follow the machine: bf16 sampling only where the device computes bf16 natively."""

import pytest
import yaml

from conftest import tiny_overrides
from rlora import machine
from rlora.cli import main

NO_BF16 = frozenset({"sse4_2", "avx", "avx2", "fma", "avx512f"})  # AVX512 without its BF16 extension counts as none
BF16 = NO_BF16 | {"avx512_bf16"}
AMX = NO_BF16 | {"amx_tile", "amx_bf16"}


@pytest.mark.parametrize("flags,model_dtype,want", [
    (NO_BF16, "float32", "model"), (BF16, "float32", "bfloat16"), (AMX, "float32", "bfloat16"),
    (BF16, "bfloat16", "model"), (BF16, "float16", "model"), (frozenset(), "float32", "model")])
def test_auto_sampler_dtype_on_a_cpu(flags, model_dtype, want):
    assert machine.resolve_sampler_dtype("auto", model_dtype, "cpu", flags) == want


@pytest.mark.parametrize("setting", ["model", "bfloat16", "float16", "float32"])
def test_an_explicit_sampler_dtype_is_kept(setting):
    assert machine.resolve_sampler_dtype(setting, "float32", "cpu", NO_BF16) == setting


def test_native_half_on_a_cpu():
    assert not machine.native_half("cpu", "bfloat16", NO_BF16) and machine.native_half("cpu", "bfloat16", BF16)
    assert not machine.native_half("cpu", "float16", BF16) and machine.native_half("cpu", "float16", NO_BF16 | {"amx_fp16"})


def test_cpu_flags_are_this_machines():
    flags = machine.cpu_flags()
    with open("/proc/cpuinfo", encoding="utf-8") as handle:
        text = handle.read()
    assert flags and all(flag in text for flag in flags)
    assert ("avx512_bf16" in flags) == (" avx512_bf16" in text)


@pytest.mark.parametrize("flags,want", [(NO_BF16, "model"), (BF16, "bfloat16")])
def test_a_run_with_auto_prints_and_saves_the_choice(flags, want, monkeypatch, tiny_model_dir, prompts_file, tmp_path,
                                                     capsys):
    """The choice is printed once and written to config.yaml, which a resume compares against."""
    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, prompts_file, str(out), **{
        "rollout.sampler_dtype": "auto", "train.steps": 1, "eval.before": "false", "eval.after": "false"})
    assert main(["train", *args]) == 0
    err = capsys.readouterr().err
    assert err.count("rollout.sampler_dtype=auto") == 1 and f"auto -> {want}" in err, err
    assert yaml.safe_load((out / "config.yaml").read_text())["rollout"]["sampler_dtype"] == want
    assert "slower" not in err  # never a choice that rlora itself calls slower


def test_a_bf16_sampler_on_a_cpu_without_it_is_called_slower(monkeypatch, tiny_model_dir, prompts_file, tmp_path, capsys):
    monkeypatch.setattr(machine, "cpu_flags", lambda: NO_BF16)
    args = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "run"), **{
        "rollout.sampler_dtype": "bfloat16", "train.steps": 1, "eval.before": "false", "eval.after": "false"})
    assert main(["train", *args]) == 0
    assert "will be slower, not faster" in capsys.readouterr().err


def test_auto_with_the_hf_engine_is_the_models_dtype(tiny_model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, prompts_file, str(out), **{
        "rollout.sampler_dtype": "auto", "rollout.engine": "hf", "algo.sampler_is_cap": "null", "train.steps": 1,
        "eval.before": "false", "eval.after": "false"})
    assert main(["train", *args]) == 0
    assert yaml.safe_load((out / "config.yaml").read_text())["rollout"]["sampler_dtype"] == "model"
