"""Train and held-out prompt sets, prompt rendering with the chat template, and the data order."""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlora.config import DataConfig
from rlora.data.files import read_prompt_file
from rlora.data.tasks import HUMANEVAL, humaneval_examples, make_task_examples
from rlora.errors import UserError
from rlora.types import Example


@dataclass
class PromptSets:
    train: list[Example]
    eval: list[Example]


def load_prompt_sets(cfg: DataConfig) -> PromptSets:
    if cfg.task == HUMANEVAL:
        return _fixed_split(humaneval_examples(), cfg)
    if cfg.task is not None:
        held_out = held_out_task_examples(cfg) if cfg.eval_size else []
        seen = {prompt_text(ex) for ex in held_out}
        train = [ex for ex in make_task_examples(cfg.task, cfg.task_args, size=cfg.train_size, seed=cfg.seed)
                 if prompt_text(ex) not in seen]
        if not train:
            raise UserError(f"task '{cfg.task}' has no training problems left after removing the held-out ones: "
                            "lower data.eval_size or widen data.task_args")
        return PromptSets(train=train, eval=held_out)
    train = read_prompt_file(cfg.path, cfg.prompt_column, cfg.answer_column)
    held_out = read_prompt_file(cfg.eval_path, cfg.prompt_column, cfg.answer_column) if cfg.eval_path else []
    return PromptSets(train=train, eval=held_out[: cfg.eval_size])


def check_answers(sets: PromptSets, cfg: DataConfig, reward: str) -> None:
    """A reward that compares completions with each row's `answer` (the built-in `math`) cannot score a row whose
    answer is null, missing or empty: every sample of it would fail at its step, after the model has loaded. So
    such rows are refused up front, naming the first one (rows counted from 1, as read_prompt_file counts)."""
    column = cfg.answer_column or "answer"
    for path, examples in ((cfg.path, sets.train), (cfg.eval_path, sets.eval)):
        if examples and all("answer" not in ex.columns for ex in examples):
            setting = "data.answer_column is null" if cfg.answer_column is None else f"it has no column '{column}'"
            raise UserError(f"data file {path}: reward '{reward}' compares completions with the answer column, but "
                            f"{setting}: set data.answer_column to the column holding the reference answers")
        for number, ex in enumerate(examples, start=1):
            value = ex.columns.get("answer")
            if value is None or value != value or (isinstance(value, str) and not value.strip()):  # NaN: a blank cell
                what = "empty" if isinstance(value, str) else "missing (null)"
                raise UserError(f"data file {path}, row {number}: column '{column}' is {what}, but reward '{reward}' "
                                "compares completions with it: fill in the answer or remove the row")


def held_out_notice(cfg: DataConfig) -> str | None:
    """Why a run with eval.before/after on evaluates nothing, or None when it has held-out prompts. A data.path
    run holds out nothing by itself (every row trains): its held-out set is data.eval_path's first eval_size rows."""
    if cfg.task is None and cfg.eval_path is None:
        return ("no held-out evaluation: data.path has no held-out rows (every row trains, and data.eval_size counts "
                "rows of data.eval_path, which is not set): set data.eval_path to a file of held-out prompts")
    if cfg.eval_size == 0:
        return "no held-out evaluation: data.eval_size=0 holds out no prompts: set data.eval_size > 0"
    return None


def _fixed_split(examples: list[Example], cfg: DataConfig) -> PromptSets:
    """A fixed problem set: eval_size problems drawn with eval_seed are held out, the rest (up to train_size,
    in the set's order) train."""
    if cfg.eval_size >= len(examples):
        raise UserError(f"data.eval_size={cfg.eval_size} leaves no training problems of {len(examples)}: lower it")
    held = set(random.Random(cfg.eval_seed).sample(range(len(examples)), cfg.eval_size))
    train = [ex for i, ex in enumerate(examples) if i not in held][: cfg.train_size]
    return PromptSets(train=train, eval=[examples[i] for i in sorted(held)])


def held_out_task_examples(cfg: DataConfig) -> list[Example]:
    """eval_size distinct problems drawn with eval_seed. Small task spaces repeat problems, so the draw is
    deduplicated here and the same problems are removed from the training set by the caller: held-out
    accuracy is always measured on problems the policy never trained on."""
    draws = make_task_examples(cfg.task, cfg.task_args, size=cfg.eval_size * 4, seed=cfg.eval_seed)
    unique: dict[str, Example] = {}
    for ex in draws:
        unique.setdefault(prompt_text(ex), ex)
        if len(unique) == cfg.eval_size:
            break
    return list(unique.values())


def to_messages(prompt: str | list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def render_prompt(tokenizer, example: Example, system_prompt: str | None, use_chat_template: bool) -> list[int]:
    """Prompt -> token ids, through the chat template when the tokenizer has one (and it is enabled)."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            to_messages(example.prompt, system_prompt), add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if isinstance(example.prompt, list):
        text = "\n".join(m["content"] for m in example.prompt)
    else:
        text = example.prompt
    if system_prompt:
        text = system_prompt + "\n" + text
    return tokenizer(text)["input_ids"]


def prompt_text(example: Example) -> str:
    if isinstance(example.prompt, str):
        return example.prompt
    return "\n".join(m["content"] for m in example.prompt)


class PromptOrder:
    """Which prompts each step uses: epochs of seeded shuffles, a pure function of (seed, step) so a
    resumed run continues exactly where it stopped."""

    def __init__(self, num_examples: int, prompts_per_step: int, seed: int, shuffle: bool = True):
        self.num_examples = num_examples
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.shuffle = shuffle

    def _epoch(self, epoch: int) -> list[int]:
        order = list(range(self.num_examples))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def indices(self, step: int) -> list[int]:
        start = step * self.prompts_per_step
        picked = []
        for position in range(start, start + self.prompts_per_step):
            epoch, offset = divmod(position, self.num_examples)
            picked.append(self._epoch(epoch)[offset])
        return picked
