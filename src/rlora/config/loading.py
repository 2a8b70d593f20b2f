"""Loading a config: YAML file (or the built-in demo) + dotted `key=value` overrides -> validated sections ->
the algorithm's presets on the keys the user left out -> the refusal table (config/refusals.py).

`load_config` is the single entry point; every problem is a `UserError` of one line, and a misspelt key
names the closest valid one.
"""

from __future__ import annotations

import difflib
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlora.config.refusals import check_config
from rlora.config.schema import RLConfig
from rlora.errors import UserError
from rlora.presets import PRESETS

DEMO_CONFIG = "demo.yaml"


def demo_config_text() -> str:
    return resources.files("rlora.configs").joinpath(DEMO_CONFIG).read_text()


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`a.b=1 c=[x,y]` -> nested dict; values are parsed as YAML (numbers, bools, lists, null)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise UserError(f"override '{item}' is not of the form section.key=value (e.g. train.steps=10)")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"override '{item}' sets a key under '{part}', which is a value, not a section")
        node[parts[-1]] = value
    return tree


# Free-form argument dicts: the command line's first key under one replaces the file's dict (the arguments of
# another task or reward seldom mix with the file's); its later keys under the same dict add to that one.
_REPLACED_WHOLE = ("task_args", "args")


def _merge(base: dict[str, Any], extra: dict[str, Any], replaced: set[tuple] | None = None,
           path: tuple = ()) -> dict[str, Any]:
    """base with extra's keys set; replaced: the argument dicts (paths) the command line has replaced so far."""
    replaced = set() if replaced is None else replaced
    merged = dict(base)
    for key, value in extra.items():
        at = (*path, key)
        enter = key not in _REPLACED_WHOLE or at in replaced
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and enter:
            merged[key] = _merge(merged[key], value, replaced, at)
        elif isinstance(value, dict) and isinstance(merged.get(key), list) and value:
            merged[key] = _merge_items(key, merged[key], value, replaced, at)
        else:
            merged[key] = value
            if key in _REPLACED_WHOLE:
                replaced.add(at)
    return merged


