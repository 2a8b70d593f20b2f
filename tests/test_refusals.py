"""The table of refused combinations (rlora/config/refusals.py), walked row by row: each row's example refuses
with that row's one-line message (and not an earlier row's), at load for a config row, at launch for a row that
reads the number of ranks; the command's base config without the example is accepted."""

from __future__ import annotations

import pytest
from conftest import tiny_overrides
from test_sft import REPETITIVE, sft_config, write_jsonl

from rlora.cli import main
from rlora.config import REFUSALS, LoraConfig, RefusedCombination, check_init_from_keys, check_launch, load_config
from rlora.errors import UserError
from rlora.config.refusals import COMMANDS, EXAMPLE_BASES as BASES

CASES = [pytest.param(row, command, id=f"{row.name}-{command}") for row in REFUSALS for command in row.commands]


def test_rows_have_unique_names_and_known_commands():
    names = [row.name for row in REFUSALS]
    assert len(set(names)) == len(names), [n for n in names if names.count(n) > 1]
    assert {command for row in REFUSALS for command in row.commands} <= set(COMMANDS.values())
    assert all(row.example for row in REFUSALS)


@pytest.mark.parametrize("command", sorted(BASES))
def test_the_base_configs_are_accepted(command):
    model_cls, base = BASES[command]
    cfg = load_config(None, list(base), model_cls=model_cls)
    check_launch(cfg, 1)
    check_launch(cfg, 2)


@pytest.mark.parametrize("row, command", CASES)
def test_each_row_refuses_its_example(row, command):
    model_cls, base = BASES[command]
    overrides = [*base, *row.example]
    if not row.launch:
        with pytest.raises(RefusedCombination) as refused:
            load_config(None, overrides, model_cls=model_cls)
    else:
        cfg = load_config(None, overrides, model_cls=model_cls)  # launch rows wait for the number of ranks
        with pytest.raises(RefusedCombination) as refused:
            check_launch(cfg, row.example_ranks)
    assert refused.value.row == row.name
    message = str(refused.value)
    assert "\n" not in message, message  # one line
    keys = [item.partition("=")[0] for item in row.example]
    named = keys + [key.rpartition(".")[0] for key in keys if key.count(".") > 1]  # algo.replay.enabled: algo.replay
    assert any(key in message for key in named), message  # it names a key it is about



def test_a_config_built_in_python_gets_the_presets_and_the_table_when_its_run_starts(tmp_path):
    """RLConfig(...) skips load_config: `rlora train`'s input checks apply the algorithm's presets and the table."""
    from rlora.config import RLConfig
    from rlora.train.session import check_inputs

    base = {"data": {"task": "chain_sum"}, "rewards": [{"fn": "gym"}]}
    cfg = RLConfig(**base, algo={"name": "dapo"}, train={"output_dir": str(tmp_path / "dapo")})
    assert cfg.algo.clip_high == 0.2 and not cfg.algo.dynamic_sampling  # the schema's defaults, before the run
    check_inputs(cfg)
    assert cfg.algo.clip_high == 0.28 and cfg.algo.dynamic_sampling  # DAPO's presets
    refused = RLConfig(**base, algo={"name": "gspo", "loss_agg": "token_mean"}, train={"output_dir": str(tmp_path / "g")})
    with pytest.raises(RefusedCombination) as error:
        check_inputs(refused)
    assert error.value.row == "gspo-sequence-loss"
    assert not (tmp_path / "g").exists()


def _adapter_folder(folder, **settings):
    """A folder with the adapter_config.json PEFT writes (all-linear saved as full module paths), no weights."""
    import json

    meta = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "use_rslora": False, "target_modules": [
        "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "model.layers.0.mlp.down_proj"]}
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({**meta, **settings}))
    return str(folder)


def test_init_from_refuses_the_lora_keys_it_would_ignore(tmp_path):
    """lora.init_from loads the adapter's own rank, alpha and targets: a rank-4 q_proj-only config on a rank-8 adapter
    trained the rank-8 one and recorded rank 4. A value the adapter has is accepted (a config may repeat it), and so
    is a default; a folder without adapter_config.json is left to the adapter-folder check."""
    adapter = _adapter_folder(tmp_path / "adapter")

    def lora(**keys):
        return LoraConfig(init_from=adapter, **keys)

    with pytest.raises(UserError) as refused:
        check_init_from_keys(lora(rank=4, target_modules=["q_proj"]))
    assert str(refused.value) == (f"lora.init_from loads the adapter with its own rank, alpha and target modules "
                                  f"({adapter} has rank 8): remove lora.rank")
    with pytest.raises(UserError, match=r"target_modules \['down_proj', 'q_proj'\]\): remove lora.target_"):
        check_init_from_keys(lora(rank=8, target_modules=["q_proj"]))
    with pytest.raises(UserError, match=r"has use_rslora False\): remove lora.use_rslora$"):
        check_init_from_keys(lora(use_rslora=True))
    check_init_from_keys(lora(rank=8, alpha=16, target_modules=["q_proj", "down_proj"]))  # the adapter's own
    check_init_from_keys(lora())  # defaults: nothing set, nothing ignored
    (tmp_path / "empty").mkdir()
    check_init_from_keys(LoraConfig(init_from=str(tmp_path / "empty"), rank=4))
    check_init_from_keys(LoraConfig(init_from=str(tmp_path / "gone"), rank=4))  # `rlora eval` of an older run


@pytest.mark.parametrize("command", ["train", "sft"])
def test_init_from_with_an_ignored_key_stops_before_the_model_loads(command, tiny_model_dir, prompts_file, tmp_path,
                                                                    capsys):
    adapter = _adapter_folder(tmp_path / "adapter")
    out = tmp_path / "o"
    if command == "train":
        argv = ["train", *tiny_overrides(tiny_model_dir, prompts_file, str(out), **{"lora.init_from": adapter})]
    else:
        rows = write_jsonl(tmp_path / "rows.jsonl", REPETITIVE)
        argv = ["sft", sft_config(tmp_path, tiny_model_dir, rows, output_dir=str(out)), f"lora.init_from={adapter}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("has rank 8): remove lora.rank") and len(err.splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("overrides, row", [
    # one generation: the batch arithmetic (2 x 1 rows, micro-batches of 8) is not what the user has to change
    (["algo.name=rloo", "rollout.num_generations=1"], "one-generation-without-critic"),
])
def test_the_row_that_decides_comes_before_rows_about_its_consequences(overrides, row):
    with pytest.raises(RefusedCombination) as refused:
        load_config(None, overrides)
    assert refused.value.row == row, str(refused.value)
