"""Resolve reward functions from config and score completions with them.

A function is called once per batch. If it raises, it is called again sample by sample to find which
samples fail; those samples are marked failed (and excluded from the loss) and the message is kept.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from rlora import deadline
from rlora.config import RewardSpec
from rlora.errors import UserError
from rlora.rewards.builtin import BUILTIN_REWARDS
from rlora.rewards.reward_adapter import REWARD_MODEL, RewardAdapter


@dataclass(frozen=True)
class RewardFn:
    name: str  # used in metric names: reward/<name>
    fn: Callable[..., list]
    weight: float
    args: dict[str, Any]
    timeout_s: float | None = None


@contextmanager
def time_limit(reward: RewardFn, size: int):
    """Raise UserError if the call takes longer than reward.timeout_s (rlora/deadline.py: interrupts Python code
    in the main thread; a reward's own SIGALRM use or `except Exception` does not defeat it)."""
    message = (f"reward fn '{reward.name}' did not return within {reward.timeout_s or 0:g} s for {size} completions "
               "(rewards[].timeout_s): it hangs or is too slow")
    try:
        with deadline.time_limit(reward.timeout_s, message):
            yield
    except deadline.TimeLimitExceeded as err:
        raise UserError(str(err)) from None


def import_callable(dotted: str, kind: str = "reward fn") -> Callable:
    """`module.function` (importable: on sys.path or PYTHONPATH) or `path/to/file.py:function`. kind: what the
    callable is, in error messages."""
    if ".py:" in dotted:
        return _from_file(dotted, kind)
    module_name, sep, attr = dotted.replace(":", ".").rpartition(".")
    if not sep or not module_name:
        builtins = f"a built-in ({', '.join(BUILTIN_REWARDS)}, reward_model) nor " if kind == "reward fn" else ""
        raise UserError(f"{kind} '{dotted}' is neither {builtins}a dotted path module.function nor FILE.py:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - import errors of user code, reported in one line
        hint = (": give its file instead (fn: path/to/file.py:function, relative to the config file), or put "
                "its folder on PYTHONPATH") if isinstance(err, ModuleNotFoundError) else ""
        raise UserError(f"{kind} '{dotted}': cannot import module '{module_name}': {err}{hint}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"{kind} '{dotted}': module '{module_name}' has no function '{attr}'")
    return fn


def _from_file(spec: str, kind: str) -> Callable:
    """`FILE.py:function`: the file imported as a module of its own. Its folder joins sys.path (first) and stays
    there, so the file can import its neighbours at import time and when the function runs."""
    file_name, _, attr = spec.rpartition(":")
    path = Path(file_name)
    if not path.is_file():
        raise UserError(f"{kind} '{spec}': no file {path} (a relative path is relative to the config file's folder)")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]  # two files may share a stem
    module_name = f"rlora_reward_{digest}_{path.stem}"
    module = sys.modules.get(module_name)
    if module is None:
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        try:
            loader_spec.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - errors of user code, reported in one line
            raise UserError(f"{kind} '{spec}': importing {path} failed: {type(err).__name__}: {err}") from None
        sys.modules[module_name] = module  # imported once per process
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"{kind} '{spec}': {path} has no function '{attr}'")
    return fn


def resolve_rewards(specs: list[RewardSpec], has_task: bool) -> list[RewardFn]:
    """`fn: reward_model` becomes a RewardAdapter (rewards/reward_adapter.py): checked here, loaded onto the
    policy's model by `rlora train` (attach_reward_adapters); its args are its own, not call arguments."""
    resolved, seen = [], {}
    for index, spec in enumerate(specs):
        base = spec.fn.replace(":", ".").rpartition(".")[2]
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}_{seen[base]}"
        args = dict(spec.args)
        if spec.fn == REWARD_MODEL:
            fn, args = RewardAdapter.from_spec(spec, name, index), {}
        elif spec.fn in BUILTIN_REWARDS:
            if spec.fn == "gym" and not has_task:
                raise UserError("reward fn 'gym' scores reasoning-gym tasks: set data.task, or use another reward")
            fn = BUILTIN_REWARDS[spec.fn]
        else:
            fn = import_callable(spec.fn)
        resolved.append(RewardFn(name=name, fn=fn, weight=spec.weight, args=args, timeout_s=spec.timeout_s))
    return resolved


