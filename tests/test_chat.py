"""`rlora chat`: the conversation state and commands (pure), replies with the active adapter on one base, and
the whole program driven through a pseudo-terminal."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from test_policy_model import make_policy, perturb_adapter

from rlora.chat import (ChatState, Command, ContextFull, Conversation, NoTools, Settings, apply_command,
                        chat_tools, check_base_matches, fit_context, load_chat_model, parse_command, run_chat,
                        user_text)
from rlora.cli import main
from rlora.errors import UserError
from rlora.models.loading import save_adapter
from rlora.models.named_adapters import parse_named_adapters
from rlora.models.tiny import build_random_model

MAX_NEW = 8
PYTHON = str(Path(sys.executable))


def _state(**adapters) -> ChatState:
    return ChatState("m", dict(adapters), next(iter(adapters), None), Settings(), Conversation())


# ------------------------------------------------------------------------- pure state and commands ------------


def test_parse_command_and_user_text():
    assert parse_command("hello") is None and parse_command("  what is 2/3?") is None
    assert parse_command("/adapter  b ") == Command("adapter", "b")
    assert parse_command("/system You are   terse.") == Command("system", "You are   terse.")
    assert parse_command("/QUIT") == Command("quit")
    assert parse_command("//etc/passwd is a file") is None and user_text("//etc/passwd") == "/etc/passwd"


def test_parse_adapter_specs(adapters, tmp_path):
    """Named, or after the folder (its run folder for .../adapter; unusable characters made '_')."""
    a, b = adapters["a"], adapters["b"]
    run = tmp_path / "run.v2"
    run.mkdir()
    (run / "adapter").symlink_to(a)
    assert parse_named_adapters([f"x={a}", str(b) + "/", str(run / "adapter")]) == {
        "x": a, "b": str(b) + "/", "run_v2": str(run / "adapter")}
    with pytest.raises(UserError, match="given twice"):
        parse_named_adapters([f"x={a}", f"x={b}"])
    with pytest.raises(UserError, match="not usable"):
        parse_named_adapters([f"my.x={a}"])
    with pytest.raises(UserError, match="'/no/such/folder' not found"):
        parse_named_adapters(["y=/no/such/folder"])


def test_a_run_folder_as_adapter_names_the_adapter_inside(adapters, tmp_path):
    """`--adapter run1` (a run's output folder) says which folder to give, not only that run1 is no adapter."""
    run = tmp_path / "run1"
    run.mkdir()
    (run / "adapter").symlink_to(adapters["a"])
    with pytest.raises(UserError, match=f"is a run folder: give its adapter, --adapter {run / 'adapter'}$"):
        parse_named_adapters([str(run)])
    several = tmp_path / "polrun"
    (several / "policies" / "p1").mkdir(parents=True)
    (several / "policies" / "p1" / "adapter").symlink_to(adapters["b"])
    with pytest.raises(UserError, match=f"run of several policies: .* --adapter p1={several}/policies/p1/adapter$"):
        parse_named_adapters([str(several)])
    with pytest.raises(UserError, match="is not a PEFT adapter folder"):  # any other folder: as before
        parse_named_adapters([str(tmp_path / "polrun" / "policies")])


def test_conversation_messages_reset_and_drop():
    conv = Conversation(system="be brief")
    conv.add_user("u1")
    conv.add_reply("r1", "a", 0)
    conv.add_user("u2")
    assert conv.messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "u1"},
                               {"role": "assistant", "content": "r1"}, {"role": "user", "content": "u2"}]
    assert conv.drop_oldest() and conv.messages()[1:] == [{"role": "user", "content": "u2"}]
    assert not conv.drop_oldest()  # the newest user turn always stays
    assert len(conv.turns) == 3  # dropped from the context, not from the transcript
    conv.drop_last_user()
    assert [t["content"] for t in conv.turns] == ["u1", "r1"] and conv.start == 2
    conv.reset()
    assert conv.turns == [] and conv.start == 0 and conv.system == "be brief"


def test_fit_context_drops_oldest_exchanges():
    def render(messages):  # one token per character, like a (very) small tokenizer
        return [0] * sum(len(m["content"]) for m in messages)

    conv = Conversation()
    for i in range(3):
        conv.add_user(f"user {i}")  # 6 tokens
        conv.add_reply(f"reply {i}", None, i)  # 7 tokens
    conv.add_user("question")  # 8 tokens
    ids, dropped = fit_context(conv, render, limit=100)
    assert (len(ids), dropped) == (47, 0)
    ids, dropped = fit_context(conv, render, limit=25)
    assert (len(ids), dropped) == (21, 2) and conv.messages()[0]["content"] == "user 2"
    with pytest.raises(ContextFull):
        fit_context(conv, render, limit=7)


