"""`rlora chat`: an interactive terminal chat with a base model and any number of its LoRA adapters.

All adapters are loaded onto ONE base model (peft named adapters); `/adapter NAME` switches with
`set_adapter`, `/base` samples with the adapter switched off (`disable_adapter()`), so there is one copy
of the base weights whatever the number of adapters. Replies are sampled by rlora's own sampler
(`build_generator`), which reads the active adapter at every call.

Layers, so that most of it is tested without a model or a terminal:
  Conversation, ChatState, parse_command, apply_command, fit_context   pure state and commands
  ChatModel                                                            the loaded model: render + reply
  run_chat                                                             the input/print loop
  chat_main                                                            argparse namespace -> load -> loop
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from rlora.errors import UserError, first_line
from rlora.models.named_adapters import activated, attach_named, parse_named_adapters, recorded_base

DEFAULT_MODEL = "smollm2-135m-instruct"

HELP = {
    "adapter": ("/adapter [NAME]", "switch to adapter NAME; alone: list the adapters (* = active)"),
    "base": ("/base", "chat with the base model (adapter off)"),
    "system": ("/system [TEXT]", "set the system prompt; alone: remove it"),
    "reset": ("/reset", "clear the conversation"),
    "save": ("/save FILE", "write the conversation as JSON (model, adapter of each reply, settings)"),
    "help": ("/help", "this list"),
    "quit": ("/quit", "leave (also Ctrl-D)"),
}


# ---------------------------------------------------------------- pure state ------------------------------------


@dataclass
class Settings:
    max_new_tokens: int = 256
    temperature: float = 0.7  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if self.max_new_tokens <= 0:
            raise UserError(f"--max-new-tokens must be > 0 (got {self.max_new_tokens})")
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0, 0 meaning greedy (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1] (got {self.top_p})")

    def as_dict(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed, "greedy": self.temperature == 0}


@dataclass
class Conversation:
    """The turns of one conversation. Turns before `start` were dropped from what the model sees (to fit
    its context) but are kept for /save."""

    system: str | None = None
    turns: list[dict] = field(default_factory=list)  # {"role", "content"}; replies also "adapter", "seed"
    start: int = 0

    def messages(self) -> list[dict]:
        """What the chat template renders: the system prompt, then the turns still in context."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": t["role"], "content": t["content"]} for t in self.turns[self.start:]]

    def add_user(self, text: str) -> None:
        self.turns.append({"role": "user", "content": text})

    def add_reply(self, text: str, adapter: str | None, seed: int) -> None:
        self.turns.append({"role": "assistant", "content": text, "adapter": adapter, "seed": seed})

    def drop_last_user(self) -> None:
        """Undo add_user (the reply failed or was interrupted)."""
        if self.turns and self.turns[-1]["role"] == "user":
            self.turns.pop()
        self.start = min(self.start, len(self.turns))

    def drop_oldest(self) -> bool:
        """Move the oldest user turn and its reply out of the context; False when only the newest user turn is left."""
        if len(self.turns) - self.start <= 1:
            return False
        self.start += 2 if self.turns[self.start + 1]["role"] == "assistant" else 1
        return True

    def reset(self) -> None:
        self.turns, self.start = [], 0


@dataclass
class ChatState:
    model: str  # the base model folder (or hub id)
    adapters: dict[str, str]  # name -> folder, in the order given
    active: str | None  # None: the base model
    settings: Settings
    conv: Conversation
    replies: int = 0  # replies sampled so far: reply i is sampled with seed settings.seed + i

    def to_json(self) -> dict:
        system = [{"role": "system", "content": self.conv.system}] if self.conv.system else []
        return {"model": self.model, "adapters": dict(self.adapters), "sampling": self.settings.as_dict(),
                "dropped_messages": self.conv.start, "messages": system + [dict(t) for t in self.conv.turns]}


@dataclass(frozen=True)
class Command:
    name: str
    arg: str = ""


@dataclass(frozen=True)
class Outcome:
    text: str = ""
    quit: bool = False
    error: bool = False


def parse_command(line: str) -> Command | None:
    """'/name arg' -> Command; anything else is a user message (None). '//text' sends '/text'."""
    stripped = line.strip()
    if not stripped.startswith("/") or stripped.startswith("//"):
        return None
    name, _, arg = stripped[1:].partition(" ")
    return Command(name.lower(), arg.strip())


def user_text(line: str) -> str:
    stripped = line.strip()
    return stripped[1:] if stripped.startswith("//") else stripped


def help_text() -> str:
    width = max(len(usage) for usage, _ in HELP.values())
    lines = [f"  {usage.ljust(width)}  {what}" for usage, what in HELP.values()]
    return "\n".join(["commands:", *lines, "anything else is sent to the model ('//text' sends '/text')"])


def adapter_list(state: ChatState) -> str:
    def mark(name: str | None) -> str:
        return "*" if state.active == name else " "

    rows = [f"{mark(name)} {name}  {path}" for name, path in state.adapters.items()]
    return "\n".join(rows + [f"{mark(None)} base  (adapter off: /base)"])


