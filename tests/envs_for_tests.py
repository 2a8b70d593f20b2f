"""Scripted environments and tools for the environment tests (importable by dotted path: tests/ is on sys.path)."""

import time

import torch

from rlora.envs.protocol import StepResult
from rlora.models.tiny import build_random_model


def eos_prone_model(folder, seed: int = 0, strength: float = 5.0):
    """A tiny random Llama whose EOS row points along its typical final hidden state, so that turns end by EOS
    after a few tokens in some rows and run to their token budget in others (a random model rarely samples EOS)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_random_model(folder, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("What is 3 + 4? The answer is 7. Hello, how are you today? a b c d e", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1][0].mean(0)
        rows = model.get_output_embeddings().weight
        rows[tokenizer.eos_token_id] = hidden / hidden.norm() * strength * rows.norm(dim=1).mean()
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