def test_commands_change_the_state(tmp_path):
    state = _state(a="/ad/a", b="/ad/b")
    listing = apply_command(state, Command("adapter")).text
    assert "* a  /ad/a" in listing and "  b  /ad/b" in listing and "  base" in listing
    assert apply_command(state, Command("adapter", "b")).text == "adapter b active" and state.active == "b"
    miss = apply_command(state, Command("adapter", "c"))
    assert miss.error and "no adapter 'c'" in miss.text and state.active == "b"
    apply_command(state, Command("base"))
    assert state.active is None and "* base" in apply_command(state, Command("adapter")).text
    apply_command(state, Command("system", "be brief"))
    assert state.conv.system == "be brief"
    apply_command(state, Command("system"))
    assert state.conv.system is None
    unknown = apply_command(state, Command("frobnicate"))
    assert unknown.error and unknown.text == "unknown command '/frobnicate': /help lists the commands"
    assert "/save FILE" in apply_command(state, Command("help")).text
    assert apply_command(state, Command("quit")).quit and apply_command(state, Command("exit")).quit
    state.conv.add_user("hi")
    apply_command(state, Command("reset"))
    assert state.conv.turns == []
    assert apply_command(state, Command("save")).error  # no FILE


def test_save_writes_the_conversation_atomically(tmp_path):
    state = _state(a="/ad/a")
    state.conv.system = "sys"
    state.conv.add_user("hello")
    state.conv.add_reply("hi there", "a", 0)
    target = tmp_path / "sub" / "conv.json"
    assert "saved 3 messages" in apply_command(state, Command("save", str(target))).text  # the system prompt too
    saved = json.loads(target.read_text())
    assert saved["model"] == "m" and saved["adapters"] == {"a": "/ad/a"} and saved["dropped_messages"] == 0
    assert saved["sampling"] == {"max_new_tokens": 256, "temperature": 0.7, "top_p": 1.0, "seed": 0, "greedy": False}
    assert saved["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"},
                                 {"role": "assistant", "content": "hi there", "adapter": "a", "seed": 0}]
    assert sorted(p.name for p in target.parent.iterdir()) == ["conv.json"]  # no temporary file left
    bad = apply_command(state, Command("save", str(tmp_path)))  # a folder: one-line error, no crash
    assert bad.error and "could not save" in bad.text


def test_save_counts_the_messages_the_file_holds(tmp_path):
    state = _state()
    state.conv.system = "sys"  # only a system prompt: the file holds one message, and says so
    target = tmp_path / "conv.json"
    assert apply_command(state, Command("save", str(target))).text == f"saved 1 message to {target}"
    assert len(json.loads(target.read_text())["messages"]) == 1


class ScriptedBot:
    """A ChatModel stand-in for the loop: replies with the active adapter's name and the turn count."""

    max_length = 100
    tokenizer = None  # the loop's ReplyStream decodes only tokens it is called with: this bot calls it with none
    tools = NoTools()

    def reply(self, state, on_token=None):
        from rlora.chat import Reply

        if state.conv.turns[-1]["content"] == "too long":
            raise ContextFull(500)
        return Reply(f"{state.active}-{len(state.conv.turns)}", "stop", 0)


def _reader(lines):
    """input() for run_chat: these lines, then end of input."""
    feed = iter(lines)

    def read(prompt):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    return read


def _drive(lines, state):
    out = Console(record=True, width=200, force_terminal=False)
    assert run_chat(ScriptedBot(), state, out, _reader(lines)) == 0
    return out.export_text()


def test_loop_commands_replies_and_end_of_input():
    state = _state(a="/ad/a", b="/ad/b")
    text = _drive(["hi", "/adapter b", "", "again", "/nope", "too long", "/base", "//slash"], state)
    assert [(t["content"], t.get("adapter")) for t in state.conv.turns] == [
        ("hi", None), ("a-1", "a"), ("again", None), ("b-3", "b"), ("/slash", None), ("None-5", None)]
    assert [t.get("seed") for t in state.conv.turns if t["role"] == "assistant"] == [0, 1, 2]
    assert "a> a-1\n" in text and "b> b-3\n" in text and "base> None-5\n" in text
    assert text.count("a> a-1") == 1  # each reply once (the bot does not stream: the loop prints it at the end)
    assert "unknown command '/nope'" in text and "message too long: 500 prompt tokens" in text
    state = _state()
    _drive(["hello", "/quit", "never read"], state)
    assert [t["content"] for t in state.conv.turns] == ["hello", "None-1"]


