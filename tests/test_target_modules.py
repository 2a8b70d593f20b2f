"""A target module's typo (lora.target_modules, molora.target_modules) is one line, said from the model's config
before any weight loads (models/loading.py skeleton), in each command that attaches an adapter: train, sft, rm."""

import pytest
from conftest import tiny_overrides
from test_molora_sft import ROWS, SETTINGS, molora_config
from test_rm import PAIRS, rm_config
from test_rm import write_jsonl
from test_sft import REPETITIVE, sft_config

from rlora.cli import main
from rlora.models import loading
from rlora.models.loading import skeleton
from rlora.train import rm, session, sft


def _no_weights(monkeypatch):
    """Loading the weights fails the test: the refusal must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the weights loaded before the target modules were checked")
    for module in (loading, session, sft, rm):
        monkeypatch.setattr(module, "load_base_model", refuse)


@pytest.mark.parametrize("command", ["train", "sft", "rm", "train-molora", "sft-molora"])
def test_a_target_typo_is_refused_before_the_weights_load(command, tiny_model_dir, prompts_file, tmp_path, capsys,
                                                          monkeypatch):
    _no_weights(monkeypatch)
    if command == "train":
        argv = ["train", *tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "run"),
                                         **{"lora.target_modules": "[q_prj]"})]
    elif command == "train-molora":
        plain = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "run"))
        argv = ["train", *[a for a in plain if not a.startswith("lora.rank=")],
                "molora={num_experts: 2, top_k: 1, rank: 2, target_modules: [q_prj]}"]
    elif command == "sft":
        argv = ["sft", sft_config(tmp_path, tiny_model_dir, write_jsonl(tmp_path / "rows.jsonl", REPETITIVE)),
                "lora.target_modules=[q_prj]"]
    elif command == "sft-molora":
        data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
        argv = ["sft", molora_config(tmp_path, tiny_model_dir, data, SETTINGS["sequence-top2"]),
                "molora.target_modules=[q_prj]"]
    else:
        argv = ["rm", rm_config(tmp_path, tiny_model_dir, write_jsonl(tmp_path / "pairs.jsonl", PAIRS)),
                "lora.target_modules=[q_prj]"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlora: error: ") and "\n" not in err, err
    assert "['q_prj'] match no" in err and "q_proj" in err, err  # the typo, and the names to choose from
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_the_skeleton_has_the_models_modules_without_weights(tiny_model_dir):
    """The meta-device model names the same modules as the loaded one and holds no data."""
    from rlora.config import ModelConfig
    loaded = loading.load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir)
    bare = skeleton(tiny_model_dir)
    assert [n for n, _ in bare.named_modules()] == [n for n, _ in loaded.named_modules()]
    assert all(p.is_meta for p in bare.parameters())


def test_a_model_that_cannot_be_built_bare_is_checked_after_loading(tiny_model_dir, tmp_path, monkeypatch):
    """No skeleton (custom code that cannot run on the meta device, here simulated): no early refusal, and attaching
    the adapter to the loaded model still refuses the typo."""
    from rlora.config import LoraConfig, ModelConfig
    from rlora.errors import UserError
    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_config",
                        lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("meta")))
    assert skeleton(tiny_model_dir) is None
    loading.check_lora_targets(LoraConfig(target_modules=["q_prj"]), tiny_model_dir)  # nothing to check against
    base = loading.load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir)
    with pytest.raises(UserError, match=r"\['q_prj'\] match no module"):
        loading.attach_lora(base, LoraConfig(target_modules=["q_prj"]))
