"""Synthetic tool-use conversations for a supervised warm-up before RL with the calculator (docs/environments.md).

Each row is one episode as the RL run renders it: the system message that describes the calculator (the
same text the episode runner writes), the task's question, a calculator call with the problem's expression,
the tool's result, and the final answer. The run's held-out problems are left out.

    python -m rlora.envs.tool_data configs/calculator_tool.yaml --size 2000 --out runs/calculator_tool/sft.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlora.config import load_config
from rlora.data.prompts import held_out_task_examples, prompt_text
from rlora.data.tasks import make_task_examples
from rlora.envs.calculator import calculator
from rlora.envs.tools import CallFormat, tool_schema
from rlora.errors import UserError


def calculator_conversations(task: str, task_args: dict, size: int, seed: int, exclude: set[str],
                             fmt: CallFormat = CallFormat()) -> list[dict]:
    """`size` problems of a reasoning-gym task whose entries carry metadata.expression (chain_sum, basic_arithmetic),
    each solved by one calculator call, as {"messages": [...]} rows."""
    system = fmt.instructions([tool_schema(calculator)])
    rows = []
    for example in make_task_examples(task, task_args, size=size, seed=seed):
        question = prompt_text(example)
        expression = example.columns["entry"].get("metadata", {}).get("expression")
        if expression is None:
            raise UserError(f"task '{task}' gives no metadata.expression to call the calculator with: use chain_sum")
        if question in exclude:
            continue
        result = calculator(expression)
        call = fmt.start + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + fmt.end
        rows.append({"messages": [
            {"role": "system", "content": system}, {"role": "user", "content": question},
            {"role": "assistant", "content": call}, {"role": "tool", "content": result},
            {"role": "assistant", "content": f"The answer is {result}."}]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlora.envs.tool_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the RL config (its data.task, task_args and held-out split)")
    parser.add_argument("--size", type=int, default=2000, help="problems to draw (held-out ones are left out)")
    parser.add_argument("--seed", type=int, default=7, help="seed of the draw (not the config's data.seed)")
    parser.add_argument("--out", required=True, help="jsonl file to write")
    args = parser.parse_args(argv)
    try:
        try:
            cfg = load_config(args.config, [])
        except UserError as err:  # e.g. an `rlora sft` config: its keys are not an RL config's
            if "unknown config key" not in str(err):
                raise
            raise UserError(f"{args.config}: not an `rlora train` config ({err}): give the RL config whose "
                            "data.task the conversations are drawn from (e.g. configs/calculator_tool.yaml)") from None
        if cfg.data.task is None:
            raise UserError("the config needs data.task (e.g. chain_sum)")
        held_out = {prompt_text(ex) for ex in held_out_task_examples(cfg.data)} if cfg.data.eval_size else set()
        rows = calculator_conversations(cfg.data.task, cfg.data.task_args, args.size, args.seed, held_out)
    except UserError as err:
        print(f"rlora: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"{len(rows)} conversations -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