# ------------------------------------------------------------------------- the model ----------------------------


def _make_adapter(model_dir, folder, seed):
    _, _, model = make_policy(model_dir)
    perturb_adapter(model, scale=0.2, seed=seed)
    save_adapter(model, folder)
    return str(folder)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_adapters")
    return {"a": _make_adapter(tiny_model_dir, root / "a", seed=1), "b": _make_adapter(tiny_model_dir, root / "b", seed=2)}


def _reference(tiny_model_dir, adapters):
    """Greedy replies computed directly with transformers generate on the peft model (not rlora's sampler)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapters["a"], adapter_name="a")
    model.load_adapter(adapters["b"], adapter_name="b")
    model.eval()

    def reply(messages, adapter):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        kwargs = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
        with torch.no_grad():
            if adapter is None:
                with model.disable_adapter():
                    out = model.generate(input_ids=ids, **kwargs)
            else:
                model.set_adapter(adapter)
                out = model.generate(input_ids=ids, **kwargs)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    return reply


def test_replies_follow_the_active_adapter_and_long_history_is_cut(tiny_model_dir, adapters):
    bot = load_chat_model(tiny_model_dir, adapters, "float32", MAX_NEW)
    assert bot.generator.name == "builtin"
    reference = _reference(tiny_model_dir, adapters)
    state = ChatState(tiny_model_dir, adapters, "a", Settings(MAX_NEW, 0.0), Conversation())
    state.conv.add_user("Hello, how are you today?")
    replies = {}
    for name in ("a", "b", None):
        state.active = name
        replies[name] = bot.reply(state).text
        assert replies[name] == reference(state.conv.messages(), name)
    assert len(set(replies.values())) == 3, replies  # the adapters matter, so the equalities mean something
    base_weights = {k: v.clone() for k, v in bot.model.get_base_model().state_dict().items() if "lora" not in k}
    bot.max_length = len(bot.render(state.conv.messages())) + MAX_NEW + 4  # room for this turn only
    state.conv.add_reply(replies[None], None, 0)
    state.conv.add_user("What is 3 + 4?")
    reply = bot.reply(state)
    assert reply.dropped == 1 and state.conv.start == 2 and reply.text == reference(state.conv.messages(), None)
    after = bot.model.get_base_model().state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_weights.items())  # switching never wrote the base


def test_notice_for_an_adapter_recorded_for_another_base(tiny_model_dir, adapters):
    assert check_base_matches(adapters, tiny_model_dir) == []
    notices = check_base_matches({"a": adapters["a"]}, "/somewhere/else")
    assert notices == [f"adapter a was trained on '{tiny_model_dir}', not on '/somewhere/else'"]


def test_bad_input_is_one_line_exit_2(tiny_model_dir, adapters, tmp_path, capsys):
    other = build_random_model(tmp_path / "other", family="qwen2", hidden=96, seed=2)
    other_adapter = _make_adapter(str(other), tmp_path / "other_adapter", seed=3)
    not_lora = tmp_path / "ia3"
    not_lora.mkdir()
    (not_lora / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    base = ["chat", "--model", tiny_model_dir]
    cases = [
        (base + ["--adapter", f"a={tmp_path / 'missing'}"], "missing' not found"),
        (["chat", "--adapter", f"a={adapters['a']}", "--adapter", f"o={other_adapter}"], "does not fit model"),
        (base + ["--adapter", other_adapter], "does not fit model"),
        (base + ["--adapter", adapters["a"], "--adapter", adapters["a"]], "given twice"),
        (base + ["--temperature", "-1"], "--temperature must be >= 0"),
        (base + ["--adapter", str(not_lora)], "is a IA3 adapter"),
        (base + ["--max-new-tokens", "5000"], "leaves no room for the prompt"),
    ]
    for args, message in cases:
        capsys.readouterr()
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------- through a pseudo-terminal -----------


def test_chat_through_a_pseudo_terminal(tiny_model_dir, adapters, tmp_path):
    pexpect = pytest.importorskip("pexpect")
    saved = tmp_path / "conversation.json"
    args = ["-m", "rlora", "chat", "--model", tiny_model_dir, "--adapter", f"a={adapters['a']}", "--adapter",
            f"b={adapters['b']}", "--max-new-tokens", str(MAX_NEW), "--temperature", "0"]
    child = pexpect.spawn(PYTHON, args, encoding="utf-8", timeout=180, dimensions=(40, 200),
                          env={**os.environ, "TERM": "xterm", "TOKENIZERS_PARALLELISM": "false"})
    try:
        child.expect("you> ")
        for line, wait_for in [("Hello, how are you today?", "a> "), ("/adapter b", "adapter b active"),
                               ("/adapter", r"\* b"), ("What is 3 + 4?", "b> "), ("/wat", "unknown command"),
                               ("/base", "adapter off"), ("The quick brown fox", "base> "),
                               (f"/save {saved}", "saved 6 messages")]:
            child.sendline(line)
            child.expect(wait_for)
            child.expect("you> ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    conversation = json.loads(saved.read_text())
    messages = conversation["messages"]
    assert conversation["model"] == tiny_model_dir and conversation["adapters"] == adapters
    assert conversation["sampling"]["greedy"] and conversation["sampling"]["max_new_tokens"] == MAX_NEW
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3
    assert [m["content"] for m in messages[::2]] == ["Hello, how are you today?", "What is 3 + 4?", "The quick brown fox"]
    assert [m["adapter"] for m in messages[1::2]] == ["a", "b", None]
    reference = _reference(tiny_model_dir, adapters)
    for i in range(1, len(messages), 2):
        history = [{"role": m["role"], "content": m["content"]} for m in messages[:i]]
        want = {name: reference(history, name) for name in ("a", "b", None)}
        assert messages[i]["content"] == want[messages[i]["adapter"]], (i, want)
        # a chat that ignored the switch would have answered with another adapter: those replies differ
        assert list(want.values()).count(want[messages[i]["adapter"]]) == 1, (i, want)


def test_reply_stream_shows_whole_characters_and_the_stripped_reply(tiny_model_dir):
    """Fed one token at a time (a byte-level BPE, where a token can end inside a character), the pieces written
    join to exactly the stripped reply: no replacement character, no trailing whitespace, no special token."""
    from transformers import AutoTokenizer

    from rlora.chat import ReplyStream

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "  Héllo wörld ✓ — 3 + 4 = 7\n\n"
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert any("\ufffd" in tokenizer.decode(tokens[:i]) for i in range(1, len(tokens)))  # splits inside a character
    pieces = []
    stream = ReplyStream(tokenizer, pieces.append)
    for token in tokens:
        stream(token)
    stream.finish(tokenizer.decode(tokens, skip_special_tokens=True))
    assert "".join(pieces) == text.strip() and len(pieces) > 3
    assert not any("\ufffd" in p for p in pieces) and not pieces[-1].endswith((" ", "\n"))


def test_chat_streams_the_reply_it_would_print_whole(tiny_model_dir, adapters, monkeypatch):
    """The loop with the real sampler: the reply appears in pieces while it is generated, and the transcript is
    the one printed without streaming (the reply of transformers generate, greedy)."""
    import rlora.chat.loop as chat  # where the loop looks ReplyStream up

    writes = []

    class Counting(chat.ReplyStream):
        def _show(self, text):
            before = self.shown
            super()._show(text)
            if self.shown != before:
                writes.append(self.shown)

    monkeypatch.setattr(chat, "ReplyStream", Counting)
    bot = load_chat_model(tiny_model_dir, adapters, "float32", MAX_NEW)
    state = ChatState(tiny_model_dir, adapters, "a", Settings(MAX_NEW, 0.0), Conversation())
    out = Console(record=True, width=500, force_terminal=False)
    assert run_chat(bot, state, out, _reader(["Hello, how are you today?"])) == 0
    expected = _reference(tiny_model_dir, adapters)([{"role": "user", "content": "Hello, how are you today?"}], "a")
    text = out.export_text()
    assert f"a> {expected.strip()}\n" in text and text.count("a> ") == 1  # streamed once, not printed whole again
    assert len(writes) > 1 and writes[-1] == expected.strip()
    # a message too long to send: the notice alone, no reply label
    bot.max_length = MAX_NEW + 4
    out = Console(record=True, width=500, force_terminal=False)
    assert run_chat(bot, state, out, _reader(["a long message " * 20])) == 0
    text = out.export_text()
    assert "message too long" in text and "a> " not in text.replace("a long", "")



# ------------------------------------------------------------------------- tools ------------------------------


def test_tool_turns_stay_with_their_exchange_when_the_context_is_cut():
    conv = Conversation()
    for text in ("u1", "call", "5", "r1", "u2"):
        if text.startswith("u"):
            conv.add_user(text)
        elif text == "5":
            conv.add_tool(text)
        else:
            conv.add_reply(text, None, 0)
    assert [m["role"] for m in conv.messages()] == ["user", "assistant", "tool", "assistant", "user"]
    assert conv.drop_oldest() and conv.messages() == [{"role": "user", "content": "u2"}]
    assert not conv.drop_oldest()


class FirstReplyCalls:
    """The calculator; the (random) model's first reply is taken as a call of "2 + 3", later ones as they are."""

    def __init__(self):
        from rlora.envs.calculator import calculator
        from rlora.envs.tools import ToolEnvironment

        self.inner = ToolEnvironment([calculator])
        self.schemas, self.fmt, self.replies = self.inner.schemas, self.inner.fmt, 0

    def step(self, text):
        self.replies += 1
        first = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
        return self.inner.step(first if self.replies == 1 else text.replace("<tool_call>", ""))


