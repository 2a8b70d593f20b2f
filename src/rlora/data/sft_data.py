"""Supervised rows for `rlora sft`: read prompt/completion or chat rows, tokenize them into (ids, labels)
with the loss on completion / assistant tokens only, and the length-grouped batch order.

Labels follow the Hugging Face convention: labels[i] = ids[i] where token i is trained on, IGNORE elsewhere
(the loss shifts them: position i - 1 predicts token i)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from rlora.config import SFTDataConfig
from rlora.data.files import is_prompt, read_table
from rlora.data.prompts import to_messages
from rlora.errors import UserError

IGNORE = -100

Messages = list[dict[str, str]]


@dataclass
class Conversation:
    """One row before tokenization: the messages, and whether only the last assistant turn is trained on
    (prompt/completion rows; their prompt may hold earlier turns) or every assistant turn (chat rows)."""

    messages: Messages
    last_turn_only: bool


@dataclass
class TokenizedRow:
    ids: list[int]
    labels: list[int]


@dataclass
class SFTData:
    train: list[TokenizedRow]
    eval: list[TokenizedRow]
    truncated: int  # rows cut at train.max_length
    dropped: int  # rows left with no completion token after the cut


# ---- pure: labels, truncation, order -------------------------------------------------------------------

def mask_labels(segments: list[tuple[list[int], bool]]) -> TokenizedRow:
    """Concatenate token segments; a segment's tokens are labels when its flag is True, IGNORE otherwise."""
    ids, labels = [], []
    for tokens, trained in segments:
        ids += tokens
        labels += tokens if trained else [IGNORE] * len(tokens)
    return TokenizedRow(ids, labels)


def num_targets(row: TokenizedRow) -> int:
    """Tokens the loss covers (the first token has no position before it to predict it)."""
    return sum(label != IGNORE for label in row.labels[1:])


def truncate(row: TokenizedRow, max_length: int) -> TokenizedRow:
    return TokenizedRow(row.ids[:max_length], row.labels[:max_length])


class LengthGroupedOrder:
    """Rows of each step: epochs of seeded shuffles, each cut into windows of `window` batches that are
    sorted by length (so a batch holds rows of similar length and pads little). A pure function of
    (seed, step)."""

    def __init__(self, lengths: list[int], batch_size: int, window: int, seed: int):
        self.lengths, self.batch_size, self.window, self.seed = lengths, batch_size, window, seed
        self._epoch = lru_cache(maxsize=2)(self._epoch_order)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.lengths)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        chunk = self.batch_size * self.window
        return [i for start in range(0, len(order), chunk)
                for i in sorted(order[start:start + chunk], key=lambda j: self.lengths[j])]

    def indices(self, step: int) -> list[int]:
        picked = []
        for position in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, offset = divmod(position, len(self.lengths))
            picked.append(self._epoch(epoch)[offset])
        return picked


# ---- reading rows --------------------------------------------------------------------------------------

def read_conversations(path: str, cfg: SFTDataConfig) -> list[Conversation]:
    table = read_table(path)
    wanted = [cfg.messages_column] if cfg.messages_column else [cfg.prompt_column, cfg.completion_column]
    for column in wanted:
        if column not in table.column_names:
            key = "messages_column" if cfg.messages_column else \
                ("prompt_column" if column == cfg.prompt_column else "completion_column")
            raise UserError(f"data file {path} has no column '{column}' (columns: {', '.join(table.column_names)}); "
                            f"set data.{key}")
    return [_conversation(row, number, path, cfg) for number, row in enumerate(table, start=1)]


def _conversation(row: dict, number: int, path: str, cfg: SFTDataConfig) -> Conversation:
    where = f"data file {path}, row {number}"
    if cfg.messages_column:
        messages = row[cfg.messages_column]
        if not (isinstance(messages, list) and is_prompt(messages)):
            raise UserError(f"{where}: column '{cfg.messages_column}' must hold a list of chat messages {{role, content}}")
        if not any(m["role"] == "assistant" for m in messages):
            raise UserError(f"{where}: the conversation has no assistant turn, so nothing to train on")
        return Conversation(to_messages(messages, cfg.system_prompt), last_turn_only=False)
    prompt, completion = row[cfg.prompt_column], row[cfg.completion_column]
    if not is_prompt(prompt):
        raise UserError(f"{where}: column '{cfg.prompt_column}' must hold non-empty text or a list of chat messages")
    if not (isinstance(completion, str) and completion.strip()):
        raise UserError(f"{where}: column '{cfg.completion_column}' must hold non-empty text")
    messages = to_messages(prompt, cfg.system_prompt) + [{"role": "assistant", "content": completion}]
    return Conversation(messages, last_turn_only=True)


