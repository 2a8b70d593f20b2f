"""Chat messages -> token ids, for episodes: the first prompt, then only the tokens each new turn adds.

Token in, token out: a turn's sampled tokens are kept as sampled; what follows them (the end of the assistant
turn as the template writes it, the environment's messages, the next assistant header) is rendered as text by
the chat template and tokenised alone. The history is never re-tokenised, so the trained ids are exactly the
sampled ones. This needs a template that only appends (rendering a longer conversation starts with the text of
the shorter one), which ChatML-style templates do; a template that rewrites earlier turns is refused.
"""

from __future__ import annotations

from rlora.envs.tools import CallFormat
from rlora.errors import UserError


def template_renders_tools(tokenizer) -> bool:
    """The chat template reads a `tools` variable (it writes the tools' schemas itself)."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def tools_of(env) -> tuple[list[dict], CallFormat]:
    """The tools an environment offers (their schemas) and how they are called; none for a plain environment."""
    return list(getattr(env, "schemas", [])), getattr(env, "fmt", CallFormat())


def with_tool_instructions(messages: list[dict], schemas: list[dict], fmt: CallFormat) -> list[dict]:
    """The tools described in the system message (for templates that cannot render `tools`)."""
    text = fmt.instructions(schemas)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


class RenderError(Exception):
    """This conversation cannot be continued token by token (its episode fails; check_template refuses the
    template up front where it fails for every conversation)."""


class EpisodeRenderer:
    """Renders one environment's conversations with the tokenizer's chat template."""

    def __init__(self, tokenizer, schemas: list[dict], fmt: CallFormat):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("environments need a tokenizer with a chat template (this model's has none)")
        self.tokenizer = tokenizer
        self.native_tools = bool(schemas) and template_renders_tools(tokenizer)
        self.schemas, self.fmt = schemas, fmt

    def conversation(self, messages: list[dict]) -> list[dict]:
        """The messages as rendered (tool instructions added to the system message where needed)."""
        if self.schemas and not self.native_tools:
            return with_tool_instructions(messages, self.schemas, self.fmt)
        return messages

    def _text(self, messages: list[dict], generation_prompt: bool) -> str:
        tools = self.schemas if self.native_tools else None
        return self.tokenizer.apply_chat_template(self.conversation(messages), tools=tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def first_prompt(self, messages: list[dict]) -> list[int]:
        return self._ids(self._text(messages, True))

    def continuation(self, history: list[dict], new: list[dict], ended_by_eos: bool, eos_text: str) -> list[int]:
        """The tokens after an assistant turn up to the next assistant turn's first token: the rest of the turn as
        the template ends it (ChatML: <|im_end|> unless the sampled EOS was it, and a newline), the environment's
        messages `new`, the next assistant header. `history` ends with that assistant turn (its decoded text)."""
        before = self._text(history, False)
        after = self._text(history + new, True)
        if not after.startswith(before):
            raise RenderError("the chat template rewrites earlier turns when a message is added, so episodes cannot be "
                              "extended token by token: use a model whose template only appends (e.g. ChatML)")
        head = self._text(history[:-1], True)  # up to the assistant header of that turn
        content = history[-1]["content"]
        body = next((text for text in (content, content.strip()) if before.startswith(head + text)), None)
        if body is None:
            raise RenderError("the chat template changes the assistant's reply when it renders it, so the tokens after "
                              "the sampled ones cannot be found")
        tail = before[len(head) + len(body):]  # the template's end of the turn
        if ended_by_eos and eos_text and tail.startswith(eos_text):  # the sampled tokens hold the end of the turn
            tail = tail[len(eos_text):]
        return self._ids(tail + after[len(before):])

    def check_template(self) -> None:
        """A one-line UserError where the template cannot render episodes at all: a probe conversation (a user
        message, a reply, a tool message) must render and extend by appending."""
        history = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "Let me check."}]
        try:
            self.first_prompt(history[:1])
            self.continuation(history, [{"role": "tool", "content": "4"}], False, "")
        except RenderError as err:
            raise UserError(str(err)) from None
        except Exception as err:  # noqa: BLE001 - a template's own error (e.g. roles it rejects), in one line
            raise UserError(f"the chat template cannot render an episode: {type(err).__name__}: {err}") from None

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
