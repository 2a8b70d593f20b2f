"""Episodes of several turns (envs/episodes.py) on a tiny random model: token in, token out; the loss mask covers
exactly the policy's tokens; the sampler's log-probs equal the trainer's; faults end an episode, not the run."""

import pytest
import torch
from envs_for_tests import Faulty, Scripted, eos_prone_model

from rlora.config import LoraConfig, ModelConfig
from rlora.envs.episodes import EpisodeLimits, EpisodeRunner
from rlora.envs.render import EpisodeRenderer
from rlora.envs.tools import CallFormat
from rlora.models.loading import attach_lora, load_base_model, load_tokenizer
from rlora.models.logprobs import completion_logprobs
from rlora.models.tiny import build_random_model
from rlora.rollout.engine import BuiltinGenerator
from rlora.types import SamplingParams

ROWS = [{"prompt": "What is 3 + 4?"}, {"prompt": "Hello, how are you today?"}]
# A random model rarely samples EOS: its turns end at a stop string (a space, which most tokens of the tiny BPE
# hold), so that some turns end early and reach the environment and others run to their token budget
TURN = SamplingParams(8, stop=(" ",))


def _policy(folder, scale: float = 0.3):
    tokenizer, tok = load_tokenizer(folder)
    model = attach_lora(load_base_model(ModelConfig(path=folder), folder), LoraConfig(rank=4, alpha=8))
    with torch.no_grad():  # a random adapter: the policy differs from the base
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return tokenizer, tok, model


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return _policy(str(build_random_model(tmp_path_factory.mktemp("episodes") / "model", seed=0)))


@pytest.fixture(scope="module")
def eos_policy(tmp_path_factory):
    """A model whose turns end by EOS in some rows (the path a trained model takes)."""
    return _policy(str(eos_prone_model(tmp_path_factory.mktemp("eos") / "model")), scale=0.05)


class Recording:
    """The real engine, keeping what each call sampled (to compare the episodes' tokens with). continued: offer
    the engine's sample_continued (a new turn runs only its new tokens after the row's cache); else only sample
    (a new turn runs the whole history)."""

    def __init__(self, engine, continued: bool):
        self.engine, self.calls = engine, []
        if continued:
            self.sample_continued = self._continued

    def sample(self, model, prompts, n, params, seed, keys=None, policies=None, route_by=None):
        rollout = self.engine.sample(model, prompts, n, params, seed, keys=keys, policies=policies, route_by=route_by)
        self.calls.append((prompts, n, rollout))
        return rollout

    def _continued(self, model, prompts, n, params, seed, keys=None, policies=None, past=None, route_by=None):
        rollout, caches = self.engine.sample_continued(model, prompts, n, params, seed, keys=keys, policies=policies,
                                                       past=past, route_by=route_by)
        self.calls.append((prompts, n, rollout))
        return rollout, caches


