"""The table of refused combinations (rlora/config/refusals.py), walked row by row: each row's example refuses
with that row's one-line message (and not an earlier row's), at load for a config row, at launch for a row that
reads the number of ranks; the command's base config without the example is accepted."""

from __future__ import annotations

import pytest

from rlora.config import REFUSALS, RefusedCombination, check_launch, load_config
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
