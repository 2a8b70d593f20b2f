"""`rlora chat`'s model: the base with every adapter as a named peft adapter, its tokenizer and rlora's
sampler (ChatModel: render a conversation, sample a reply); which base to load (choose_model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlora.chat.conversation import ChatState, fit_context
from rlora.config import ModelConfig, RolloutConfig
from rlora.envs.calculator import calculator
from rlora.envs.protocol import StepResult
from rlora.envs.registry import tools_env
from rlora.envs.render import EpisodeRenderer
from rlora.envs.tools import CallFormat, ToolEnvironment
from rlora.errors import UserError
from rlora.models.loading import add_model_eos_ids, causal_lm, load_base_model, load_tokenizer, resolve_model_path
from rlora.models.named_adapters import activated, attach_named, recorded_base
from rlora.rollout.backends import build_generator
from rlora.types import SamplingParams

DEFAULT_MODEL = "smollm2-135m-instruct"


# ---------------------------------------------------------------- the model -------------------------------------


def choose_model(model: str | None, adapters: dict[str, str]) -> str:
    """--model, else the first adapter's recorded base, else the built-in alias -> a loadable path."""
    if model is not None:
        return resolve_model_path(model, "--model")
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


class NoTools:
    """A chat without tools: no tool is described, and every reply ends the model's turn."""

    schemas: tuple[dict, ...] = ()
    fmt = CallFormat()

    def step(self, assistant_text: str) -> StepResult:
        return StepResult(done=True)


NO_TOOLS = NoTools()


def chat_tools(specs: list[str], timeout_s: float = 10.0) -> ToolEnvironment | NoTools:
    """--tool values (calculator, module.function or FILE.py:function) -> the tools the model may call."""
    if not specs:
        return NO_TOOLS
    return tools_env([calculator if spec == "calculator" else spec for spec in specs], timeout_s=timeout_s)


class ChatModel:
    """The base model with its adapters, its tokenizer, rlora's sampler and the tools it may call."""

    def __init__(self, model, tokenizer, generator, max_length: int, tools: ToolEnvironment | NoTools = NO_TOOLS):
        self.model, self.tokenizer, self.generator, self.max_length = model, tokenizer, generator, max_length
        self.tools = tools
        # the conversation as the chat template writes it, the tools described where the template cannot
        self.renderer = EpisodeRenderer(tokenizer, tools.schemas, tools.fmt)

    def render(self, messages: list[dict]) -> list[int]:
        return self.renderer.first_prompt(messages)

    def reply(self, state: ChatState, on_token: Callable[[int], None] | None = None) -> Reply:
        """Sample the assistant's answer to the conversation (whose last turn is the user's). on_token(token):
        each token as it is drawn."""
        s = state.settings
        ids, dropped = fit_context(state.conv, self.render, self.max_length - s.max_new_tokens)
        params = (SamplingParams(max_new_tokens=s.max_new_tokens, greedy=True) if s.temperature == 0 else
                  SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p))
        stream = {} if on_token is None else {"on_token": lambda _row, token: on_token(token)}
        route_by = [self.render(state.conv.first_prompt_messages())]  # a sequence-routed MoLoRA's prompt
        with activated(self.model, state.active) as model:
            rollout = self.generator.sample(model, [ids], 1, params, seed=s.seed + state.replies, route_by=route_by,
                                            **stream)
        return Reply(rollout.completions[0], rollout.finish_reasons[0], dropped)


def model_max_length(model, tokenizer) -> int:
    limit = getattr(causal_lm(model).config, "max_position_embeddings", None)
    if not limit:
        limit = tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else 2048
    return int(limit)


def load_chat_model(model_path: str, adapters: dict[str, str], dtype: str, max_new_tokens: int,
                    tools: ToolEnvironment | NoTools = NO_TOOLS) -> ChatModel:
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
    return ChatModel(model, tokenizer, generator, max_length, tools)


def check_base_matches(adapters: dict[str, str], model_path: str) -> list[str]:
    """Notices for adapters recorded for another base (same shapes load, but the adapter was not trained for it)."""
    notices = []
    for name, folder in adapters.items():
        base = recorded_base(folder)
        if base and base != model_path and not (Path(base).exists() and Path(base).resolve() == Path(model_path).resolve()):
            notices.append(f"adapter {name} was trained on '{base}', not on '{model_path}'")
    return notices


# ---------------------------------------------------------------- the terminal ----------------------------------