def test_a_reply_that_calls_a_tool_gets_its_result_and_is_answered_again(tiny_model_dir, adapters):
    bot = load_chat_model(tiny_model_dir, adapters, "float32", MAX_NEW, tools=FirstReplyCalls())
    state = ChatState(tiny_model_dir, adapters, "a", Settings(max_new_tokens=MAX_NEW), Conversation())
    out = Console(record=True, width=200, force_terminal=False)
    assert run_chat(bot, state, out, _reader(["What is 2 + 3?"])) == 0
    assert [t["role"] for t in state.conv.turns] == ["user", "assistant", "tool", "assistant"]
    assert state.conv.turns[2]["content"] == "5" and "tool> 5" in out.export_text()
    prompt = bot.tokenizer.decode(bot.render(state.conv.messages()))  # what the second reply was sampled from
    assert prompt.startswith("<|im_start|>system\nTools:\n") and "<|im_start|>tool\n5<|im_end|>" in prompt
    state.tools = tuple(bot.tools.schemas)  # as `rlora chat --tool` sets it
    saved = state.to_json()  # /save: the tools the model was shown, with the tool turns
    assert [t["function"]["name"] for t in saved["tools"]] == ["calculator"] and saved["messages"][2]["role"] == "tool"
    assert "tools" not in _state().to_json()


