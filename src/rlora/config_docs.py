"""The configuration reference (docs/configuration.md), generated from the pydantic config classes.

`render_reference()` walks `RLConfig.model_fields`, then the sections of `SFTConfig` (`rlora sft`) and
`RMConfig` (`rlora rm`) that differ from RLConfig's (so a section added to config/schema.py appears without any
change here), descending into nested sections (`algo.adaptive`), optional sections (`rollout.think`) and
lists of sections (`rewards[]`), and adds the presets of every algorithm in `rlora.algos.registry`.

    python -m rlora.config_docs            # (re)write docs/configuration.md
    python -m rlora.config_docs --check    # exit 1 if docs/configuration.md differs from the classes
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rlora.algos.registry import ALGORITHMS
from rlora.config import REFUSALS, RefusedCombination, RLConfig, RMConfig, SFTConfig, check_launch, load_config
from rlora.config.refusals import EXAMPLE_BASES

REGENERATE = ".venv/bin/python -m rlora.config_docs"
_ROOT = Path(__file__).resolve().parents[2]
# in a checkout (editable install) the file sits in the repository's docs/; otherwise relative to the cwd
DEFAULT_OUTPUT = (_ROOT / "docs" / "configuration.md") if (_ROOT / "pyproject.toml").is_file() \
    else Path("docs") / "configuration.md"

# preset values that are functions of the config: what they compute, in words (fallback: docstring, then name)
CALLABLE_DESCRIPTIONS = {
    "rlora.presets._dapo_buffer": "`max(1, rollout.max_new_tokens // 5)` (DAPO's 20 % soft-punishment buffer)",
}

_UNION_TYPES = (typing.Union, types.UnionType)


# ---- types ---------------------------------------------------------------------------------------------

def type_name(annotation: Any) -> str:
    """A readable type: `int`, `float | None`, `"group" | "batch" | "none"`, `list[str]`, `ThinkConfig | None`."""
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "Any"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(arg) for arg in args)
    if origin in _UNION_TYPES:
        return " | ".join(type_name(arg) for arg in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(arg) for arg in args)}]" if args else name
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def nested_section(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """(the section class, the key suffix) where an annotation holds one: X -> '.', X | None -> '.',
    list[X] -> '[].'; None for plain values."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, "."
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in _UNION_TYPES:
        models = [arg for arg in args if arg is not type(None)]
        if len(models) == 1:
            return nested_section(models[0])
    if origin is list and len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], "[]."
    return None


# ---- values --------------------------------------------------------------------------------------------

def format_value(value: Any) -> str:
    """A value as it is written in a config file (YAML flow style, strings quoted)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        return repr(value) if math.isfinite(value) else ("" if value > 0 else "-") + ".inf"
    if isinstance(value, (int, str)):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def field_default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True, validated_data={})
    if isinstance(value, BaseModel):
        return ""  # a section: its keys' defaults are in their own rows
    return f"`{format_value(value)}`"


_CONSTRAINTS = (
    (annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="), (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "<="), (annotated_types.MultipleOf, "multiple_of", "multiple of"),
    (annotated_types.MinLen, "min_length", "length >="), (annotated_types.MaxLen, "max_length", "length <="),
)


def field_constraints(field: FieldInfo) -> str:
    parts = []
    for item in field.metadata:
        for kind, attr, symbol in _CONSTRAINTS:
            if isinstance(item, kind):
                parts.append(f"{symbol} {format_value(getattr(item, attr))}")
                break
    return ", ".join(f"`{p}`" for p in parts)


def _doc(cls: type) -> str:
    doc = cls.__dict__.get("__doc__")
    return " ".join(inspect.cleandoc(doc).split()) if doc else ""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


# ---- rows ----------------------------------------------------------------------------------------------

def section_rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, constraints, description) for every field of `model` and of its nested sections,
    in declaration order; keys are dotted from the root."""
    rows = []
    for name, field in model.model_fields.items():
        key = prefix + name
        nested = nested_section(field.annotation)
        description = field.description or (_doc(nested[0]) if nested else "")
        rows.append((key, f"`{type_name(field.annotation)}`", field_default(field), field_constraints(field),
                     description))
        if nested:
            rows.extend(section_rows(nested[0], key + nested[1]))
    return rows


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


_FIELD_HEADER = ("key", "type", "default", "constraints", "description")


def _section_markdown(name: str, field: FieldInfo, title: str | None = None) -> list[str]:
    nested = nested_section(field.annotation)
    lines = [title or f"## `{name}`", ""]
    if nested and field.annotation is nested[0]:
        # a plain section (a mapping of keys): its docstring, then its keys
        intro = field.description or _doc(nested[0])
        rows = section_rows(nested[0], name + ".")
    else:
        # a list of sections, an optional section or a plain value: a row for the key itself first
        intro = f"A list; `{name}[].key` is the key `key` of each item." if nested and nested[1] == "[]." else ""
        rows = [(name, f"`{type_name(field.annotation)}`", field_default(field), field_constraints(field),
                 field.description or (_doc(nested[0]) if nested else ""))]
        rows += section_rows(nested[0], name + nested[1]) if nested else []
    if intro:
        lines += [intro, ""]
    rows = [(f"`{row[0]}`",) + row[1:] for row in rows]
    return lines + _table(rows, _FIELD_HEADER) + [""]


# ---- algorithm presets ---------------------------------------------------------------------------------

