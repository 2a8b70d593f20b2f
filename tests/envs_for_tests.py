"""Scripted environments and tools for the environment tests (importable by dotted path: tests/ is on sys.path)."""

import re
import time

import torch

from rlora.envs.protocol import StepResult
from rlora.models.tiny import build_random_model


def eos_prone_model(folder, seed: int = 0, strength: float = 6.0):
    """A tiny random Llama that ends some replies with EOS after a few tokens (a random model rarely samples EOS):
    every row of the tied embedding gets one shared direction c, which the residual stream then carries, and the
    EOS row is strength x c, so EOS scores above the others wherever the hidden state leans on c."""
    from transformers import AutoModelForCausalLM

    folder = build_random_model(folder, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(folder)
    rows = model.get_output_embeddings().weight
    with torch.no_grad():
        c = torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(seed))
        c = c / c.norm() * rows.norm(dim=1).mean()
        rows += c
        rows[model.config.eos_token_id] = strength * c
    model.save_pretrained(folder)
    return folder


class Scripted:
    """Replies 'ok N' after each turn; done after `turns` replies with reward = the turns' count."""

    def __init__(self, turns: int = 3):
        self.turns, self.seen = turns, 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult(reward=float(self.seen), done=True)
        return StepResult([{"role": "user", "content": f"ok {self.seen}"}], reward=1.0)


def scripted(turns: int = 3):
    return Scripted(turns)


class TurnsByNumber(Scripted):
    """As Scripted, with 1 + (the prompt's first number % most) turns: prompts 'What is i + i?' take 1, 2, ..., most
    turns by i, so ranks given different prompts play different numbers of turns."""

    def __init__(self, most: int):
        super().__init__()
        self.most = most

    def reset(self, row):
        self.turns = 1 + int(re.search(r"\d+", row["prompt"]).group()) % self.most
        return super().reset(row)


def turns_by_number(most: int = 3):
    return TurnsByNumber(most)


class SingleTurn:
    """Done after the first reply, no reward of its own: the prompt/completion task as an environment."""

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        return StepResult(done=True)


def single_turn():
    return SingleTurn()


class Faulty(Scripted):
    """Misbehaves by the prompt: 'raise' raises in step, 'hang' sleeps past any limit, 'bad' returns a malformed result,
    'reset' raises in reset; other prompts behave."""

    def reset(self, row):
        if "reset" in row["prompt"]:
            raise RuntimeError("cannot reset")
        self.mode = row["prompt"]
        return super().reset(row)

    def step(self, text):
        if "raise" in self.mode:
            raise ValueError("broken environment")
        if "hang" in self.mode:
            time.sleep(60)
        if "bad" in self.mode:
            return {"messages": "not a StepResult"}
        return super().step(text)


def faulty():
    return Faulty(turns=2)


def broken_factory():
    """A factory whose own code has a bug: its TypeError is the factory's fault, not its arguments'."""
    return len(3)


def no_docstring(x: int) -> int:
    return x


def slow_tool(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def failing_tool(x: int) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"no luck with {x}")


class AlwaysCalls:
    """A calculator episode whose first reply is taken as a calculator call of "2 + 3" whatever the (random) policy
    wrote, so that tool messages go through the template and the counters; the next reply ends it."""

    def __init__(self):
        from rlora.envs.calculator import calculator
        from rlora.envs.tools import ToolEnvironment

        self.tools = ToolEnvironment([calculator])
        self.schemas, self.fmt = self.tools.schemas, self.tools.fmt  # the tools the renderer describes
        self.turn = 0

    def reset(self, row):
        return self.tools.reset(row)

    def step(self, text):
        self.turn += 1
        if self.turn == 1:
            return self.tools.step('<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>')
        return self.tools.step(text.replace("<tool_call>", ""))  # no call: the episode ends


def always_calls():
    return AlwaysCalls()