@dataclass
class Scores:
    total_B: torch.Tensor  # weighted sum over functions; NaN where the sample failed
    per_fn: dict[str, list[float | None]]
    failed_B: torch.Tensor  # bool
    errors: list[str] = field(default_factory=list)  # one message per failed (function, sample)

    def select(self, index: list[int]) -> "Scores":
        """The scores of some samples (error messages are kept whole: they name the sample of their call)."""
        rows = torch.as_tensor(index, dtype=torch.long)
        per_fn = {name: [values[i] for i in index] for name, values in self.per_fn.items()}
        return Scores(self.total_B[rows], per_fn, self.failed_B[rows], list(self.errors))

    @staticmethod
    def concat(parts: list["Scores"]) -> "Scores":
        names = list(parts[0].per_fn)
        return Scores(
            total_B=torch.cat([p.total_B for p in parts]),
            per_fn={name: [v for p in parts for v in p.per_fn[name]] for name in names},
            failed_B=torch.cat([p.failed_B for p in parts]),
            errors=list(dict.fromkeys(e for p in parts for e in p.errors)),
        )


def _check_output(name: str, values: Any, expected: int) -> list:
    if not isinstance(values, (list, tuple)) or len(values) != expected:
        got = f"{type(values).__name__} of length {len(values)}" if hasattr(values, "__len__") else type(values).__name__
        raise UserError(f"reward fn '{name}' must return a list of {expected} numbers, got {got}")
    for v in values:
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
            raise UserError(f"reward fn '{name}' returned {type(v).__name__} {v!r}; return floats (or None)")
    return [None if v is None else float(v) for v in values]


def _call_one_by_one(reward: RewardFn, prompts, completions, columns) -> tuple[list, list[str]]:
    values, errors = [], []
    for i in range(len(completions)):
        one_columns = {k: [v[i]] for k, v in columns.items()}
        try:
            with time_limit(reward, 1):
                out = _check_output(reward.name, reward.fn([prompts[i]], [completions[i]], **one_columns, **reward.args), 1)
            values.append(out[0])
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - a failing sample is recorded, training goes on
            values.append(math.nan)
            errors.append(f"{reward.name}: sample {i}: {type(err).__name__}: {err}")
    return values, errors


def score_completions(
    rewards: list[RewardFn], prompts: list[str], completions: list[str], columns: dict[str, list]
) -> Scores:
    """columns: one list per column, aligned with completions (already repeated G times per prompt)."""
    n = len(completions)
    total = torch.zeros(n, dtype=torch.float64)  # float64 until the advantages: equal rewards stay equal
    failed = torch.zeros(n, dtype=torch.bool)
    per_fn, errors = {}, []
    for reward in rewards:
        try:
            with time_limit(reward, n):
                values = _check_output(reward.name, reward.fn(prompts, completions, **columns, **reward.args), n)
        except UserError:
            raise
        except Exception:  # noqa: BLE001 - find the failing samples one by one
            values, fn_errors = _call_one_by_one(reward, prompts, completions, columns)
            errors.extend(fn_errors)
        per_fn[reward.name] = values
        for i, v in enumerate(values):
            if v is None:  # not applicable to this sample: contributes nothing (TRL semantics)
                continue
            if not math.isfinite(v):
                failed[i] = True
                if not any(f"sample {i}:" in e and e.startswith(reward.name) for e in errors):
                    errors.append(f"{reward.name}: sample {i}: returned {v}")
                continue
            total[i] += reward.weight * v
    total[failed] = math.nan
    return Scores(total_B=total, per_fn=per_fn, failed_B=failed, errors=errors)