def apply_command(state: ChatState, cmd: Command) -> Outcome:
    handler = _HANDLERS.get(cmd.name)
    if handler is None:
        return Outcome(f"unknown command '/{cmd.name}': /help lists the commands", error=True)
    return handler(state, cmd.arg)


def _cmd_adapter(state: ChatState, arg: str) -> Outcome:
    if not arg:
        return Outcome(adapter_list(state))
    if arg not in state.adapters:
        known = ", ".join(state.adapters) or "none (start with --adapter NAME=PATH)"
        return Outcome(f"no adapter '{arg}': loaded: {known}", error=True)
    state.active = arg
    return Outcome(f"adapter {arg} active")


def _cmd_base(state: ChatState, arg: str) -> Outcome:
    state.active = None
    return Outcome("base model active (adapter off)")


def _cmd_system(state: ChatState, arg: str) -> Outcome:
    state.conv.system = arg or None
    return Outcome(f"system prompt set: {arg}" if arg else "system prompt removed")


def _cmd_reset(state: ChatState, arg: str) -> Outcome:
    state.conv.reset()
    return Outcome("conversation cleared")


def _cmd_save(state: ChatState, arg: str) -> Outcome:
    if not arg:
        return Outcome("usage: /save FILE", error=True)
    try:
        path = save_conversation(state, arg)
    except OSError as err:
        return Outcome(f"could not save to '{arg}': {first_line(err)}", error=True)
    return Outcome(f"saved {len(state.conv.turns)} messages to {path}")


def _cmd_help(state: ChatState, arg: str) -> Outcome:
    return Outcome(help_text())


def _cmd_quit(state: ChatState, arg: str) -> Outcome:
    return Outcome(quit=True)


_HANDLERS: dict[str, Callable[[ChatState, str], Outcome]] = {
    "adapter": _cmd_adapter, "base": _cmd_base, "system": _cmd_system, "reset": _cmd_reset, "save": _cmd_save,
    "help": _cmd_help, "quit": _cmd_quit, "exit": _cmd_quit,
}


def save_conversation(state: ChatState, file: str) -> Path:
    """Atomic write (temporary file, fsync, rename) of the conversation JSON."""
    from rlora.train.outputs import RunDir

    path = Path(file).expanduser()
    if path.is_dir():
        raise IsADirectoryError(f"'{file}' is a folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    RunDir(str(path.parent)).write_json(path.name, state.to_json())
    return path


class ContextFull(Exception):
    """The system prompt and the newest user message alone do not fit the model's context."""


def fit_context(conv: Conversation, render: Callable[[list[dict]], list[int]], limit: int) -> tuple[list[int], int]:
    """Render the conversation, dropping the oldest turns until the prompt has at most `limit` tokens.
    -> (prompt ids, number of user turns dropped). Raises ContextFull (with the token count) if even the
    newest user message alone is too long."""
    dropped = 0
    while True:
        ids = render(conv.messages())
        if len(ids) <= limit:
            return ids, dropped
        if not conv.drop_oldest():
            raise ContextFull(len(ids))
        dropped += 1


# ---------------------------------------------------------------- the model -------------------------------------


def choose_model(model: str | None, adapters: dict[str, str]) -> str:
    """--model, else the first adapter's recorded base, else the built-in alias -> a loadable path."""
    from rlora.models.loading import resolve_model_path

    if model is not None:
        return resolve_model_path(model)
    first = next(iter(adapters.values()), None)
    base = recorded_base(first) if first is not None else None
    if base is None:
        return resolve_model_path(DEFAULT_MODEL)
    try:
        return resolve_model_path(base)
    except UserError:
        raise UserError(f"adapter '{first}' names the base '{base}', which is not a model folder here: "
                        "pass --model MODEL") from None


@dataclass
class Reply:
    text: str
    finish_reason: str  # "stop" or "length"
    dropped: int  # user turns dropped from the context for this reply


class ChatModel:
    """The base model with its adapters, its tokenizer and rlora's sampler."""

    def __init__(self, model, tokenizer, generator, max_length: int):
        self.model, self.tokenizer, self.generator, self.max_length = model, tokenizer, generator, max_length

    def render(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @property
    def streams(self) -> bool:
        """Whether replies can be shown while they are generated (the built-in sampler; `generate` cannot)."""
        return self.generator.name == "builtin"

    def reply(self, state: ChatState, on_token: Callable[[int], None] | None = None) -> Reply:
        """Sample the assistant's answer to the conversation (whose last turn is the user's). on_token(token):
        each token as it is drawn (only where `streams`)."""
        from rlora.types import SamplingParams

        s = state.settings
        ids, dropped = fit_context(state.conv, self.render, self.max_length - s.max_new_tokens)
        params = (SamplingParams(max_new_tokens=s.max_new_tokens, greedy=True) if s.temperature == 0 else
                  SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p))
        stream = {} if on_token is None else {"on_token": lambda _row, token: on_token(token)}
        with activated(self.model, state.active) as model:
            rollout = self.generator.sample(model, [ids], 1, params, seed=s.seed + state.replies, **stream)
        return Reply(rollout.completions[0], rollout.finish_reasons[0], dropped)


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


def model_max_length(model, tokenizer) -> int:
    from rlora.models.loading import causal_lm

    limit = getattr(causal_lm(model).config, "max_position_embeddings", None)
    if not limit:
        limit = tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else 2048
    return int(limit)


def load_chat_model(model_path: str, adapters: dict[str, str], dtype: str, max_new_tokens: int) -> ChatModel:
    from rlora.config import ModelConfig, RolloutConfig
    from rlora.models.loading import add_model_eos_ids, load_base_model, load_tokenizer
    from rlora.rollout.backends import build_generator

    tokenizer, tok = load_tokenizer(model_path)
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"the tokenizer of '{model_path}' has no chat template: rlora chat needs a chat (instruct) model")
    base = load_base_model(ModelConfig(path=model_path, dtype=dtype), model_path)
    add_model_eos_ids(tok, base)
    model = attach_named(base, adapters, model_path)
    max_length = model_max_length(model, tokenizer)
    if max_new_tokens >= max_length:
        raise UserError(f"--max-new-tokens {max_new_tokens} leaves no room for the prompt in the model's "
                        f"{max_length} positions")
    exact = RolloutConfig(sampler_dtype="model")  # the same replies for a seed on every machine
    generator = build_generator(exact, model, tokenizer, tok.eos_ids, tok.pad_id, max_length, batch_size=1)
    return ChatModel(model, tokenizer, generator, max_length)