def run(policy, envs, limits=EpisodeLimits(3, 64, 5.0), G=4, merge=True, continued=True, turn=TURN):
    tokenizer, tok, model = policy
    generator = Recording(BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, merge=merge), continued)
    runner = EpisodeRunner(generator, EpisodeRenderer(tokenizer, [], CallFormat()), tok.eos_ids, tok.pad_id, limits)
    rows = ROWS[:len(envs) // G]
    made = iter(envs)
    batch = runner.run(model, lambda: next(made), rows, G, [turn] * len(rows), [5] * 2, [0, 1])
    return batch, generator


def runs_of(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each maximal run of equal values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


# turns ended by a stop string (the template's end of turn is then the environment's first tokens) or by EOS
ENDINGS = {"stop": ("policy", TURN), "eos": ("eos_policy", SamplingParams(8))}


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("continued", [True, False])
def test_policy_tokens_are_exactly_the_sampled_ones_and_the_rest_is_the_template(request, continued, ending):
    fixture, turn = ENDINGS[ending]
    policy = request.getfixturevalue(fixture)
    tokenizer, tok, model = policy
    batch, generator = run(policy, [Scripted(turns=3) for _ in range(8)], continued=continued, turn=turn)
    ends = {ep.tokens[i] for ep in batch.episodes for i, m in enumerate(ep.policy_mask)
            if m and (i + 1 == len(ep.policy_mask) or not ep.policy_mask[i + 1])}
    assert (tok.eos_ids[0] in ends) == (ending == "eos")  # some turn ended by EOS exactly when meant to
    rollout = batch.rollout
    assert max(ep.turns for ep in batch.episodes) >= 2, "no episode got a second turn: the test would prove little"
    whole_rows = 0
    # what each episode's turns sampled, from the engine's own outputs, call by call (turn 0: G rows per prompt)
    sampled = [[] for _ in batch.episodes]
    running = list(range(len(batch.episodes)))
    for _prompts, _n, out in generator.calls:
        for r, b in enumerate(running):
            sampled[b].append(out.completion_ids_BTc[r, :int(out.completion_mask_BTc[r].sum())].tolist())
        running = [b for b in running if len(sampled[b]) < batch.episodes[b].turns]
    for b, ep in enumerate(batch.episodes):
        length = int(rollout.completion_mask_BTc[b].sum())
        ids = rollout.completion_ids_BTc[b, :length].tolist()
        mask = rollout.policy_mask_BTc[b, :length].tolist()
        policy_runs = [ids[start:end] for value, start, end in runs_of(mask) if value == 1]
        assert policy_runs == sampled[b][:ep.turns], b  # token by token, turn by turn
        assert rollout.trained_mask_BTc[b].sum() == sum(map(len, sampled[b]))
        # each reply is the text of its policy tokens; between replies, the template's text for ChatML written out by
        # hand: the end of the turn (its newline only, where the turn ended with the EOS <|im_end|>), the
        # environment's message, the next assistant header
        replies = [m["content"] for m in ep.messages if m["role"] == "assistant"]
        assert [tokenizer.decode(turn, skip_special_tokens=True) for turn in policy_runs] == replies[:len(policy_runs)]
        env_runs = [ids[start:end] for value, start, end in runs_of(mask) if value == 0]
        for k, (env_ids, before) in enumerate(zip(env_runs, policy_runs), start=1):
            end_of_turn = "\n" if before[-1] == tok.eos_ids[0] else "<|im_end|>\n"
            expected = f"{end_of_turn}<|im_start|>user\nok {k}<|im_end|>\n<|im_start|>assistant\n"
            assert tokenizer.decode(env_ids, skip_special_tokens=False) == expected, (b, k)
        # and where every reply's tokens (but a final EOS) decode to its text as is (no special token inside that the
        # reply's text drops), the whole row is the template's rendering of the conversation
        plain = all(tokenizer.decode(turn[:-1] if turn[-1] in tok.eos_ids else turn, skip_special_tokens=False) == reply
                    for turn, reply in zip(policy_runs, replies))
        whole_rows += plain
        if plain:
            text = tokenizer.decode(rollout.prompt_ids_BTp[b][rollout.prompt_mask_BTp[b].bool()].tolist() + ids,
                                    skip_special_tokens=False)
            rendered = tokenizer.apply_chat_template(ep.messages, tokenize=False)
            assert rendered.startswith(text) and len(rendered) - len(text) <= len("<|im_end|>\n"), b
        assert (rollout.sampling_logp_BTc[b][rollout.policy_mask_BTc[b] == 0] == 0).all()
        assert ep.status in ("done", "truncated") and rollout.finish_reasons[b] == ("stop" if ep.status == "done" else "length")
        if ep.status == "done":  # the environment ended it at its third reply: 1 + 1 + 3
            assert ep.turns == 3 and batch.env_rewards_B[b] == 5
        else:  # a turn ran to its budget: the environment saw the turns before it
            assert batch.env_rewards_B[b] == ep.turns - 1
    assert whole_rows >= 4
    assert "truncated" in {ep.status for ep in batch.episodes} and ("done" in {ep.status for ep in batch.episodes}) == (ending == "stop")


@pytest.mark.parametrize("merge, continued, ending", [(True, True, "stop"), (False, True, "stop"), (True, False, "stop"),
                                                     (True, True, "eos")])
def test_sampler_logprobs_equal_the_trainers_over_every_turn(request, merge, continued, ending):
    fixture, turn = ENDINGS[ending]
    policy = request.getfixturevalue(fixture)
    tokenizer, tok, model = policy
    batch, _ = run(policy, [Scripted(turns=3) for _ in range(8)], merge=merge, continued=continued, turn=turn)
    rollout = batch.rollout
    model.eval()
    with torch.no_grad():
        trainer_BT, _ = completion_logprobs(model, rollout.select(slice(None)))
    mask = rollout.trained_mask_BTc.bool()
    gap = (trainer_BT[mask] - rollout.sampling_logp_BTc[mask]).abs()
    assert mask.sum() > 40 and gap.max() < 1e-4, (int(mask.sum()), float(gap.max()))


def test_a_later_turn_runs_only_its_new_tokens_after_the_cache_or_the_whole_history_without_it(policy):
    for continued in (True, False):
        batch, generator = run(policy, [Scripted(turns=3) for _ in range(8)], continued=continued)
        (_, n0, _), (prompts1, n1, _) = generator.calls[:2]
        assert (n0, n1) == (4, 1)
        continuing = [b for b, ep in enumerate(batch.episodes) if ep.turns >= 2]
        for prompt, b in zip(prompts1, continuing):
            ep = batch.episodes[b]
            first_turn_end = next(i for i, m in enumerate(ep.policy_mask) if m == 0)
            env_end = first_turn_end + next(i for i, m in enumerate(ep.policy_mask[first_turn_end:]) if m == 1)
            history = ep.prompt_ids + ep.tokens[:env_end]
            # the cache holds all but turn 0's last token, which was sampled and never fed back
            assert prompt == (ep.tokens[first_turn_end - 1:env_end] if continued else history)


def test_continuing_from_the_cache_samples_what_running_the_history_again_samples(policy):
    """Appending a turn to the key/value cache gives the next-token distributions of a full prefill of the history:
    the same tokens in every turn and log-probs equal to float32 resolution."""
    cached, _ = run(policy, [Scripted(turns=3) for _ in range(8)], continued=True)
    again, _ = run(policy, [Scripted(turns=3) for _ in range(8)], continued=False)
    assert max(ep.turns for ep in cached.episodes) >= 2
    assert [ep.tokens for ep in cached.episodes] == [ep.tokens for ep in again.episodes]
    mask = cached.rollout.trained_mask_BTc.bool()
    gap = (cached.rollout.sampling_logp_BTc[mask] - again.rollout.sampling_logp_BTc[mask]).abs()
    assert gap.max() < 1e-5, float(gap.max())


@pytest.mark.parametrize("ending", ENDINGS)
def test_generate_samples_the_engines_episodes(request, ending):
    """Episodes sampled with transformers generate (rollout/generate_draw.py: the engine's draw; every turn runs the
    whole history again) are the engine's episodes continued from its caches: the same tokens in every turn, the
    sampler's log-probs within 1e-5."""
    from rlora.rollout.generator import HFGenerator

    fixture, turn = ENDINGS[ending]
    policy = request.getfixturevalue(fixture)
    engine, _ = run(policy, [Scripted(turns=3) for _ in range(8)], continued=True, turn=turn)
    tokenizer, tok, model = policy
    runner = EpisodeRunner(HFGenerator(tokenizer, tok.eos_ids, tok.pad_id), EpisodeRenderer(tokenizer, [], CallFormat()),
                           tok.eos_ids, tok.pad_id, EpisodeLimits(3, 64, 5.0))
    made = iter([Scripted(turns=3) for _ in range(8)])
    generate = runner.run(model, lambda: next(made), ROWS[:2], 4, [turn] * 2, [5] * 2, [0, 1])
    assert max(ep.turns for ep in engine.episodes) >= 2
    assert [ep.tokens for ep in generate.episodes] == [ep.tokens for ep in engine.episodes]
    mask = engine.rollout.trained_mask_BTc.bool()
    gap = (generate.rollout.sampling_logp_BTc.cpu()[mask] - engine.rollout.sampling_logp_BTc.cpu()[mask]).abs()
    assert gap.max() < 1e-5, float(gap.max())


def test_turn_and_token_limits_truncate(policy):
    batch, _ = run(policy, [Scripted(turns=10) for _ in range(8)], limits=EpisodeLimits(2, 64, 5.0))
    assert all(ep.turns <= 2 for ep in batch.episodes)
    assert all(ep.status == "truncated" for ep in batch.episodes)
    assert set(batch.rollout.finish_reasons) == {"length"}
    batch, _ = run(policy, [Scripted(turns=10) for _ in range(8)], limits=EpisodeLimits(10, 30, 5.0))
    lengths = batch.rollout.completion_mask_BTc.sum(-1)
    assert int(lengths.max()) <= 30 and all(ep.status == "truncated" for ep in batch.episodes)


def test_faulty_environments_fail_their_episode_only(eos_policy):
    """Turns that end by EOS (or a stop string) reach step(): each fault mode fails its episodes with its message,
    the healthy prompt's episodes do not fail, failed rows train on nothing."""
    tokenizer, tok, model = eos_policy
    rows = [{"prompt": "raise"}, {"prompt": "hang"}, {"prompt": "bad"}, {"prompt": "reset"}, {"prompt": "factory"},
            {"prompt": "What is 3 + 4?"}]
    G = 4
    generator = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    runner = EpisodeRunner(generator, EpisodeRenderer(tokenizer, [], CallFormat()), tok.eos_ids, tok.pad_id,
                           EpisodeLimits(2, 64, 0.5))
    made = iter([Faulty(turns=2) for _ in range(4 * G)] + [None] * G + [Faulty(turns=2) for _ in range(G)])

    def make():
        env = next(made)
        if env is None:
            raise RuntimeError("no environment today")
        return env

    batch = runner.run(model, make, rows, G, [TURN] * len(rows), [0] * len(rows), list(range(len(rows))))
    groups = [batch.episodes[i * G:(i + 1) * G] for i in range(len(rows))]
    for group, message in zip(groups[:3], ["broken environment", "did not return within 0.5 s", "StepResult"]):
        # a turn cut at its budget never reaches step(): those end truncated; the rest fail with the message
        assert {ep.status for ep in group} <= {"failed", "truncated"}
        failed = [ep for ep in group if ep.status == "failed"]
        assert failed and all(message in ep.error for ep in failed), (message, [ep.error for ep in group])
    assert all(ep.status == "failed" and "cannot reset" in ep.error for ep in groups[3])
    assert all(ep.status == "failed" and "no environment today" in ep.error for ep in groups[4])
    assert not any(ep.status == "failed" for ep in groups[5])
    assert batch.failed_B.tolist() == [ep.status == "failed" for ep in batch.episodes]
    assert torch.isnan(batch.env_rewards_B[batch.failed_B]).all()
    assert (batch.rollout.trained_mask_BTc[3 * G:5 * G] == 0).all()  # failed before sampling: nothing to train on


def test_a_tool_result_is_rendered_as_a_tool_message_between_the_turns(policy):
    from envs_for_tests import AlwaysCalls

    tokenizer, tok, model = policy
    renderer = EpisodeRenderer(tokenizer, AlwaysCalls().schemas, CallFormat())
    runner = EpisodeRunner(BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id), renderer, tok.eos_ids, tok.pad_id,
                           EpisodeLimits(2, 96, 5.0))
    batch = runner.run(model, AlwaysCalls, ROWS, 4, [TURN] * 2, [5, 5], [0, 1])
    called = [ep for ep in batch.episodes if ep.counters.get("tool_calls")]
    assert called, "no first turn reached the environment"
    for ep in called:
        assert [m["role"] for m in ep.messages[:4]] == ["user", "assistant", "tool", "assistant"]
        assert ep.messages[2]["content"] == "5"
        env_ids = [t for t, m in zip(ep.tokens, ep.policy_mask) if m == 0]
        assert tokenizer.decode(env_ids).endswith("<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
        assert ep.counters == {"tool_calls": 1, "tool_errors": 0}
    prompt = tokenizer.decode(batch.episodes[0].prompt_ids)
    assert prompt.startswith("<|im_start|>system\nTools:\n") and '"name": "calculator"' in prompt
