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


def _builtin_keys(name: str) -> set[str]:
    """The env.args a built-in environment takes: its factory's own and those it passes on to its class."""
    passed_on = ToolEnvironment if name in ("calculator", "tools") else None
    if name == "textarena":
        from rlora.envs.textarena import TextArenaEnvironment  # no textarena import: only the class

        passed_on = TextArenaEnvironment
    factory = tools_env if name == "calculator" else BUILTIN_ENVS[name]  # calculator_env is tools_env, tool given
    own = {key for key, p in inspect.signature(factory).parameters.items() if p.kind != p.VAR_KEYWORD}
    inner = set(inspect.signature(passed_on.__init__).parameters) - {"self", "tools", "fmt"}
    return (own | inner) - ({"tools"} if name == "calculator" else set())


def _check_args(fn: str, make: Callable, args: dict[str, Any]) -> None:
    """env.args against what the factory takes, before it runs: a TypeError raised inside a user's factory is then
    that factory's own fault, not its arguments'."""
    if fn in BUILTIN_ENVS:
        unknown = sorted(set(args) - _builtin_keys(fn))
        if unknown:
            close = difflib.get_close_matches(unknown[0], _builtin_keys(fn), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UserError(f"env fn '{fn}' does not take env.args {', '.join(unknown)}{hint}: it takes "
                            f"{', '.join(sorted(_builtin_keys(fn)))}")
        return
    try:
        signature = inspect.signature(make)
    except (ValueError, TypeError):  # no signature to read (a C function): the call says
        return
    try:
        signature.bind(**args)
    except TypeError as err:
        raise UserError(f"env fn '{fn}' does not take these env.args ({', '.join(args) or 'none'}): {err}") from None


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

    _check_args(spec.fn, make, args)
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
