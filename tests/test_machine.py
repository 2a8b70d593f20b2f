"""`auto` settings follow the machine: bf16 sampling only where the device computes bf16 natively."""

from pathlib import Path

import pytest
import yaml

from conftest import tiny_overrides
from rlora import machine
from rlora.cli import main
from rlora.rollout.packed import packed_fp16_available

NO_BF16 = frozenset({"sse4_2", "avx", "avx2", "fma", "avx512f"})  # AVX512 without its BF16 extension counts as none
BF16 = NO_BF16 | {"avx512_bf16"}
AVX2_F16C = NO_BF16 | {"f16c"}  # what fbgemm's float16-weight products need (a common x86 CPU without native bf16)
AMX = NO_BF16 | {"amx_tile", "amx_bf16"}


@pytest.mark.parametrize("flags,overrides,want", [
    (NO_BF16, [], "model"), (BF16, [], "bfloat16"), (AMX, [], "bfloat16"),
    (BF16, ["model.dtype=bfloat16"], "model"), (BF16, ["algo.sampler_is_cap=null"], "model"),  # no correction
    (BF16, ["rollout.engine=hf", "algo.sampler_is_cap=null"], "model"), (frozenset(), [], "model"),
    (NO_BF16, ["rollout.sampler_dtype=bfloat16"], "bfloat16"),  # an explicit choice is kept
    (AVX2_F16C, [], "float16_weights"), (AVX2_F16C, ["algo.sampler_is_cap=null"], "model"),
    (AVX2_F16C, ["rollout.merge_adapter=false"], "model"), (AVX2_F16C, ["train.fsdp=true"], "model"),
    (AVX2_F16C, ["model.dtype=bfloat16"], "model"),
    (AVX2_F16C | {"amx_bf16"}, [], "bfloat16")])
def test_auto_sampler_dtype_on_a_cpu(flags, overrides, want, monkeypatch):
    """The demo config (float32 model, algo.sampler_is_cap 2.0) on CPUs with and without native bf16."""
    from rlora.config import load_config
    from rlora.train.session import resolve_machine_settings

    if "float16_weights" in want and not packed_fp16_available():
        pytest.skip("torch without the fbgemm engine")
    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    cfg = load_config(None, ["model.device=cpu", *overrides])
    resolve_machine_settings(cfg)
    assert cfg.rollout.sampler_dtype == want


def test_native_half_on_a_cpu():
    assert not machine.native_half("cpu", "bfloat16", NO_BF16) and machine.native_half("cpu", "bfloat16", BF16)
    assert not machine.native_half("cpu", "float16", BF16) and machine.native_half("cpu", "float16", NO_BF16 | {"amx_fp16"})


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="Linux only: /proc/cpuinfo")
def test_cpu_flags_are_this_machines():
    words = Path("/proc/cpuinfo").read_text().split()
    flags = machine.cpu_flags()
    assert flags and all(flag in words for flag in flags)
    assert ("avx512_bf16" in flags) == ("avx512_bf16" in words)


@pytest.mark.parametrize("flags,want", [(NO_BF16, "model"), (BF16, "bfloat16"), (AVX2_F16C, "float16_weights")])
def test_a_run_with_auto_prints_and_saves_the_choice(flags, want, monkeypatch, tiny_model_dir, prompts_file, tmp_path,
                                                     capsys):
    """The choice is printed once and written to config.yaml, which a resume compares against."""
    if want == "float16_weights" and not packed_fp16_available():
        pytest.skip("torch without the fbgemm engine")
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


def test_a_resumed_run_keeps_its_checkpoints_choice(monkeypatch, tiny_model_dir, prompts_file, tmp_path, capsys):
    """Made on a CPU with native bf16, resumed on one without: auto takes the checkpoint's bfloat16 (the samples
    depend on it) instead of refusing the resume for a setting the user never wrote."""
    out = tmp_path / "run"
    common = {"rollout.sampler_dtype": "auto", "train.checkpoint_every": 1, "eval.before": "false",
              "eval.after": "false"}
    monkeypatch.setattr(machine, "cpu_flags", lambda: BF16)
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(out), **common, **{"train.steps": 1})]) == 0
    monkeypatch.setattr(machine, "cpu_flags", lambda: NO_BF16)
    capsys.readouterr()
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(out), **common, **{
        "train.steps": 2, "train.resume": "auto"})]) == 0
    err = capsys.readouterr().err
    assert "auto -> bfloat16 (the checkpoint's)" in err and "resuming from" in err
    assert yaml.safe_load((out / "config.yaml").read_text())["rollout"]["sampler_dtype"] == "bfloat16"


@pytest.mark.parametrize("flags,faster", [(BF16, "bfloat16"), (AVX2_F16C, "float16_weights")])
def test_without_a_correction_the_notice_names_the_faster_setting_and_how_to_use_it(flags, faster, monkeypatch):
    from rlora.config import load_config
    from rlora.train.session import resolve_machine_settings

    if faster == "float16_weights" and not packed_fp16_available():
        pytest.skip("torch without the fbgemm engine")
    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    cfg = load_config(None, ["model.device=cpu", "algo.sampler_is_cap=null"])
    [line] = resolve_machine_settings(cfg, announce=False)
    assert line.startswith(f"rollout.sampler_dtype=auto -> model (rollout.sampler_dtype={faster} would be faster (")
    assert "set algo.sampler_is_cap, e.g. 2.0," in line and cfg.rollout.sampler_dtype == "model"


@pytest.mark.parametrize("overrides,want", [
    ([], True), (["train.fsdp=true"], True),  # a gathered base merges once per sampling call
    (["train.fsdp=true", "train.fsdp_gather=layer"], False),  # streamed layers would be merged in every decode step
    (["train.fsdp=true", "train.fsdp_gather=layer", "rollout.merge_adapter=true"], True)])  # an explicit choice is kept
def test_auto_merge_adapter_is_off_where_the_sampler_streams_the_layers(overrides, want):
    """rollout.merge_adapter=auto never picks what rlora reports as slower (train/fsdp.py sharded_samplers' notice:
    merging into streamed layers, 1.45x slower in docs/fsdp.md); the choice is said where it is false."""
    from rlora.config import load_config
    from rlora.train.session import resolve_machine_settings

    cfg = load_config(None, ["model.device=cpu", *overrides])
    lines = resolve_machine_settings(cfg, announce=False)
    assert cfg.rollout.merge_adapter is want
    said = [line for line in lines if line.startswith("rollout.merge_adapter=auto -> false")]
    assert len(said) == (not want)


@pytest.mark.parametrize("saved,want", [({"merge_adapter": True}, True), ({"merge_adapter": False}, False), ({}, True)])
def test_a_resumed_run_keeps_its_checkpoints_merge_setting(saved, want, tmp_path):
    """`auto` resumes with the checkpoint's choice (its samples depend on it) whatever this run's gather mode; a
    checkpoint from before the key merged."""
    import json

    from rlora.config import load_config
    from rlora.train.session import resolve_machine_settings

    (tmp_path / "state.json").write_text(json.dumps({"config": yaml.safe_dump({"rollout": saved})}))
    cfg = load_config(None, ["model.device=cpu", "train.fsdp=true", "train.fsdp_gather=layer"])
    resolve_machine_settings(cfg, resume_from=tmp_path)
    assert cfg.rollout.merge_adapter is want