def _describe_callable(fn: Any) -> str:
    qualified = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"
    if qualified in CALLABLE_DESCRIPTIONS:
        return CALLABLE_DESCRIPTIONS[qualified]
    doc = inspect.getdoc(fn)
    if doc:
        return doc.splitlines()[0]
    name = getattr(fn, "__name__", type(fn).__name__)
    return "computed from the config" if name == "<lambda>" else f"computed by {name}(config)"


def _describe_preset(key: str, value) -> str:
    if callable(value):
        return _describe_callable(value)
    if isinstance(value, dict):  # a whole section
        return f"the `{key}:` section with its defaults" + (f", and {format_value(value)}" if value else "")
    return f"`{format_value(value)}`"


def preset_rows() -> list[tuple[str, str, str]]:
    rows = []
    for name, algo in ALGORITHMS.items():
        if algo.presets:
            presets = "; ".join(f"`{key}` = {_describe_preset(key, value)}" for key, value in algo.presets.items())
        else:
            presets = "none (the defaults above)"
        rows.append((f"`{name}`", presets, algo.paper))
    return rows


# ---- the document --------------------------------------------------------------------------------------

def render_reference() -> str:
    """The whole reference as Markdown; deterministic (a function of the config classes and the registry)."""
    sections = list(RLConfig.model_fields.items())
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from src/rlora/config/ and src/rlora/algos/registry.py by "
        f"`{REGENERATE}`; do not edit by hand. tests/test_config_docs.py fails when it is out of date. -->",
        "",
        "A config is a YAML file of sections; any key can also be set on the command line as `section.key=value` "
        "(the value is parsed as YAML), e.g. `rlora train my.yaml rollout.num_generations=16 "
        "algo.adaptive.max_retries=4`; an item of a list by its index from 0 (`rewards.1.weight=0.5`), or the whole "
        "list (`rewards=[{fn: gym}]`); overrides apply in order. "
        "`rlora train my.yaml --print-config` prints the resolved config. Unknown keys are errors that name the "
        "closest valid key. Examples: `src/rlora/configs/demo.yaml` (the embedded demo), `configs/*.yaml`.",
        "",
        "Keys are dotted from the root; `rewards[].fn` is the key `fn` of each item of the list `rewards`. "
        "Constraints are checked when the config loads. The algorithm named by `algo.name` then fills "
        "the keys it presets (see [Algorithm presets](#algorithm-presets)) wherever the config does not set them, "
        "and the [refused combinations](#refused-combinations) are checked, before any model loads.",
        "",
        "Sections: " + ", ".join(f"[`{name}`](#{name})" for name, _ in sections) + ", "
        "[algorithm presets](#algorithm-presets), [refused combinations](#refused-combinations).",
        "",
    ]
    for name, field in sections:
        lines += _section_markdown(name, field)
    lines += _command_markdown("sft", SFTConfig, "docs/sft.md")
    lines += _command_markdown("rm", RMConfig, "docs/reward_models.md")
    lines += [
        "## Algorithm presets",
        "",
        "Keys each `algo.name` sets where the config leaves them unset (keys you set win); formulas and papers: "
        "`docs/algorithms.md`.",
        "",
    ]
    lines += _table(preset_rows(), ("algorithm", "presets", "paper"))
    lines += [
        "",
        "## Refused combinations",
        "",
        "One table, `src/rlora/config/refusals.py`: the first row that matches stops the command with its message "
        "(exit code 2). Rows marked *ranks* depend on how many data-parallel ranks torchrun started and are checked "
        "when the command starts; the others when the config loads. The example is what triggers the row (overrides "
        "of the demo config, or of sft's / rm's defaults); the message is what it then prints.",
        "",
    ]
    lines += _table(refusal_rows(), ("row", "commands", "example", "message"))
    return "\n".join(lines) + "\n"


def refusal_rows() -> list[tuple[str, str, str, str]]:
    """Each row of the refusal table with the message its own example prints."""
    rows = []
    for row in REFUSALS:
        model_cls, base = EXAMPLE_BASES[row.commands[0]]
        try:
            check_launch(load_config(None, [*base, *row.example], model_cls=model_cls), row.example_ranks)
        except RefusedCombination as refused:
            message = str(refused)
        else:  # tests/test_refusals.py fails first
            raise AssertionError(f"the example of refusal row {row.name} is accepted")
        ranks = f" on {row.example_ranks} rank(s)" if row.launch else ""
        rows.append((f"`{row.name}`", ", ".join(row.commands) + (" (*ranks*)" if row.launch else ""),
                     " ".join(f"`{item}`" for item in row.example) + ranks, message))
    return rows


def _command_markdown(command: str, root: type[BaseModel], doc: str) -> list[str]:
    """The sections of another command's config class (SFTConfig, RMConfig) that differ from `rlora train`'s."""
    shared = [name for name, field in root.model_fields.items()
              if RLConfig.model_fields.get(name) is not None and RLConfig.model_fields[name].annotation is field.annotation]
    own = [name for name in root.model_fields if name not in shared]
    lines = [f"## `rlora {command}`", "",
             f"`rlora {command} CONFIG.yaml [key=value ...]` ({doc}) reads an `{root.__name__}`: "
             + ", ".join(f"`{name}`" for name in shared) + " are the sections above; "
             + " and ".join(f"`{name}`" for name in own) + " are these.",
             ""]
    for name in own:
        lines += _section_markdown(name, root.model_fields[name], title=f"### `rlora {command}`: `{name}`")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlora.config_docs", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the generated text")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"default: {DEFAULT_OUTPUT}")
    args = parser.parse_args(argv)
    text = render_reference()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.is_file() else None
        if current != text:
            state = "is missing" if current is None else "is out of date with src/rlora/config/"
            print(f"{args.output} {state}: regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