def _merge_items(key: str, items: list, extra: dict[str, Any], replaced: set[tuple], path: tuple) -> list:
    """`rewards.1.weight=2`: item 1 of the list `rewards` (from 0), merged as a section would be."""
    merged = list(items)
    for index, value in extra.items():
        if not (isinstance(index, str) and index.isdigit()) or int(index) >= len(items):
            within = f"an index 0..{len(items) - 1} (e.g. {key}.0.KEY=VALUE)" if items else "no index (it is empty)"
            raise UserError(f"{key}.{index}: {key} is a list of {len(items)} item(s): give {within} or set the whole "
                            f"list ({key}=[...])")
        item, at = merged[int(index)], (*path, int(index))
        merged[int(index)] = _merge(item, value, replaced, at) if isinstance(item, dict) and isinstance(value, dict) \
            else value
    return merged


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, first: int, again: int):
        super().__init__(f"duplicate key {key!r}")
        self.key, self.first, self.again = key, first, again


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping: PyYAML keeps the last one silently, so a second
    `train:` section would drop every key of the first. Keys brought in by a `<<: *anchor` merge may still be
    overridden (that is what a merge is for): only the mapping's own keys are compared."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node), key_node.start_mark.line + 1
                if key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: str | None) -> dict[str, Any]:
    if path is None:
        text, where = demo_config_text(), "built-in demo config"
    else:
        file = Path(path)
        if not file.is_file():
            # `rlora train train.steps` (the '=' forgotten) reads as a config file's name
            looks_like_key = "." in path and not path.endswith((".yaml", ".yml")) and "/" not in path
            hint = f" (an override needs KEY=VALUE, e.g. {path}=...)" if looks_like_key else ""
            raise UserError(f"config file not found: {path}{hint}")
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UserError(f"config file {path} is not UTF-8 text") from None
        where = path
    try:
        loaded = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass (above)
    except _DuplicateKey as err:
        raise UserError(f"key '{err.key}' is given twice in {where} (lines {err.first} and {err.again}): YAML would "
                        "silently keep only the last one: give it once") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"YAML syntax error in {where}{at}: {problem}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise UserError(f"{where} must be a mapping of sections (model:, lora:, train: ...), not {type(loaded).__name__}")
    return loaded


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The config class inside an annotation: PPOConfig, `PPOConfig | None`, `list[PolicySpec] | None` ->
    the class; None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):  # the members of a Union / Optional, the item type of a list
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _class_at(model_cls: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The config class at a location such as ('policies', 1) -> PolicySpec; None where it is a plain value."""
    cls: type[BaseModel] | None = model_cls
    for part in loc:
        if isinstance(part, int):  # an index into a list of sections
            continue
        field = cls.model_fields.get(part) if cls is not None else None
        cls = _model_in(field.annotation) if field is not None else None
        if cls is None:
            return None
    return cls


def _field_names(model_cls: type[BaseModel], loc: tuple) -> list[str]:
    """Valid key names at a location such as ('train', 'stpes') -> fields of TrainConfig."""
    cls = _class_at(model_cls, loc[:-1])
    return list(cls.model_fields) if cls is not None else []


def _format_validation_error(err: ValidationError, model_cls: type[BaseModel]) -> str:
    first = err.errors()[0]
    loc = tuple(first["loc"])
    dotted = ".".join(str(p) for p in loc)
    if first["type"] == "extra_forbidden":
        names = _field_names(model_cls, loc)
        close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.5)
        parent = ".".join(str(p) for p in loc[:-1])
        hint = f" (did you mean '{parent + '.' if parent else ''}{close[0]}'?)" if close else f" (valid: {', '.join(names)})"
        return f"unknown config key '{dotted}'{hint}"
    message = first["msg"].removeprefix("Value error, ")
    if not loc:
        return f"invalid config: {message}"
    value = first.get("input")
    if isinstance(value, dict) and _class_at(model_cls, loc) is not None:
        # a whole section's check failed (e.g. eval.pass_k against eval.num_samples): its message names the keys,
        # and the section's dict would only repeat them
        return f"invalid value for {dotted}: {message}"
    return f"invalid value for {dotted}: {message} (got {value!r})"


def _section_class(owner: type[BaseModel], key: str) -> type[BaseModel]:
    """The section class of owner.key (`PPOConfig | None` -> PPOConfig)."""
    found = _model_in(owner.model_fields[key].annotation)
    if found is None:
        raise TypeError(f"{owner.__name__}.{key} is not a config section")
    return found


def load_config(path: str | None = None, overrides: list[str] | None = None, model_cls: type[BaseModel] = RLConfig):
    """Read YAML (without `path`: the built-in demo for `rlora train`, the defaults for sft and rm), apply overrides,
    validate, apply the algorithm's presets, check the refusal table's config rows (the launch rows wait for the
    recipe). Raises UserError."""
    base = _read_yaml(path) if path is not None or model_cls is RLConfig else {}
    raw, replaced = base, set()
    for item in overrides or []:  # in order: `rewards=[...] rewards.1.weight=2` sets the list, then its item 1
        raw = _merge(raw, parse_overrides([item]), replaced)
    try:
        config = model_cls.model_validate(raw)
    except ValidationError as err:
        raise UserError(_format_validation_error(err, model_cls)) from None
    if isinstance(config, RLConfig):
        apply_presets(config)
    check_config(config)
    # user code named by a file or a module beside the config: the config file's folder, not the current directory
    folder = Path(path).parent if path else Path.cwd()
    for spec in getattr(config, "rewards", []):
        spec.fn = _locate_user_file(spec.fn, folder)
    env = getattr(config, "env", None)
    if env is not None:
        env.fn = _locate_user_file(env.fn, folder)
        if env.fn == "tools" and isinstance(env.args.get("tools"), list):  # a user's factory's args stay its own
            env.args["tools"] = [_locate_user_file(t, folder) if isinstance(t, str) else t for t in env.args["tools"]]
    return config


def apply_presets(cfg: RLConfig) -> None:
    """Fill the keys the chosen algorithm presets (rlora/presets.py), where the user did not set them."""
    for dotted, value in PRESETS[cfg.algo.name].items():
        *path, key = dotted.split(".")
        node: BaseModel = cfg
        explicit = True
        for part in path:
            explicit = explicit and part in node.model_fields_set
            node = getattr(node, part)
        if not (explicit and key in node.model_fields_set):
            if isinstance(value, dict):  # a whole section, validated by its class
                value = _section_class(type(node), key).model_validate(value)
            setattr(node, key, value(cfg) if callable(value) else value)


def _locate_user_file(fn: str, folder: Path) -> str:
    """A reward, environment or tool written next to the config: `my_reward.py:brevity` relative to the config
    file's folder, or `my_reward.brevity` with my_reward.py in that folder -> the file's absolute path, so that the
    saved config.yaml (and a resume or `rlora eval` of the run) finds the same file from anywhere."""
    if ".py:" in fn:
        file_name, _, attr = fn.rpartition(":")
        return f"{(folder / file_name).resolve() if not Path(file_name).is_absolute() else file_name}:{attr}"
    module, _, attr = fn.rpartition(".")
    if module and "." not in module and (folder / f"{module}.py").is_file():
        return f"{(folder / f'{module}.py').resolve()}:{attr}"
    return fn


def to_yaml(config: BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
