import math
import sys
from fractions import Fraction

import pytest

from rlora.config import RewardSpec
from rlora.data.tasks import make_task_examples
from rlora.errors import UserError
from rlora.rewards.builtin import (closeness_reward, extract_answer, format_reward, gym_reward, math_reward,
                                  numeric_answer)
from rlora.rewards.scoring import resolve_rewards, score_completions


@pytest.mark.parametrize("text, mode, expected", [
    ("The answer is 7.", "auto", "7"),
    ("so 4 - 9 = -5", "auto", "-5"),
    ("1,234 apples", "last_number", "1234"),
    ("x <answer> 12 </answer> then 3", "auto", "12"),
    ("no tags 3", "answer_tag", ""),
    ("no numbers here", "auto", "no numbers here"),
    ("  keep  ", "none", "keep"),
])
def test_extract_answer(text, mode, expected):
    assert extract_answer(text, mode) == expected


def test_gym_reward_uses_reasoning_gym_verifier():
    [ex] = make_task_examples("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, 1, 5)
    answer = ex.columns["answer"]
    wrong = str(int(answer) + 1)
    scores = gym_reward(["q", "q"], [f"The result is {answer}.", f"It is {wrong}"],
                        task=["chain_sum"] * 2, entry=[ex.columns["entry"]] * 2)
    assert scores == [1.0, 0.0]


def test_format_and_math_rewards():
    assert format_reward([""] * 2, ["<answer>3</answer>", "3"]) == [1.0, 0.0]
    assert format_reward([""], ["#### 5"], pattern=r"####\s*\d+") == [1.0]
    assert math_reward(["", ""], ["The answer is $\\frac{1}{2}$", "It is 0.3"], answer=["0.5", "0.5"]) == [1.0, 0.0]


@pytest.mark.parametrize("completion, answer, expected", [
    ("4 - 9 = -5", "-5", 1.0),  # exact
    ("4 - 9 = -4", "-5", 0.8),  # 1 - 1/5
    ("so it is -1", "-5", 0.2),  # 1 - 4/5: a small guess of the right sign earns little
    ("4 - 9 = 5", "-5", 0.0),  # the wrong sign never earns anything: |5 - -5| = 10 >= 5
    ("4 - 9 = 0", "-5", 0.0),
    ("4 + 4 = 6", "8", 0.75),
    ("5 - 5 = 1", "0", 0.0),  # |answer| < 1 counts as 1: one off from 0 is as far as it gets
    ("<answer>2.5</answer> then 9", "2", 0.75),  # extracted as gym does: the tag first
    ("1,240 apples", "1234", 1 - 6 / 1234),
    ("no number", "3", 0.0),
    ("nan", "3", 0.0),
    ("it is -0.25", "0.5", 0.0),  # the wrong sign earns nothing even where |answer| < 1 (1 - 0.75 / 1 would be 0.25)
    ("about 0.25", "0.5", 0.75),  # 1 - 0.25 / max(0.5, 1)
    ("<answer>1/4</answer>", "1/2", 0.75),  # fractions on both sides, exactly
    ("<answer>2.5e3</answer>", "2000", 0.75),  # an exponent inside the tag: 1 - 500 / 2000
    ("−3", "-4", 0.75),  # U+2212 as the minus sign
    # an exponent this large is not a number here: parsing it would build a huge integer (the timeout turns a
    # regression from a hang into a failure)
    pytest.param("<answer>1e999999999</answer>", "3", 0.0, marks=pytest.mark.timeout(20)),
])
def test_closeness_reward_by_hand(completion, answer, expected):
    assert closeness_reward(["q"], [completion], answer=[answer]) == [pytest.approx(expected, abs=1e-12)]


@pytest.mark.parametrize("text, expected", [
    ("1,234", Fraction(1234)), (" -0.5 ", Fraction(-1, 2)), ("3 / 4", Fraction(3, 4)), ("5.", Fraction(5)),
    ("12345678901234567890123", Fraction(12345678901234567890123)),  # exact: a float would end in ...0200
    ("1/0", None), ("inf", None), ("nan", None), ("seven", None), ("", None), ("1e1000", None), ("1.2.3", None),
    ("1,2,3", None), ("1,5", None), ("5,", None), ("12,345,678", Fraction(12345678)), ("3\t/4", None),
    ("9" * 1000, Fraction(10**1000 - 1)), ("9" * 1001, None),  # the length bound: not a number past it
])
def test_numeric_answer_parses_exactly_or_refuses(text, expected):
    assert numeric_answer(text) == expected


@pytest.mark.timeout(20)
def test_numeric_answer_bounds_length_itself():
    """A long digit string is refused by numeric_answer's own bound, also where the process lifted Python's limit on
    converting strings to integers (which would otherwise parse a million digits, slowly)."""
    limit = sys.get_int_max_str_digits()
    try:
        sys.set_int_max_str_digits(0)
        assert numeric_answer("9" * 1_000_000) is None
        assert numeric_answer("9" * 5000) is None
    finally:
        sys.set_int_max_str_digits(limit)


def test_closeness_reward_refuses_a_non_numeric_answer():
    with pytest.raises(ValueError, match="numeric `answer` column, got 'seven'"):
        closeness_reward(["q"], ["7"], answer=["seven"])


def _resolve(*fns, weights=None):
    weights = weights or [1.0] * len(fns)
    return resolve_rewards([RewardSpec(fn=f, weight=w) for f, w in zip(fns, weights)], has_task=False)


def test_weighted_sum_and_per_function_logging():
    rewards = _resolve("format", "rewards_for_tests.count_a", weights=[2.0, 0.5])
    scores = score_completions(rewards, ["p", "p"], ["<answer>aa</answer>", "ab"], {})
    # sample 0: 2 * 1 + 0.5 * (4 letters a / 19 chars); sample 1: 2 * 0 + 0.5 * (1 / 2)
    assert scores.total_B.tolist() == pytest.approx([2.0 + 0.5 * 4 / 19, 0.25])
    assert set(scores.per_fn) == {"format", "count_a"}
    assert not scores.failed_B.any()


def test_raising_reward_marks_only_failing_samples():
    rewards = _resolve("rewards_for_tests.raises_on_first")
    scores = score_completions(rewards, ["p"] * 3, ["ok", "BAD", "fine"], {})
    assert scores.failed_B.tolist() == [False, True, False]
    assert math.isnan(scores.total_B[1]) and scores.total_B[0] == 1.0
    assert len(scores.errors) == 1 and "bad sample" in scores.errors[0]


def test_bad_reward_functions_are_user_errors():
    with pytest.raises(UserError, match="no function 'nope'"):
        _resolve("rewards_for_tests.nope")
    with pytest.raises(UserError, match="cannot import module"):
        _resolve("no_such_module_xyz.fn")
    with pytest.raises(UserError, match="neither a built-in"):
        _resolve("gymm")
    with pytest.raises(UserError, match="scores reasoning-gym tasks"):
        _resolve("gym")
    with pytest.raises(UserError, match="must return a list of 2 numbers"):
        score_completions(_resolve("rewards_for_tests.wrong_length"), ["p"] * 2, ["a", "b"], {})


def test_numpy_rewards_are_accepted_and_json_never_holds_nan():
    import numpy as np

    from rlora.train.outputs import to_json

    rewards = [resolve_rewards([RewardSpec(fn="rewards_for_tests.count_a")], has_task=False)[0]]
    object.__setattr__(rewards[0], "fn", lambda prompts, completions, **kw: list(np.array([0.5, 1.0], dtype=np.float32)))
    scores = score_completions(rewards, ["p", "p"], ["a", "b"], {})
    assert scores.total_B.tolist() == [0.5, 1.0] and scores.per_fn["count_a"] == [0.5, 1.0]
    assert to_json({"loss": float("nan"), "xs": [1.0, float("inf")]}) == '{"loss": null, "xs": [1.0, null]}'


def test_reward_time_limit_survives_sigalrm_users_and_swallowing_rewards():
    """math-verify arms and cancels SIGALRM itself, and a reward may catch Exception: neither defeats the limit."""
    import time

    from rlora.errors import UserError
    from rlora.rewards.scoring import RewardFn

    def alarm_then_spin(prompts, completions, **_):
        import signal
        signal.alarm(5)
        signal.alarm(0)  # what a library with its own timeout does
        end = time.monotonic() + 3
        while time.monotonic() < end:
            pass
        return [1.0] * len(completions)

    def swallows(prompts, completions, **_):
        try:
            time.sleep(3)
        except Exception:  # noqa: BLE001 - the bad habit under test
            pass
        return [0.5] * len(completions)

    for fn in (alarm_then_spin, swallows):
        start = time.monotonic()
        with pytest.raises(UserError, match="did not return within 0.5 s"):
            score_completions([RewardFn(fn.__name__, fn, 1.0, {}, timeout_s=0.5)], ["p"], ["a"], {})
        assert time.monotonic() - start < 2.0
    fast = score_completions([RewardFn("f", lambda p, c, **_: [1.0], 1.0, {}, timeout_s=0.5)], ["p"], ["a"], {})
    assert fast.total_B.tolist() == [1.0]
    time.sleep(0.7)  # a cancelled watchdog must not fire later


# ---- a reward function in a file next to the config ---------------------------------------------------------

BREVITY = "def brevity(prompts, completions, **columns):\n    return [1.0 / (1 + len(c)) for c in completions]\n"


@pytest.mark.parametrize("fn", ["my_reward.brevity", "my_reward.py:brevity", "sub/my_reward.py:brevity"])
def test_a_reward_next_to_the_config_is_found_from_any_folder(fn, tiny_model_dir, prompts_file, tmp_path, monkeypatch):
    """`fn: my_reward.brevity` (my_reward.py beside the config) or a file path relative to the config, run from
    another folder with nothing on PYTHONPATH: the run scores with it and its config.yaml names the file
    absolutely, so that a resume from anywhere finds it."""
    import json

    import yaml

    from conftest import tiny_overrides
    from rlora.cli import main

    folder = tmp_path / "project"
    (folder / "sub").mkdir(parents=True)
    for where in (folder, folder / "sub"):
        (where / "my_reward.py").write_text(BREVITY)
    (folder / "config.yaml").write_text(f"rewards:\n  - fn: {fn}\n")
    monkeypatch.chdir(tmp_path)  # not the config's folder
    out = tmp_path / "run"
    overrides = [o for o in tiny_overrides(tiny_model_dir, prompts_file, str(out), **{
        "train.steps": 1, "eval.before": "false", "eval.after": "false"}) if not o.startswith("rewards=")]
    assert main(["train", str(folder / "config.yaml"), *overrides]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())["rewards"][0]["fn"]
    want = folder / ("sub/my_reward.py" if fn.startswith("sub/") else "my_reward.py")
    assert saved == f"{want.resolve()}:brevity"
    [row] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 0 < row["reward/brevity"] <= 1


def test_a_reward_that_cannot_be_found_says_how_to_give_it(tmp_path):
    with pytest.raises(UserError, match="No module named 'nowhere_reward'.*give its file instead") as err:
        resolve_rewards([RewardSpec(fn="nowhere_reward.score")], has_task=False)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="no file .*missing.py"):
        resolve_rewards([RewardSpec(fn=f"{tmp_path}/missing.py:score")], has_task=False)
    (tmp_path / "broken.py").write_text("import nowhere_at_all\n")
    with pytest.raises(UserError, match="importing .*broken.py failed: ModuleNotFoundError"):
        resolve_rewards([RewardSpec(fn=f"{tmp_path}/broken.py:score")], has_task=False)
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(UserError, match="has no function 'score'"):
        resolve_rewards([RewardSpec(fn=f"{tmp_path}/empty.py:score")], has_task=False)
