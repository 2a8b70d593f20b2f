"""Tools (envs/tools.py) and the calculator: schemas from docstrings, tool-call parsing, and faults that come back
to the policy as error messages; the chat rendering of tools."""

import pytest
from envs_for_tests import failing_tool, no_docstring, slow_tool

from rlora.envs.calculator import calculator
from rlora.envs.render import EpisodeRenderer, RenderError, template_renders_tools
from rlora.envs.tools import CallFormat, ToolCall, ToolEnvironment, parse_tool_calls, run_tool, tool_schema
from rlora.errors import UserError
from rlora.models.tiny import build_tokenizer


@pytest.mark.parametrize("expression, value", [("12 + 7 * 3", "33"), ("(12 + 7) * 3", "57"), ("7 / 2", "3.5"),
                                               ("-3 ** 2", "-9"), ("2 ** 10", "1024"), ("8 / 4", "2"), ("17 % 5", "2")])
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, error", [("__import__('os')", "unsupported syntax"), ("2 ** 1000", "too large"),
                                               ("((9**64)**64)**64", "too large"), ("(10**60)**60", "too large"),
                                               ("1 +", "not an arithmetic expression"), ("x + 1", "unsupported")])
def test_calculator_refuses_anything_else(expression, error):
    with pytest.raises(ValueError, match=error):
        calculator(expression)


def test_schema_from_signature_and_docstring():
    schema = tool_schema(calculator)["function"]
    assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expression"]
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
    with pytest.raises(UserError, match="no docstring"):
        tool_schema(no_docstring)


def test_tool_calls_are_parsed_in_order_and_bad_blocks_carry_their_error():
    text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> and '
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"}</tool_call>'
            '<tool_call>{not json}</tool_call><tool_call>["x"]</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[:2] == [ToolCall("calculator", {"expression": "1+2"}), ToolCall("calculator", {"expression": "3"})]
    assert "not valid JSON" in calls[2].error and '{"name"' in calls[3].error
    [custom] = parse_tool_calls('[[{"name": "calculator", "arguments": {"expression": "5"}}]]', CallFormat("[[", "]]"))
    assert custom == ToolCall("calculator", {"expression": "5"})


def test_tool_faults_return_error_messages():
    tools = {"calculator": calculator, "failing_tool": failing_tool, "slow_tool": slow_tool}
    assert run_tool(tools, ToolCall("calculator", {"expression": "2*21"}), 5) == ("42", True)
    assert run_tool(tools, ToolCall("failing_tool", {"x": 3}), 5) == ("Error: RuntimeError: no luck with 3", False)
    text, ok = run_tool(tools, ToolCall("slow_tool", {"seconds": 30}), 0.3)
    assert not ok and "did not return within 0.3 s" in text
    text, ok = run_tool(tools, ToolCall("nope", {}), 5)
    assert not ok and "unknown tool 'nope'" in text and "calculator" in text
    text, ok = run_tool(tools, ToolCall("calculator", {"wrong": 1}), 5)
    assert not ok and text.startswith("Error: TypeError")


def test_tool_environment_turns():
    env = ToolEnvironment([calculator, failing_tool], timeout_s=5)
    assert env.reset({"prompt": "What is 2 + 2?"}) == [{"role": "user", "content": "What is 2 + 2?"}]
    result = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
                      '<tool_call>{"name": "failing_tool", "arguments": {"x": 1}}</tool_call>')
    assert not result.done and [m["content"] for m in result.messages] == ["4", "Error: RuntimeError: no luck with 1"]
    assert all(m["role"] == "tool" for m in result.messages) and result.info == {"tool_calls": 2, "tool_errors": 1}
    final = env.step("The answer is 4.")
    assert final.done and final.messages == [] and final.reward == 0.0 and final.info == {"tool_calls": 0, "tool_errors": 0}


def test_tools_are_described_to_templates_without_tool_support():
    tokenizer = build_tokenizer()
    assert not template_renders_tools(tokenizer)
    renderer = EpisodeRenderer(tokenizer, [tool_schema(calculator)], CallFormat())
    text = tokenizer.decode(renderer.first_prompt([{"role": "user", "content": "What is 2 + 2?"}]))
    assert text.startswith("<|im_start|>system\nTools:\n{\"name\": \"calculator\"")
    assert "<tool_call>" in text and text.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    native = build_tokenizer()
    native.chat_template = "{% if tools %}TOOLS:{{ tools | length }}\n{% endif %}" + native.chat_template
    assert template_renders_tools(native)
    text = native.decode(EpisodeRenderer(native, [tool_schema(calculator)], CallFormat()).first_prompt(
        [{"role": "user", "content": "hi"}]))
    assert text.startswith("TOOLS:1\n<|im_start|>user\nhi") and "Tools:" not in text


