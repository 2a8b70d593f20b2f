"""docs/configuration.md is generated from the config classes and must not drift; the example configs in
configs/ load, and the Qwen ones pass every check that runs before a model loads."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from rlora.config import RLConfig, RMConfig, SFTConfig, load_config
from rlora.config_docs import REGENERATE, main, render_reference
from rlora.data.tasks import check_task

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "configuration.md"
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
QWEN = {
    "qwen2.5-0.5b-instruct-math.yaml": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5-1.5b-instruct-math.yaml": "Qwen/Qwen2.5-1.5B-Instruct",
}


@pytest.fixture(scope="module")
def reference() -> str:
    return render_reference()


def test_reference_file_is_up_to_date(reference):
    assert REFERENCE.is_file(), f"docs/configuration.md is missing: generate it with `{REGENERATE}`"
    assert REFERENCE.read_text(encoding="utf-8") == reference, (
        f"docs/configuration.md is out of date with src/rlora/config/: regenerate it with `{REGENERATE}`")


def test_render_is_deterministic(reference):
    assert render_reference() == reference


def _keys(model: type[BaseModel], prefix: str) -> list[str]:
    """Every dotted key under `model`, written independently of rlora.config_docs."""
    keys = []
    for name, field in model.model_fields.items():
        key = prefix + name
        keys.append(key)
        annotation = field.annotation
        candidates = [annotation, *typing.get_args(annotation)]
        for candidate in candidates:
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                keys += _keys(candidate, key + ("[]." if typing.get_origin(annotation) is list else "."))
                break
    return keys


def test_every_field_of_every_section_is_listed(reference):
    sections = list(RLConfig.model_fields)
    assert {"model", "lora", "data", "rewards", "rollout", "algo", "train", "eval"} <= set(sections)
    for section in sections:
        assert f"## `{section}`" in reference, section
    keys = _keys(RLConfig, "")
    # nested sections and lists of sections are walked too
    assert {"rollout.think.temperature", "algo.adaptive.max_retries", "algo.replay.is_cap", "rewards[].fn",
            "algo.adaptive.schedule[].top_p"} <= set(keys)
    top_level_sections = {name for name, f in RLConfig.model_fields.items()
                          if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}
    missing = [key for key in keys if key not in top_level_sections and f"| `{key}` |" not in reference]
    assert not missing, f"fields missing from the reference: {missing}"


def _row(reference: str, key: str) -> list[str]:
    for line in reference.splitlines():
        if line.startswith(f"| `{key}` |"):
            return [cell.strip() for cell in line.strip("|").split(" | ")]
    raise AssertionError(f"no row for {key}")


def test_known_defaults_types_and_constraints(reference):
    assert _row(reference, "rollout.num_generations")[1:4] == ["`int`", "`8`", "`>= 1`"]
    assert _row(reference, "algo.adv_scale")[1:3] == ['`"group" \\| "batch" \\| "none"`', '`"group"`']
    assert _row(reference, "rollout.temperature_end")[1:4] == ["`float \\| None`", "`null`", "`> 0`"]
    assert _row(reference, "rollout.stop")[1:3] == ["`list[str]`", "`[]`"]
    assert _row(reference, "algo.adaptive.max_retries")[1:4] == ["`int`", "`2`", "`>= 1`, `<= 16`"]
    assert _row(reference, "rewards[].fn")[2] == "required"
    assert _row(reference, "rollout.think")[1:3] == ["`ThinkConfig \\| None`", "`null`"]


def test_algorithm_presets_table(reference):
    from rlora.algos.registry import ALGORITHMS

    presets = reference.split("## Algorithm presets", 1)[1]
    for name in ALGORITHMS:
        assert f"| `{name}` |" in presets
    dapo = _row(presets, "dapo")[1]
    assert "`algo.clip_high` = `0.28`" in dapo and "`algo.dynamic_sampling` = `true`" in dapo
    assert "`algo.overlong_buffer`" in dapo and "max_new_tokens // 5" in dapo  # a callable, described
    assert "`algo.adaptive.enabled` = `true`" in _row(presets, "adaptive_grpo")[1]


def test_check_option(tmp_path, capsys):
    out = tmp_path / "configuration.md"
    assert main(["--check", "--output", str(out)]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert main(["--output", str(out)]) == 0
    assert main(["--check", "--output", str(out)]) == 0
    out.write_text(out.read_text() + "edited by hand\n")
    assert main(["--check", "--output", str(out)]) == 1
    assert f"regenerate it with `{REGENERATE}`" in capsys.readouterr().err


# ---- example configs -----------------------------------------------------------------------------------

def test_example_configs_exist():
    assert set(QWEN) <= {path.name for path in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_example_config_loads(path):
    if path.read_text(encoding="utf-8").startswith("# rlora sft "):
        cfg = load_config(str(path), [], model_cls=SFTConfig)  # `rlora sft` configs: no rewards
        assert cfg.data.path
        return
    if path.read_text(encoding="utf-8").startswith("# rlora rm "):
        cfg = load_config(str(path), [], model_cls=RMConfig)  # `rlora rm` configs: preference pairs, no rewards
        assert cfg.data.chosen_column and cfg.data.rejected_column
        return
    cfg = load_config(str(path), [])  # keys, types, constraints and combinations; nothing is downloaded
    assert cfg.rewards


def test_sft_sections_are_listed(reference):
    sft = reference.split("## `rlora sft`", 1)[1].split("## `rlora rm`", 1)[0]
    for key in _keys(SFTConfig, ""):
        if key.startswith(("data.", "train.")):
            assert f"| `{key}` |" in sft, key


def test_rm_sections_are_listed(reference):
    rm = reference.split("## `rlora rm`", 1)[1].split("## Algorithm presets", 1)[0]
    for key in _keys(RMConfig, ""):
        if key.startswith(("data.", "train.")):
            assert f"| `{key}` |" in rm, key


@pytest.mark.parametrize("name", sorted(QWEN))
def test_qwen_configs_pass_the_checks_before_model_loading(name, tmp_path):
    from rlora.train.session import check_inputs

    path = ROOT / "configs" / name
    header = path.read_text(encoding="utf-8").splitlines()[0]
    assert header == f"# rlora train configs/{name}"
    cfg = load_config(str(path), [f"train.output_dir={tmp_path / 'run'}"])
    assert cfg.model.path == QWEN[name] and cfg.model.dtype == "bfloat16"
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules) == (32, 64.0, "all-linear")
    assert cfg.data.task is not None and cfg.rollout.num_generations == 8
    check_task(cfg.data.task, cfg.data.task_args)
    assert "gym" in [spec.fn for spec in cfg.rewards]
    # everything rlora validates without a model (task, reward functions, output folder); loads no model
    run_dir, rewards, resume_from, _, _ = check_inputs(cfg)
    assert len(rewards) == len(cfg.rewards) and resume_from is None
    assert not (tmp_path / "run").exists()