def test_chat_tools_are_checked_before_the_model_loads(tmp_path, capsys):
    assert isinstance(chat_tools([]), NoTools) and chat_tools(["calculator"]).tools.keys() == {"calculator"}
    with pytest.raises(UserError, match="no docstring"):
        chat_tools(["envs_for_tests.no_docstring"])
    assert main(["chat", "--model", str(tmp_path / "missing"), "--tool", "envs_for_tests.no_docstring"]) == 2
    assert "tool 'no_docstring' has no docstring" in capsys.readouterr().err


def test_a_sequence_routed_molora_routes_every_reply_by_the_first_prompt(tiny_model_dir, tmp_path):
    """rlora chat with a MoLoRA folder (sequence router): every reply is sampled with the routing of the
    conversation's first prompt (system prompt and first user turn), as training routes a chat row (rlora sft) and
    an episode (rlora train); routed by the whole conversation, the second reply would differ."""
    from test_molora import load_base, randomise
    from rlora.chat.model import activated
    from rlora.models import molora as ml
    from rlora.models.molora import MoLoRAConfig
    from rlora.types import SamplingParams

    mixture = load_base(tiny_model_dir)
    ml.attach_molora(mixture, MoLoRAConfig(num_experts=3, rank=4, router="sequence",
                                           target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
    randomise(mixture, b_std=3.0, router_std=2.0)  # experts that move the logits: the routing changes tokens
    ml.save_molora(mixture, tmp_path / "mix")
    adapters = {"mix": str(tmp_path / "mix")}
    bot = load_chat_model(tiny_model_dir, adapters, "float32", MAX_NEW)
    state = ChatState(tiny_model_dir, adapters, "mix", Settings(MAX_NEW, 1.0), Conversation(system="Be brief."))
    state.conv.add_user("What is 2 + 2?")
    first = bot.reply(state)
    state.conv.add_reply(first.text, "mix", state.settings.seed)
    state.replies += 1
    state.conv.add_user("And what is 30 + 12, my friend?")
    second = bot.reply(state)
    ids = bot.render(state.conv.messages())
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=1.0)
    routed = {}
    with activated(bot.model, "mix") as model:
        for name, route_by in (("first prompt", [bot.render(state.conv.first_prompt_messages())]), ("whole", None)):
            routed[name] = bot.generator.sample(model, [ids], 1, params, seed=state.settings.seed + state.replies,
                                                route_by=route_by).completions[0]
    assert second.text == routed["first prompt"] != routed["whole"]
    assert state.conv.first_prompt_messages() == state.conv.messages()[:2]