def split_rows(train: list, eval_rows: list | None, cfg: SFTDataConfig) -> tuple[list, list]:
    """The held-out rows: eval_path's (first eval_size, 0: all), else eval_size rows drawn with seed."""
    if eval_rows is not None:
        return train, eval_rows[: cfg.eval_size or None]
    if cfg.eval_size == 0:
        return train, []
    if cfg.eval_size >= len(train):
        raise UserError(f"data.eval_size={cfg.eval_size} leaves no training rows of {len(train)}: lower it")
    held = set(random.Random(cfg.seed).sample(range(len(train)), cfg.eval_size))
    return [r for i, r in enumerate(train) if i not in held], [train[i] for i in sorted(held)]


# ---- tokenizing ----------------------------------------------------------------------------------------

def chat_segments(tokenizer, conv: Conversation) -> list[tuple[list[int], bool]]:
    """Split the chat-template rendering at assistant turns: render(messages[:i], generation prompt) and
    render(messages[:i + 1]) bound turn i. Templates that do not render prefix by prefix are refused."""
    full = tokenizer.apply_chat_template(conv.messages, tokenize=False)
    assistant = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
    trained = assistant[-1:] if conv.last_turn_only else assistant
    bounds, cursor = [], 0
    for i in trained:
        before = tokenizer.apply_chat_template(conv.messages[:i], tokenize=False, add_generation_prompt=True)
        after = tokenizer.apply_chat_template(conv.messages[: i + 1], tokenize=False)
        if not (after.startswith(before) and full.startswith(after)) or len(before) < cursor:
            raise UserError("the tokenizer's chat template does not render a conversation prefix by prefix, so the "
                            "assistant turns cannot be located: use prompt/completion rows with "
                            "data.use_chat_template=false")
        bounds.append((cursor, len(before), False))
        bounds.append((len(before), len(after), True))
        cursor = len(after)
    bounds.append((cursor, len(full), False))

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    return [(encode(full[start:end]), flag) for start, end, flag in bounds if end > start]


def plain_segments(tokenizer, conv: Conversation, eos_id: int) -> list[tuple[list[int], bool]]:
    """No chat template: the prompt's text (system prompt first), then the completion and EOS."""
    *prompt, answer = conv.messages
    prompt_ids = tokenizer("\n".join(m["content"] for m in prompt))["input_ids"]
    return [(prompt_ids, False), (tokenizer(answer["content"], add_special_tokens=False)["input_ids"] + [eos_id], True)]


def tokenize(tokenizer, conv: Conversation, use_chat_template: bool, eos_id: int) -> TokenizedRow:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if not conv.last_turn_only and not has_template:
        raise UserError("data.messages_column needs a tokenizer with a chat template; this one has none")
    if has_template and (use_chat_template or not conv.last_turn_only):
        return mask_labels(chat_segments(tokenizer, conv))
    return mask_labels(plain_segments(tokenizer, conv, eos_id))


def load_sft_data(cfg: SFTDataConfig, tokenizer, eos_id: int, max_length: int) -> SFTData:
    train = read_conversations(cfg.path, cfg)
    held = read_conversations(cfg.eval_path, cfg) if cfg.eval_path else None
    train, held = split_rows(train, held, cfg)
    counts = {"truncated": 0, "dropped": 0}

    def prepare(convs: list[Conversation]) -> list[TokenizedRow]:
        rows = []
        for conv in convs:
            row = tokenize(tokenizer, conv, cfg.use_chat_template, eos_id)
            if len(row.ids) > max_length:
                counts["truncated"] += 1
                row = truncate(row, max_length)
            if num_targets(row) == 0:
                counts["dropped"] += 1
                continue
            rows.append(row)
        return rows

    train_rows, eval_rows = prepare(train), prepare(held)
    if not train_rows:
        raise UserError(f"no training rows left: all {len(train)} lose their completion at train.max_length="
                        f"{max_length}; raise it")
    return SFTData(train_rows, eval_rows, counts["truncated"], counts["dropped"])