def test_a_turn_ended_by_eos_is_continued_after_the_template_end_of_turn():
    tokenizer = build_tokenizer()
    renderer = EpisodeRenderer(tokenizer, [], CallFormat())
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "call"}]
    new = [{"role": "tool", "content": "4"}]
    after_eos = tokenizer.decode(renderer.continuation(history, new, True, "<|im_end|>"))
    assert after_eos == "\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n"
    after_stop = tokenizer.decode(renderer.continuation(history, new, False, ""))
    assert after_stop == "<|im_end|>\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n"
    rewriting = build_tokenizer()
    rewriting.chat_template = "{{ messages | length }}" + rewriting.chat_template  # the first line changes each turn
    renderer = EpisodeRenderer(rewriting, [], CallFormat())
    with pytest.raises(RenderError, match="rewrites earlier turns"):  # in a run: that episode fails
        renderer.continuation(history, new, True, "<|im_end|>")
    with pytest.raises(UserError, match="rewrites earlier turns"):  # checked once before training: one line, exit 2
        renderer.check_template()
    # a reply that is a piece of the template's own end of turn is found where the reply is, not in that end
    for reply in ("m", "end", "|", "\n"):
        text = tokenizer.decode(EpisodeRenderer(tokenizer, [], CallFormat()).continuation(
            [history[0], {"role": "assistant", "content": reply}], new, False, ""))
        assert text == "<|im_end|>\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n", reply


def test_time_limits_nest_and_the_outer_one_still_fires():
    """A tool's limit inside an environment step's: the inner one fires on its own; an outer one that passes while
    the inner one runs interrupts the outer block as soon as the inner one ends."""
    import time

    from rlora import deadline

    with pytest.raises(deadline.TimeLimitExceeded, match="outer"):
        with deadline.time_limit(0.3, "outer"):
            with deadline.time_limit(5.0, "inner"):
                time.sleep(0.6)  # the outer limit passes here
            while True:  # a hang after the inner block: only the outer limit can end it
                time.sleep(0.01)
    with deadline.time_limit(5.0, "outer"):
        with pytest.raises(deadline.TimeLimitExceeded, match="inner"):
            with deadline.time_limit(0.2, "inner"):
                time.sleep(3)


def test_when_both_limits_pass_the_outer_block_reports_it():
    """A tool (inner limit) that hangs past the environment step's limit too: the step's limit wins, so the step
    ends instead of going on with a tool error."""
    import time

    from rlora import deadline

    with pytest.raises(deadline.TimeLimitExceeded, match="outer"):
        with deadline.time_limit(0.2, "outer"):
            try:
                with deadline.time_limit(0.4, "inner"):
                    time.sleep(3)
            except deadline.TimeLimitExceeded:  # what run_tool does with a tool's timeout
                pass
            time.sleep(3)
    with deadline.time_limit(0.3, "later"):  # nothing left active: a later limit works as usual
        time.sleep(0.01)


def test_synthetic_calculator_conversations_solve_their_problems(tmp_path, capsys):
    import json

    from rlora.envs.tool_data import calculator_conversations, main

    args = {"min_terms": 3, "max_terms": 4, "min_digits": 2, "max_digits": 3}
    rows = calculator_conversations("chain_sum", args, size=20, seed=7, exclude=set())
    excluded = rows[0]["messages"][1]["content"]
    assert len(calculator_conversations("chain_sum", args, size=20, seed=7, exclude={excluded})) == len(rows) - 1
    for row in rows:
        system, user, call, tool, answer = row["messages"]
        assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
        assert system["content"] == CallFormat().instructions([tool_schema(calculator)])  # what the runner writes
        [parsed] = parse_tool_calls(call["content"])
        expression = parsed.arguments["expression"]
        assert user["content"].endswith(expression + " =") and tool["content"] == str(eval(expression))  # noqa: S307
        assert answer["content"] == f"The answer is {tool['content']}."
    out = tmp_path / "rows.jsonl"
    config = tmp_path / "rl.yaml"
    config.write_text("data: {task: chain_sum, task_args: {min_terms: 3, max_terms: 3}, eval_size: 5}\n"
                      "env: {fn: calculator}\nrewards: [{fn: gym}]\n")
    assert main([str(config), "--size", "30", "--out", str(out)]) == 0
    assert 0 < len(out.read_text().splitlines()) <= 30 and json.loads(out.read_text().splitlines()[0])["messages"]
    config.write_text("data: {path: x.jsonl}\nrewards: [{fn: gym}]\n")
    assert main([str(config), "--out", str(out)]) == 2 and "needs data.task" in capsys.readouterr().err
    from pathlib import Path

    sft_config = str(Path(__file__).parents[1] / "configs" / "sft_math.yaml")  # an `rlora sft` config
    assert main([sft_config, "--out", str(out)]) == 2
    assert f"{sft_config}: not an `rlora train` config (unknown config key" in capsys.readouterr().err
