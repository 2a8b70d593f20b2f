"""`rlora chat`: an interactive terminal chat with a base model and any number of its LoRA adapters.

All adapters are loaded onto ONE base model (peft named adapters); `/adapter NAME` switches with
`set_adapter`, `/base` samples with the adapter switched off (`disable_adapter()`), so there is one copy
of the base weights whatever the number of adapters. Replies are sampled by rlora's own sampler
(`build_generator`), which reads the active adapter at every call.

Modules, so that most of it is tested without a model or a terminal:
  conversation.py   Conversation, ChatState, parse_command, apply_command, fit_context: pure state and commands
  model.py          ChatModel: the loaded model (render + reply), choose_model, load_chat_model
  loop.py           run_chat (the input/print loop), ReplyStream, chat_main (argparse namespace -> load -> loop)
"""


from rlora.chat.conversation import (
    HELP,
    ChatState,
    Command,
    ContextFull,
    Conversation,
    Outcome,
    Settings,
    apply_command,
    fit_context,
    parse_command,
    save_conversation,
    user_text,
)
from rlora.chat.loop import ReplyStream, chat_main, run_chat
from rlora.chat.model import (DEFAULT_MODEL, ChatModel, NoTools, Reply, chat_tools, check_base_matches, choose_model,
                              load_chat_model)

__all__ = [
    "DEFAULT_MODEL", "HELP", "ChatModel", "ChatState", "Command", "ContextFull", "Conversation", "NoTools", "Outcome",
    "Reply", "chat_tools",
    "ReplyStream", "Settings", "apply_command", "chat_main", "check_base_matches", "choose_model", "fit_context",
    "load_chat_model", "parse_command", "run_chat", "save_conversation", "user_text",
]
