"""`rlora chat`'s terminal: the input/print loop (run_chat), streamed replies (ReplyStream), and chat_main
(argparse namespace -> check -> load -> loop)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import nullcontext

from rich.console import Console
from rich.markup import escape

from rlora.chat.conversation import (
    ChatState,
    ContextFull,
    Conversation,
    Settings,
    apply_command,
    parse_command,
    user_text,
)
from rlora.chat.model import (
    ChatModel,
    chat_tools,
    check_base_matches,
    choose_model,
    load_chat_model,
)
from rlora.errors import first_line
from rlora.logging.console import console, info
from rlora.models.named_adapters import parse_named_adapters


class ReplyStream:
    """Shows a reply while its tokens arrive: write(text) gets the pieces of the reply as it will be shown in
    full (decoded without special tokens, stripped), never a partial character (a byte-level token can end
    inside one: the decoded text then ends in U+FFFD) and never trailing whitespace that the reply may end
    with (held back until more text follows)."""

    def __init__(self, tokenizer, write: Callable[[str], None]):
        self.tokenizer, self.write = tokenizer, write
        self.tokens: list[int] = []
        self.shown = ""

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True).strip()
        if not text.endswith("\ufffd"):
            self._show(text)

    def finish(self, reply_text: str) -> None:
        """The rest of the final reply (the whole reply, when what was shown is not a prefix of it)."""
        self._show(reply_text.strip())

    def _show(self, text: str) -> None:
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.write(text[len(self.shown):])
            self.shown = text
        elif not text.startswith(self.shown) and text != self.shown:  # decoding a prefix changed earlier text
            self.write("\n" + text)
            self.shown = text


def _label(adapter: str | None) -> str:
    return adapter if adapter is not None else "base"


def run_chat(bot: ChatModel, state: ChatState, out, read: Callable[[str], str] = input) -> int:
    """The loop: read a line, run a command or answer it; until /quit or end of input. -> exit code 0."""
    out.print(f"chatting with {escape(state.model)} as [bold]{_label(state.active)}[/bold]; /help lists the commands",
              highlight=False, soft_wrap=True)
    while True:
        try:
            line = read("you> ")
        except EOFError:
            out.print()
            return 0
        except KeyboardInterrupt:
            out.print("\n(/quit or Ctrl-D to leave)", markup=False)
            continue
        if not line.strip():
            continue
        cmd = parse_command(line)
        if cmd is not None:
            outcome = apply_command(state, cmd)
            if outcome.quit:
                return 0
            out.print(outcome.text, style="red" if outcome.error else "dim", markup=False, highlight=False, soft_wrap=True)
            continue
        _answer(bot, state, user_text(line), out)


MAX_TOOL_ROUNDS = 4  # replies to tool results after one user message, at most


def _answer(bot: ChatModel, state: ChatState, text: str, out) -> None:
    """Reply to `text`; a reply that calls tools gets their results (printed, kept as tool turns) and is followed
    by another reply, up to MAX_TOOL_ROUNDS times."""
    state.conv.add_user(text)
    for _ in range(MAX_TOOL_ROUNDS + 1):
        reply_text = _reply(bot, state, out)
        if reply_text is None:
            return
        result = bot.tools.step(reply_text)
        if result.done:
            return
        for message in result.messages:
            state.conv.add_tool(message["content"])
            out.print(f"tool> {message['content']}", style="magenta", markup=False, highlight=False, soft_wrap=True)
    out.print(f"(stopped after {MAX_TOOL_ROUNDS} rounds of tool calls)", style="dim", markup=False)


def _reply(bot: ChatModel, state: ChatState, out) -> str | None:
    """Sample and print the reply to the conversation, streamed after the label as it is generated (both samplers
    call back with each token). -> its text (None: it failed, and a user message that got no reply leaves the
    conversation)."""
    label = f"{_label(state.active)}> "
    labelled = []  # the label goes out with the first piece (a message refused as too long shows none)

    def show(piece: str) -> None:
        if not labelled:
            out.print(label, style="bold cyan", end="", markup=False, highlight=False)
            labelled.append(True)
        out.print(piece, end="", markup=False, highlight=False, soft_wrap=True)

    stream = ReplyStream(bot.tokenizer, show)
    failure = None
    try:
        reply = bot.reply(state, stream)
    except ContextFull as err:
        failure = (f"message too long: {err.args[0]} prompt tokens, the model holds {bot.max_length} with "
                   f"--max-new-tokens {state.settings.max_new_tokens}; not sent", "red")
    except KeyboardInterrupt:
        failure = ("(reply interrupted; your message was not kept)", "dim")
    except RuntimeError as err:  # e.g. out of memory: the conversation so far is kept
        failure = (f"generation failed: {first_line(err)}", "red")
    if failure is not None:
        state.conv.drop_last_user()
        if labelled:
            out.print()  # end the line the label and the streamed text started
        out.print(failure[0], style=failure[1], markup=False)
        return None
    state.conv.add_reply(reply.text, state.active, state.settings.seed + state.replies)
    state.replies += 1
    stream.finish(reply.text)
    if not labelled:  # an empty reply
        show("")
    out.print()  # end the line the label and the streamed text started
    if reply.dropped:
        out.print(f"(the conversation outgrew the model's {bot.max_length} positions: dropped the oldest "
                  f"{reply.dropped} exchange(s) from the context; /save still writes them)", style="yellow", markup=False)
    if reply.finish_reason == "length":
        out.print(f"(cut at --max-new-tokens {state.settings.max_new_tokens})", style="dim", markup=False)
    return reply.text


def _enable_line_editing() -> None:
    """Arrow keys and in-session history for input() on a terminal."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401 - importing it turns line editing on: only on a terminal, not on every OS
        except ImportError:
            pass


def chat_main(args) -> int:
    """`rlora chat` from its argparse namespace: check the input, load the model and adapters, chat."""
    settings = Settings(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    settings.check()
    adapters = parse_named_adapters(args.adapter or [])
    tools = chat_tools(args.tool or [])  # a tool without a docstring: one line, before the model loads
    model_path = choose_model(args.model, adapters)
    with console.status(f"loading {model_path} ...") if console.is_terminal else nullcontext():
        bot = load_chat_model(model_path, adapters, args.dtype, settings.max_new_tokens, tools)
    for notice in check_base_matches(adapters, model_path):  # after loading: a misfit is an error, not this
        info(notice)
    state = ChatState(model_path, adapters, next(iter(adapters), None), settings, Conversation(system=args.system),
                      tools=tuple(tools.schemas))
    _enable_line_editing()
    return run_chat(bot, state, Console())
