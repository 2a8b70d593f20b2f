"""Tools: plain Python functions the policy calls during an episode.

A tool's JSON schema comes from its signature and docstring (transformers' get_json_schema, the format chat
templates with tool support take). The policy calls a tool by writing a JSON block between two markers (by
default `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the Hermes/Qwen format); each call's result
comes back as a `tool` message. A call that is malformed, names an unknown tool, raises or runs out of time
returns an error message to the policy: it never ends the run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from rlora import deadline
from rlora.envs.protocol import StepResult
from rlora.errors import UserError


def tool_schema(fn: Callable) -> dict:
    """The function's JSON schema; a one-line UserError where its docstring or type hints do not describe it."""
    name = getattr(fn, "__name__", repr(fn))
    if not (fn.__doc__ or "").strip():
        raise UserError(f"tool '{name}' has no docstring: describe what it does and each argument (Args: section)")
    try:
        return get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as err:
        raise UserError(f"tool '{name}': {err}".replace("\n", " ")) from None


@dataclass(frozen=True)
class CallFormat:
    """How the policy writes a tool call: JSON {"name": ..., "arguments": {...}} between these markers."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"

    def pattern(self) -> re.Pattern:
        return re.compile(re.escape(self.start) + r"(.*?)" + re.escape(self.end), re.DOTALL)

    def instructions(self, schemas: list[dict]) -> str:
        """What a system message says where the chat template cannot render tools itself: each tool's name,
        description and parameters (its schema without the return type), and how to call one."""
        listed = "\n".join(json.dumps({key: s["function"][key] for key in ("name", "description", "parameters")
                                       if key in s["function"]}) for s in schemas)
        example = json.dumps({"name": "NAME", "arguments": {"ARG": "VALUE"}})
        return (f"Tools:\n{listed}\nTo call a tool, reply with only {self.start}{example}{self.end}; its result "
                "comes back in a tool message. Give the final answer without a tool call.")


@dataclass(frozen=True)
class ToolCall:
    name: str | None  # None: the block could not be read (error says why)
    arguments: dict[str, Any]
    error: str | None = None


def parse_tool_calls(text: str, fmt: CallFormat = CallFormat()) -> list[ToolCall]:
    """Every tool-call block in the text, in order (an unreadable block becomes a call carrying its error)."""
    calls = []
    for block in fmt.pattern().findall(text):
        try:
            payload = json.loads(block)
        except json.JSONDecodeError as err:
            calls.append(ToolCall(None, {}, f"the tool call is not valid JSON ({err.msg})"))
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            calls.append(ToolCall(None, {}, 'a tool call needs {"name": "...", "arguments": {...}}'))
            continue
        arguments = payload.get("arguments", payload.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(payload["name"], {}, "the tool call's arguments must be a JSON object"))
            continue
        calls.append(ToolCall(payload["name"], arguments))
    return calls


def run_tool(tools: dict[str, Callable], call: ToolCall, timeout_s: float | None) -> tuple[str, bool]:
    """-> (the text the policy sees, whether the call succeeded). Never raises for the tool's own faults."""
    if call.error is not None:
        return f"Error: {call.error}", False
    fn = tools.get(call.name)
    if fn is None:
        return f"Error: unknown tool {call.name!r}; the tools are {', '.join(sorted(tools))}", False
    try:
        with deadline.time_limit(timeout_s, f"tool {call.name!r} did not return within {timeout_s} s"):
            result = fn(**call.arguments)
    except deadline.TimeLimitExceeded as err:
        return f"Error: {err}", False
    except Exception as err:  # noqa: BLE001 - the tool's failure is the policy's feedback, not the run's end
        return f"Error: {type(err).__name__}: {err}", False
    return result if isinstance(result, str) else json.dumps(result, default=str), True


class ToolEnvironment:
    """An episode in which the policy may call tools before it answers: the row's prompt first; each reply with
    tool calls gets their results as tool messages; a reply without one ends the episode (reward functions
    then score that final answer). At most `max_calls_per_turn` calls of one reply run."""

    def __init__(self, tools: list[Callable], timeout_s: float | None = 10.0, fmt: CallFormat = CallFormat(),
                 max_calls_per_turn: int = 4, system_prompt: str | None = None):
        self.schemas = [tool_schema(fn) for fn in tools]
        self.tools = {s["function"]["name"]: fn for s, fn in zip(self.schemas, tools)}
        self.timeout_s, self.fmt, self.max_calls_per_turn = timeout_s, fmt, max_calls_per_turn
        self.system_prompt = system_prompt

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def step(self, assistant_text: str) -> StepResult:
        calls = parse_tool_calls(assistant_text, self.fmt)
        if not calls:  # the counters on every turn, so that a rank whose episodes call no tool reports 0s
            return StepResult(done=True, info={"tool_calls": 0, "tool_errors": 0})
        messages, failed = [], 0
        for call in calls[:self.max_calls_per_turn]:
            text, ok = run_tool(self.tools, call, self.timeout_s)
            messages.append({"role": "tool", "content": text})
            failed += not ok
        return StepResult(messages, info={"tool_calls": len(messages), "tool_errors": failed})