def check_base_matches(adapters: dict[str, str], model_path: str) -> list[str]:
    """Notices for adapters recorded for another base (same shapes load, but the adapter was not trained for it)."""
    notices = []
    for name, folder in adapters.items():
        base = recorded_base(folder)
        if base and base != model_path and not (Path(base).exists() and Path(base).resolve() == Path(model_path).resolve()):
            notices.append(f"adapter {name} was trained on '{base}', not on '{model_path}'")
    return notices


# ---------------------------------------------------------------- the terminal ----------------------------------


def _label(adapter: str | None) -> str:
    return adapter if adapter is not None else "base"


def run_chat(bot: ChatModel, state: ChatState, out, read: Callable[[str], str] = input) -> int:
    """The loop: read a line, run a command or answer it; until /quit or end of input. -> exit code 0."""
    from rich.markup import escape

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


def _answer(bot: ChatModel, state: ChatState, text: str, out) -> None:
    """Sample and print the reply to `text`: streamed after the label as it is generated (the built-in sampler),
    else printed whole once it is done (a spinner meanwhile, on a terminal)."""
    state.conv.add_user(text)
    label = f"{_label(state.active)}> "
    labelled = []  # the label goes out with the first piece (a message refused as too long shows none)

    def show(piece: str) -> None:
        if not labelled:
            out.print(label, style="bold cyan", end="", markup=False, highlight=False)
            labelled.append(True)
        out.print(piece, end="", markup=False, highlight=False, soft_wrap=True)

    stream = ReplyStream(bot.tokenizer, show) if bot.streams else None
    status = out.status("generating ...") if out.is_terminal and stream is None else nullcontext()
    failure = None
    try:
        with status:
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
        return
    state.conv.add_reply(reply.text, state.active, state.settings.seed + state.replies)
    state.replies += 1
    if stream is not None:
        stream.finish(reply.text)
        if not labelled:  # an empty reply
            show("")
        out.print()
    else:
        out.print(label, style="bold cyan", end="", markup=False, highlight=False)
        out.print(reply.text.strip(), markup=False, highlight=False, soft_wrap=True)
    if reply.dropped:
        out.print(f"(the conversation outgrew the model's {bot.max_length} positions: dropped the oldest "
                  f"{reply.dropped} exchange(s) from the context; /save still writes them)", style="yellow", markup=False)
    if reply.finish_reason == "length":
        out.print(f"(cut at --max-new-tokens {state.settings.max_new_tokens})", style="dim", markup=False)


def _enable_line_editing() -> None:
    """Arrow keys and in-session history for input() on a terminal."""
    import sys

    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401 - importing it is what turns line editing on
        except ImportError:
            pass


def chat_main(args) -> int:
    """`rlora chat` from its argparse namespace: check the input, load the model and adapters, chat."""
    from rich.console import Console

    from rlora.logging.console import console, info

    settings = Settings(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    settings.check()
    adapters = parse_named_adapters(args.adapter or [])
    model_path = choose_model(args.model, adapters)
    with console.status(f"loading {model_path} ...") if console.is_terminal else nullcontext():
        bot = load_chat_model(model_path, adapters, args.dtype, settings.max_new_tokens)
    for notice in check_base_matches(adapters, model_path):  # after loading: a misfit is an error, not this
        info(notice)
    state = ChatState(model_path, adapters, next(iter(adapters), None), settings, Conversation(system=args.system))
    _enable_line_editing()
    return run_chat(bot, state, Console())
