"""Preference pairs for `rlora rm`: read prompt/chosen/rejected rows, tokenize prompt + response (the
response as the assistant turn of the chat template, or plain prompt tokens then response tokens and EOS),
and fit them into train.max_length by cutting the prompt from its start."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlora.config import RMDataConfig
from rlora.data.files import is_prompt, read_table
from rlora.data.prompts import to_messages
from rlora.data.sft_data import split_rows
from rlora.errors import UserError


@dataclass
class PreferenceRow:
    """One row before tokenization."""

    prompt: str | list[dict[str, str]]
    chosen: str
    rejected: str
    margin: float


@dataclass
class TokenizedPair:
    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float

    def length(self) -> int:
        return max(len(self.chosen_ids), len(self.rejected_ids))


@dataclass
class PreferenceData:
    train: list[TokenizedPair]
    eval: list[TokenizedPair]
    truncated: int  # pairs whose prompt was cut from the left to fit train.max_length
    dropped: int  # pairs where a response alone (with at least one prompt token) does not fit


# ---- pure: fitting into max_length ---------------------------------------------------------------------

def fit(prompt_ids: list[int], response_ids: list[int], max_length: int) -> tuple[list[int] | None, bool]:
    """(ids, truncated): prompt + response, the prompt cut from its start when too long; None when not even
    one prompt token fits beside the whole response."""
    if len(prompt_ids) + len(response_ids) <= max_length:
        return prompt_ids + response_ids, False
    keep = max_length - len(response_ids)
    if keep < 1:
        return None, True
    return prompt_ids[-keep:] + response_ids, True


# ---- reading rows --------------------------------------------------------------------------------------

def read_preferences(path: str, cfg: RMDataConfig) -> list[PreferenceRow]:
    table = read_table(path)
    columns = {"prompt_column": cfg.prompt_column, "chosen_column": cfg.chosen_column,
               "rejected_column": cfg.rejected_column, "margin_column": cfg.margin_column}
    for key, column in columns.items():
        if column is not None and column not in table.column_names:
            raise UserError(f"data file {path} has no column '{column}' (columns: {', '.join(table.column_names)}); "
                            f"set data.{key}")
    return [_row(row, number, path, cfg) for number, row in enumerate(table, start=1)]


def _row(row: dict, number: int, path: str, cfg: RMDataConfig) -> PreferenceRow:
    where = f"data file {path}, row {number}"
    if not is_prompt(row[cfg.prompt_column]):
        raise UserError(f"{where}: column '{cfg.prompt_column}' must hold non-empty text or a list of chat messages")
    for column in (cfg.chosen_column, cfg.rejected_column):
        if not (isinstance(row[column], str) and row[column].strip()):
            raise UserError(f"{where}: column '{column}' must hold non-empty text")
    margin = 0.0
    if cfg.margin_column is not None:
        margin = row[cfg.margin_column]
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
            raise UserError(f"{where}: column '{cfg.margin_column}' must hold a finite number, not {margin!r}")
    return PreferenceRow(row[cfg.prompt_column], row[cfg.chosen_column], row[cfg.rejected_column], float(margin))


# ---- tokenizing ----------------------------------------------------------------------------------------

def encode_parts(tokenizer, prompt, response: str, cfg: RMDataConfig, eos_id: int) -> tuple[list[int], list[int]]:
    """(prompt_ids, response_ids). Chat template: render(prompt messages, generation prompt) and
    render(prompt messages + assistant response) bound the response; else prompt text then response + EOS."""
    messages = to_messages(prompt, cfg.system_prompt)
    if cfg.use_chat_template and getattr(tokenizer, "chat_template", None):
        before = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
        if not full.startswith(before):
            raise UserError("the tokenizer's chat template does not render the prompt as a prefix of the "
                            "conversation, so the response cannot be located: set data.use_chat_template=false")
        return (tokenizer(before, add_special_tokens=False)["input_ids"],
                tokenizer(full[len(before):], add_special_tokens=False)["input_ids"])
    prompt_ids = tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
    return prompt_ids, tokenizer(response, add_special_tokens=False)["input_ids"] + [eos_id]


def load_preference_data(cfg: RMDataConfig, tokenizer, eos_id: int, max_length: int) -> PreferenceData:
    train = read_preferences(cfg.path, cfg)
    held = read_preferences(cfg.eval_path, cfg) if cfg.eval_path else None
    train, held = split_rows(train, held, cfg)
    counts = {"truncated": 0, "dropped": 0}

    def prepare(rows: list[PreferenceRow]) -> list[TokenizedPair]:
        pairs = []
        for row in rows:
            sides = [fit(*encode_parts(tokenizer, row.prompt, text, cfg, eos_id), max_length)
                     for text in (row.chosen, row.rejected)]
            if any(ids is None for ids, _ in sides):
                counts["dropped"] += 1
                continue
            counts["truncated"] += any(cut for _, cut in sides)
            pairs.append(TokenizedPair(sides[0][0], sides[1][0], row.margin))
        return pairs

    train_pairs, eval_pairs = prepare(train), prepare(held)
    if not train_pairs:
        raise UserError(f"no training pairs left: all {len(train)} have a response longer than train.max_length="
                        f"{max_length}; raise it")
    return PreferenceData(train_pairs, eval_pairs, counts["truncated"], counts["dropped"])
