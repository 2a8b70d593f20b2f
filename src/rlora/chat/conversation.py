"""`rlora chat`'s conversation and commands: pure state, tested without a model or a terminal
(Conversation, ChatState, parse_command, apply_command, fit_context, save_conversation)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlora.errors import UserError, first_line
from rlora.train.outputs import RunDir

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

    def first_prompt_messages(self) -> list[dict]:
        """The system prompt and the first user turn still in context: the prompt a MoLoRA sequence router routes
        the conversation by, as training routes a chat row by its conversation up to the first reply (rlora sft)
        and an episode by its first prompt (rlora train)."""
        messages = self.messages()
        first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages) - 1)
        return messages[:first_user + 1]

    def add_user(self, text: str) -> None:
        self.turns.append({"role": "user", "content": text})

    def add_reply(self, text: str, adapter: str | None, seed: int) -> None:
        self.turns.append({"role": "assistant", "content": text, "adapter": adapter, "seed": seed})

    def drop_last_user(self) -> None:
        """Undo add_user (the reply failed or was interrupted)."""
        if self.turns and self.turns[-1]["role"] == "user":
            self.turns.pop()
        self.start = min(self.start, len(self.turns))

    def add_tool(self, text: str) -> None:
        """A tool's result (rlora chat --tool), answered by the next reply."""
        self.turns.append({"role": "tool", "content": text})

    def drop_oldest(self) -> bool:
        """Move the oldest exchange (a user turn and what followed it up to the next user turn: the reply, tool
        results and replies to them) out of the context; False when only the newest exchange is left."""
        later_users = [i for i in range(self.start + 1, len(self.turns)) if self.turns[i]["role"] == "user"]
        if not later_users:
            return False
        self.start = later_users[0]
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
    tools: tuple[dict, ...] = ()  # the JSON schemas of the tools (--tool) the model was shown

    def to_json(self) -> dict:
        """The conversation with what reproduces it: model, adapters, sampling, system prompt, tools (as a chat
        dataset row holds them: `messages` and `tools`)."""
        system = [{"role": "system", "content": self.conv.system}] if self.conv.system else []
        tools = {"tools": [dict(schema) for schema in self.tools]} if self.tools else {}
        return {"model": self.model, "adapters": dict(self.adapters), "sampling": self.settings.as_dict(),
                "dropped_messages": self.conv.start, "messages": system + [dict(t) for t in self.conv.turns], **tools}


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
    count = len(state.to_json()["messages"])  # what the file holds: the system prompt is one of its messages
    return Outcome(f"saved {count} message{'' if count == 1 else 's'} to {path}")


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
