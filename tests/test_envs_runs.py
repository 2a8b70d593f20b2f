"""Environments in `rlora train` and `rlora eval`: a one-turn environment trains exactly as the prompt/completion
path; tool and textarena episodes run end to end; bad env settings are one line, exit 2, before the model loads."""

import json

import pytest
import torch
from conftest import tiny_overrides
from safetensors.torch import load_file

from rlora.cli import main


def train(tmp_path, name, tiny_model_dir, prompts_file, capsys, **extra):
    out = tmp_path / name
    code = main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(out), **extra)])
    err = capsys.readouterr().err
    return code, err, out


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_one_turn_environment_trains_exactly_like_prompt_completion(tiny_model_dir, prompts_file, tmp_path, capsys):
    code, err, plain = train(tmp_path, "plain", tiny_model_dir, prompts_file, capsys)
    assert code == 0, err
    code, err, env = train(tmp_path, "env", tiny_model_dir, prompts_file, capsys, **{"env": "{fn: envs_for_tests.single_turn}"})
    assert code == 0, err
    a = load_file(plain / "adapter" / "adapter_model.safetensors")
    b = load_file(env / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for p, e in zip(metrics(plain), metrics(env)):
        for key in ("reward_mean", "loss", "kl", "gen_tokens", "completion_len_mean", "reward/count_a"):
            assert p[key] == e[key], key
        assert e["reward/env"] == 0.0 and e["episode/turns_mean"] == 1.0 and e["episode/done_frac"] + e["episode/truncated_frac"] == 1
    plain_eval, env_eval = (json.loads((out / "eval.json").read_text()) for out in (plain, env))
    for when in ("before", "after"):  # the episode run's evaluation adds its episodes' counters
        assert env_eval[when]["episode/turns_mean"] == 1.0 and env_eval[when]["episodes"] == 4
        assert {k: v for k, v in env_eval[when].items() if not k.startswith("episode")} == plain_eval[when]


def test_tool_episodes_train_and_evaluate(tiny_model_dir, prompts_file, tmp_path, capsys):
    code, err, out = train(tmp_path, "calc", tiny_model_dir, prompts_file, capsys,
                           **{"env": "{fn: calculator, max_turns: 3, max_total_tokens: 64}", "rollout.stop": "[' ']"})
    assert code == 0, err
    rows = metrics(out)
    assert all(r["episodes"] == 8 and 1 <= r["episode/turns_mean"] <= 3 for r in rows)
    assert all(0 <= r["episode/failed_frac"] == 0 for r in rows)
    evals = json.loads((out / "eval.json").read_text())
    assert evals["after"]["n"] == 4
    config = (out / "config.yaml").read_text()
    assert "env:" in config and "fn: calculator" in config
    assert main(["eval", str(out), "--output", str(tmp_path / "ev")]) == 0, capsys.readouterr().err


def test_tool_messages_reach_the_policy_and_reinforce_pp_trains_on_episodes(tiny_model_dir, prompts_file, tmp_path,
                                                                            capsys):
    """Every first reply counts as a calculator call (tests/envs_for_tests.py AlwaysCalls): the tool's result comes
    back as a tool message in the next turn's context, the counters reach the metrics, and REINFORCE++ (token-level
    returns over a mask with the environment's gap) trains on the episodes."""
    code, err, out = train(tmp_path, "calls", tiny_model_dir, prompts_file, capsys,
                           **{"env": "{fn: envs_for_tests.always_calls, max_turns: 2}", "rollout.stop": "[' ']",
                              "algo.name": "reinforce_pp", "algo.beta": 0.01})
    assert code == 0, err
    rows = metrics(out)
    # an episode whose first turn ended (not cut at its budget) made exactly one call, which succeeded
    assert all(0 < r["episode/tool_calls_mean"] <= 1 and r["episode/tool_errors_mean"] == 0 for r in rows)
    assert all(r["episode/turns_mean"] > 1 and r["loss"] is not None for r in rows)


def test_ppo_trains_on_episodes(tiny_model_dir, prompts_file, tmp_path, capsys):
    """PPO's critic on episodes: GAE steps from one policy token to the next over the environment's tokens
    (tests/test_ppo.py), the value loss covers the policy's tokens only, and the episode counters are reported."""
    code, err, out = train(tmp_path, "ppo", tiny_model_dir, prompts_file, capsys,
                           **{"env": "{fn: envs_for_tests.always_calls, max_turns: 2}", "rollout.stop": "[' ']",
                              "algo.name": "ppo"})
    assert code == 0, err
    rows = metrics(out)
    # the critic's tokens are the policy's: the environment's (the tool's result, the headers) are left out
    assert all(r["episode/turns_mean"] > 1 and r["episode/env_tokens_mean"] > 0 for r in rows)
    assert all(r["value_tokens"] == r["gen_tokens"] for r in rows)
    assert all(r["value_loss"] is not None and r["episodes"] == 8 for r in rows)


@pytest.mark.parametrize("env, message", [
    ("{fn: no_such_env}", "env fn 'no_such_env' is not a built-in environment (calculator, tools, textarena): or give"),
    ("{fn: calculater}", "env fn 'calculater' is not a built-in environment (calculator, tools, textarena): did you mean "
                         "'calculator'?"),
    ("{fn: no_module.no_such_env}", "env fn 'no_module.no_such_env'"),
    ("{fn: tools, args: {tools: [envs_for_tests.no_docstring]}}", "tool 'no_docstring' has no docstring"),
    ("{fn: tools, args: {tools: [envs_for_tests.nothing_here]}}", "has no function 'nothing_here'"),
    ("{fn: calculator, max_turns: 0}", "env.max_turns"),
    ("{fn: envs_for_tests.scripted, args: {colour: red}}", "does not take these env.args"),
    ("{fn: textarena, args: {game: NoSuchGame-v0}}", "textarena has no game 'NoSuchGame-v0'"),
    ("{fn: textarena, args: {game: TicTacToe-v0}}", "textarena game 'TicTacToe-v0' cannot start for one player"),
    ("{fn: tools}", "env fn 'tools' needs args.tools"),
    ("{fn: calculator, args: {system_promt: Be brief.}}", "env fn 'calculator' does not take env.args system_promt "
     "(did you mean 'system_prompt'?): it takes call_end, call_start, max_calls_per_turn, system_prompt, timeout_s"),
    ("{fn: envs_for_tests.broken_factory}",
     "env fn 'envs_for_tests.broken_factory' failed to make an environment: TypeError: object of type 'int' has no len()"),
])
def test_bad_env_settings_are_one_line_exit_2(env, message, tiny_model_dir, prompts_file, tmp_path, capsys):
    code, err, out = train(tmp_path, "o", tiny_model_dir, prompts_file, capsys, env=env)
    lines = [line for line in err.splitlines() if line.startswith("rlora: error:")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err and not out.exists()


def test_textarena_guess_the_number_runs_offline(tiny_model_dir, tmp_path, capsys):
    rows = tmp_path / "games.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"game {i}", "seed": i}) + "\n" for i in range(4)))
    code, err, out = train(tmp_path, "ta", tiny_model_dir, str(rows), capsys,
                           **{"env": "{fn: textarena, args: {game: GuessTheNumber-v0}, max_turns: 2}", "rewards": "[]",
                              "train.steps": 1, "eval.before": "false"})
    assert code == 0, err
    [row] = metrics(out)
    # every game started (a failed reset would count as failed) and the policy's replies reached it
    assert row["episodes"] == 8 and row["episode/failed_frac"] == 0 and row["episode/turns_mean"] >= 1
    assert row["reward_count"] == 8 and "reward/env" in row


@pytest.mark.parametrize("game", ["TowerOfHanoi-v0", "Minesweeper-v0", "Sudoku-v0", "FrozenLake-v0", "Mastermind-v0"])
def test_more_textarena_games_start_and_take_a_move_offline(game):
    from rlora.envs.protocol import StepResult, checked_messages
    from rlora.envs.textarena import TextArenaEnvironment

    env = TextArenaEnvironment(game=game)
    [opening] = checked_messages(env.reset({"prompt": "x", "seed": 3}), "reset()")
    assert opening["role"] == "user" and len(opening["content"]) > 50
    result = env.step("[1]")
    assert isinstance(result, StepResult) and (result.done or result.messages[0]["content"])


@pytest.mark.parametrize("extra", [{"algo.name": "dapo", "algo.max_extra_rounds": 1, "algo.overlong_buffer": 0},
                                   {"algo.name": "adaptive_grpo"},
                                   {"algo.replay.enabled": "true", "algo.replay.ratio": 1.0, "train.steps": 3}],
                         ids=["dynamic_sampling", "adaptive", "replay"])
def test_resampling_and_replay_run_on_episodes(extra, tiny_model_dir, prompts_file, tmp_path, capsys):
    """The collector's resampling rounds and replayed groups go through the episode source like any other rows."""
    code, err, out = train(tmp_path, "r", tiny_model_dir, prompts_file, capsys,
                           **{"env": "{fn: envs_for_tests.scripted, args: {turns: 2}}", "rollout.stop": "[' ']", **extra})
    assert code == 0, err
    rows = metrics(out)
    assert all(r["episodes"] >= 8 for r in rows)  # every sampling round's episodes are counted
    if "algo.replay.enabled" in extra:
        assert sum(r.get("replay_groups", 0) for r in rows) > 0  # stored episodes were trained on again


def test_env_and_tool_files_are_found_beside_the_config(tmp_path, monkeypatch):
    """As for rewards: FILE.py:fn and module.fn are read from the config file's folder (not the current directory),
    and the saved config holds absolute paths, so `rlora eval RUN` and a resume find them from anywhere."""
    from rlora.config import load_config

    folder = tmp_path / "cfg"
    folder.mkdir()
    (folder / "my_env.py").write_text("def make():\n    pass\n")
    (folder / "my_tools.py").write_text("def add(a: int, b: int) -> int:\n    '''a + b'''\n    return a + b\n")
    config = folder / "run.yaml"
    config.write_text("data: {path: rows.jsonl}\nenv: {fn: tools, args: {tools: [my_tools.py:add, my_tools.add, "
                      "json.dumps]}}\n")
    monkeypatch.chdir(tmp_path)  # elsewhere
    cfg = load_config(str(config))
    assert cfg.env.args["tools"] == [f"{folder.resolve() / 'my_tools.py'}:add"] * 2 + ["json.dumps"]
    custom = load_config(str(config), ["env.fn=my_env.py:make"])
    assert custom.env.fn == f"{folder.resolve() / 'my_env.py'}:make"
    assert custom.env.args["tools"] == ["my_tools.py:add", "my_tools.add", "json.dumps"]  # a user factory's own args
    assert load_config(str(config), ["env.fn=my_env.make"]).env.fn == f"{folder.resolve() / 'my_env.py'}:make"
