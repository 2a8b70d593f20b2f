"""`env.fn` -> a factory of environments: a built-in name or a user's factory (dotted path or FILE.py:name)."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any

from rlora.config import EnvConfig
from rlora.envs.calculator import calculator
from rlora.envs.protocol import Environment
from rlora.envs.tools import CallFormat, ToolEnvironment
from rlora.errors import UserError, first_line
from rlora.rewards.scoring import import_callable


def calculator_env(**args: Any) -> ToolEnvironment:
    """Arithmetic with a calculator tool; the run's reward functions score the final answer."""
    return tools_env(tools=[calculator], **args)


def tools_env(tools: list[str | Callable] | None = None, call_start: str = "<tool_call>",
              call_end: str = "</tool_call>", **args: Any) -> ToolEnvironment:
    """Any Python functions as tools: `tools` lists dotted paths (module.function or FILE.py:function)."""
    if not tools:
        raise UserError("env fn 'tools' needs args.tools: a list of functions (module.function or FILE.py:function)")
    fns = [t if callable(t) else import_callable(t, kind="tool") for t in tools]
    return ToolEnvironment(fns, fmt=CallFormat(call_start, call_end), **args)


def textarena_env(**args: Any) -> Environment:
    from rlora.envs.textarena import TextArenaEnvironment  # textarena is an optional extra: only its runs import it

    return TextArenaEnvironment(**args)


EnvFactory = Callable[[], Environment]

BUILTIN_ENVS: dict[str, Callable[..., Environment]] = {
    "calculator": calculator_env, "tools": tools_env, "textarena": textarena_env}


def env_factory(spec: EnvConfig) -> EnvFactory:
    """A function that makes one fresh environment per episode. It is called once here, so that a bad factory or
    bad arguments (an unknown tool, a tool without a docstring) fail before any model loads."""
    make = BUILTIN_ENVS.get(spec.fn)
    if make is None and "." not in spec.fn and ":" not in spec.fn:  # a bare name: a built-in, misspelt
        close = difflib.get_close_matches(spec.fn, BUILTIN_ENVS, n=1)
        hint = f"did you mean '{close[0]}'? Or" if close else "or"
        raise UserError(f"env fn '{spec.fn}' is not a built-in environment ({', '.join(BUILTIN_ENVS)}): {hint} give "
                        "module.function or FILE.py:function")
    make = make or import_callable(spec.fn, kind="env fn")
    args = dict(spec.args)

    def factory() -> Environment:
        return make(**args)

    try:  # the arguments against the signature: a TypeError raised inside the factory is the factory's own fault
        inspect.signature(make).bind(**args)
    except TypeError as err:
        raise UserError(f"env fn '{spec.fn}' does not take these env.args ({', '.join(args) or 'none'}): {err}") from None
    except ValueError:  # no signature to read (a builtin): the call says
        pass
    try:
        probe = factory()
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - user code: one line, exit 2
        raise UserError(f"env fn '{spec.fn}' failed to make an environment: {type(err).__name__}: {first_line(err)}") from None
    missing = [name for name in ("reset", "step") if not callable(getattr(probe, name, None))]
    if missing:
        raise UserError(f"env fn '{spec.fn}' returned a {type(probe).__name__} without {' and '.join(missing)}(): an "
                        "environment needs reset(row) and step(text) (docs/environments.md)")
    return factory
