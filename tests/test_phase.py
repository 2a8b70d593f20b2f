"""Phase-aware sampling: the thinking-span state machine on hand-written tokens, the built-in engine end to
end (per-token temperatures equal a naive reference, sampler log-probs equal the trainer's), the refusals
(transformers generate, config), and an entropy that carries gradient (chunked == full path)."""

import pytest
import torch
from test_policy_model import make_policy, perturb_adapter, sample, vary_lengths

from rlora.config import LoraConfig, ModelConfig, RolloutConfig, load_config
from rlora.errors import UserError
from rlora.models.loading import attach_lora, load_base_model, load_tokenizer, trainable_parameters
from rlora.models.logprobs import completion_logprobs
from rlora.models.tiny import build_random_model, build_tokenizer
from rlora.rollout.backends import build_generator
from rlora.rollout.engine import BuiltinGenerator
from rlora.rollout.generator import HFGenerator
from rlora.rollout.phase import ThinkTracker
from rlora.types import SamplingParams, ThinkPhase

# ---- the state machine, on a hand-written vocabulary -----------------------------------------------------

VOCAB = ["Hi", "<think>", "</think>", "<th", "ink>", "</", "think", ">", " x", "<think>a</think>"]


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def drawn_inside(tokens: list[int], phase: ThinkPhase) -> list[bool]:
    """Whether each token was drawn inside the span, as the engine asks the tracker token by token."""
    tracker, out = ThinkTracker(decode, [phase]), []
    for t in range(len(tokens)):
        out.append(tracker.inside[0])
        tracker.update(0, tokens[:t + 1])
    return out


F, T = False, True


@pytest.mark.parametrize("tokens, starts_inside, want", [
    ([0, 1, 8, 8, 2, 8], F, [F, F, T, T, T, F]),  # </think> itself is drawn inside, the next token outside
    ([3, 4, 8, 5, 6, 7, 8], F, [F, F, T, T, T, T, F]),  # both markers split over several tokens
    ([8, 8, 2, 8, 8], T, [T, T, T, F, F]),  # the prompt opened the span
    ([1, 8, 8, 2, 8, 8, 8], F, [F, T, T, T, F, F, F]),  # the old <think> (still in the tail) does not re-enter
    ([9, 8, 2, 8], F, [F, T, T, F]),  # text of the switching token after its marker does not count
    ([8, 2, 8, 1, 2, 1, 8], F, [F, F, F, F, T, F, T]),  # </think> outside is nothing; enter and leave again
])
def test_tracker_switches_on_the_right_token(tokens, starts_inside, want):
    assert drawn_inside(tokens, ThinkPhase(starts_inside=starts_inside)) == want


def test_tracker_rows_are_independent_and_rows_without_a_phase_never_switch():
    tracker = ThinkTracker(decode, [None, ThinkPhase(), ThinkPhase(start="Hi", end=" x")])
    assert tracker.update(0, [1]) is False and tracker.update(1, [1]) is True and tracker.update(2, [1]) is False
    assert tracker.update(2, [1, 0]) is True and tracker.update(2, [1, 0, 8]) is False and tracker.inside == [F, T, F]


def reference_inside(decode_text, tokens: list[int], phase: ThinkPhase) -> list[bool]:
    """The naive reference: decode every prefix in full; a marker counts once it appears in the text
    after the offset of the last switch."""
    texts = [decode_text(tokens[:i]) for i in range(len(tokens) + 1)]
    inside, cut, out = phase.starts_inside, 0, []
    for i in range(len(tokens)):
        out.append(inside)
        if (phase.end if inside else phase.start) in texts[i + 1][cut:]:
            inside, cut = not inside, len(texts[i + 1])
    return out


def test_reference_agrees_with_the_tracker_on_the_hand_written_cases():
    for tokens in ([0, 1, 8, 8, 2, 8], [3, 4, 8, 5, 6, 7, 8], [1, 8, 8, 2, 8, 8, 8], [8, 2, 8, 1, 2, 1, 8]):
        assert reference_inside(decode, tokens, ThinkPhase()) == drawn_inside(tokens, ThinkPhase())


# ---- the engine end to end ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def think_model_dir(tmp_path_factory):
    """The tiny random Llama (untied head) with <think> and </think> as single tokens."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    return str(build_random_model(tmp_path_factory.mktemp("think") / "model", tie=False, seed=0, tokenizer=tokenizer))


def think_policy(model_dir):
    """A random model draws each token with p ~ 1/vocab, so spans would almost never open. Make the markers
    likely in every context: one hidden coordinate is 1 in every embedding, so the final normalised state
    is dominated by it, and the markers' output rows read it (+2.5 x ~8 on their logits)."""
    tokenizer, tok = load_tokenizer(model_dir)
    base = load_base_model(ModelConfig(path=model_dir), model_dir)
    markers = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    with torch.no_grad():
        base.get_input_embeddings().weight[:, 0] = 1.0
        base.get_output_embeddings().weight[markers, 0] = 2.5
    torch.manual_seed(2)  # lora_A's initialisation: the same model whichever test builds it first (19 of 32 rows then
    # open and close a span in think_rollout)
    model = attach_lora(base, LoraConfig(rank=4, alpha=8))
    perturb_adapter(model, scale=0.3, seed=1)
    return tokenizer, tok, model


THINK = ThinkPhase(temperature=0.6, top_p=0.9)
TEXTS = ["What", "What is 3 + 4? The answer", "Hello, how are you today?", "0 1 2"]


SETTINGS = [SamplingParams(max_new_tokens=24, temperature=1.3, top_p=0.95, think=THINK),
            SamplingParams(max_new_tokens=20, temperature=1.1, think=ThinkPhase(temperature=0.8, starts_inside=True)),
            SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95),  # no think: its own settings only
            SamplingParams(max_new_tokens=24, temperature=1.3, top_p=0.95, think=THINK)]


@pytest.fixture(scope="module", params=["builtin", "hf"])
def think_rollout(think_model_dir, request):
    """The built-in engine's rollout, and generate's (rollout/generate_draw.py: each token drawn as the engine draws
    it, think phases included)."""
    tokenizer, tok, model = think_policy(think_model_dir)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    # max_rows=8 / batch_size=16: calls of one or two prompts, so calls with and without think rows are put together
    sampler = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, max_rows=8) if request.param == "builtin" else \
        HFGenerator(tokenizer, tok.eos_ids, tok.pad_id, batch_size=16)
    rollout = sampler.sample(model, prompts, 8, SETTINGS, seed=0)
    return tokenizer, model, SETTINGS, rollout


def test_generate_draws_the_engines_tokens_at_the_engines_temperatures(think_model_dir):
    """The same prompts, settings and seed through both samplers: the same tokens, each at the same temperature,
    with the same log-probs (to float32 rounding: the two forwards differ)."""
    tokenizer, tok, model = think_policy(think_model_dir)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(model, prompts, 8, SETTINGS, seed=3)
    generate = HFGenerator(tokenizer, tok.eos_ids, tok.pad_id, batch_size=12).sample(model, prompts, 8, SETTINGS, seed=3)
    assert [tokens_of(generate, r) for r in range(32)] == [tokens_of(engine, r) for r in range(32)]
    assert generate.finish_reasons == engine.finish_reasons
    width = engine.completion_ids_BTc.shape[1]
    assert generate.completion_ids_BTc.shape[1] == width
    assert torch.equal(generate.temperature_BTc, engine.temperature_BTc.cpu())
    assert (generate.sampling_logp_BTc - engine.sampling_logp_BTc.cpu()).abs().max() < 1e-5


def tokens_of(rollout, row):
    return rollout.completion_ids_BTc[row][rollout.completion_mask_BTc[row].bool()].tolist()


def test_token_temperatures_follow_the_spans(think_rollout):
    tokenizer, _, settings, rollout = think_rollout
    text = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    assert rollout.temperature_BTc is not None and rollout.temperature_BTc.dtype == torch.float32
    entered_and_left = 0
    for row in range(rollout.num_completions):
        params, tokens = settings[row // 8], tokens_of(rollout, row)
        inside = reference_inside(text, tokens, params.think) if params.think else [False] * len(tokens)
        want = [params.think.temperature if i else params.temperature for i in inside]
        assert rollout.temperature_BTc[row, :len(tokens)].tolist() == pytest.approx(want), row
        assert (rollout.temperature_BTc[row, len(tokens):] == 0).all()
        entered = [i for i in range(1, len(inside)) if inside[i] and not inside[i - 1]]
        entered_and_left += bool(entered) and not all(inside[entered[0]:])
    assert entered_and_left >= 4, "too few rows opened and closed a span: the test would prove little"
    assert rollout.temperature_B.tolist() == pytest.approx([1.3] * 8 + [1.1] * 8 + [0.9] * 8 + [1.3] * 8)


def test_sampler_logprobs_equal_the_trainers(think_rollout):
    _, model, _, rollout = think_rollout
    model.eval()
    mask = rollout.completion_mask_BTc.bool()
    batch = rollout.select(slice(None))
    with torch.no_grad():
        for chunk in (256, 0):
            trainer, _ = completion_logprobs(model, batch, chunk_tokens=chunk)
            gap = (trainer[mask] - rollout.sampling_logp_BTc[mask]).abs()
            assert gap.mean() < 1e-4 and gap.max() < 1e-3, (chunk, gap.mean(), gap.max())
        batch.temperature_BTc = None  # with the row temperatures only, the trainer would be far off
        wrong, _ = completion_logprobs(model, batch)
    assert (wrong[mask] - rollout.sampling_logp_BTc[mask]).abs().max() > 0.1


def test_episodes_carry_each_turns_token_temperatures(think_model_dir):
    """Three-turn episodes (envs_for_tests.Scripted) sampled with a thinking phase: the episode's rollout carries
    every policy token's temperature, turn after turn (the environment's tokens take the row's), so the trainer's
    log-probs equal the sampler's over all turns; with the row temperatures only they would be far off."""
    from envs_for_tests import Scripted

    from rlora.envs.episodes import EpisodeLimits, EpisodeRunner
    from rlora.envs.render import EpisodeRenderer
    from rlora.envs.tools import CallFormat

    tokenizer, tok, model = think_policy(think_model_dir)
    runner = EpisodeRunner(BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id), EpisodeRenderer(tokenizer, [], CallFormat()),
                           tok.eos_ids, tok.pad_id, EpisodeLimits(3, 96, 5.0))
    envs = iter([Scripted(turns=3) for _ in range(8)])
    turn = SamplingParams(max_new_tokens=12, temperature=1.3, top_p=0.95, stop=(" ",), think=THINK)
    batch = runner.run(model, lambda: next(envs), [{"prompt": TEXTS[1]}, {"prompt": TEXTS[2]}], 4, [turn] * 2,
                       [5] * 2, [0, 1])
    rollout = batch.rollout
    trained = rollout.trained_mask_BTc.bool()
    later = [b for b, ep in enumerate(batch.episodes) if ep.turns >= 2]
    assert later, "no episode got a second turn: the test would prove little"
    after_first = torch.zeros_like(trained)  # policy tokens of turns after the first
    for b in later:
        mask = batch.episodes[b].policy_mask
        after_first[b, mask.index(0):len(mask)] = True
    drawn_at = rollout.temperature_BTc[trained & after_first]
    assert (drawn_at == THINK.temperature).any() and (drawn_at == 1.3).any()  # spans opened in later turns too
    model.eval()
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, rollout.select(slice(None)))
        gap = (trainer[trained] - rollout.sampling_logp_BTc[trained]).abs()
        assert gap.mean() < 1e-4 and gap.max() < 1e-3, (gap.mean(), gap.max())
        rows_only = rollout.select(slice(None))
        rows_only.temperature_BTc = None
        wrong, _ = completion_logprobs(model, rows_only)
    assert (wrong[trained] - rollout.sampling_logp_BTc[trained]).abs().max() > 0.1


def test_without_think_the_rollout_carries_no_token_temperatures(think_model_dir):
    tokenizer, tok, model = think_policy(think_model_dir)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    plain = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(
        model, prompts, 2, SamplingParams(max_new_tokens=6, temperature=0.9), seed=0)
    assert plain.temperature_BTc is None and plain.select(slice(0, 2)).temperature_BTc is None


# ---- refusals and config --------------------------------------------------------------------------------

def test_a_model_that_falls_back_to_generate_keeps_its_think_phases(tiny_model_dir):
    tokenizer, tok, model = make_policy(tiny_model_dir)
    model.get_base_model().config.model_type = "gpt2"  # the builtin engine falls back to generate
    try:
        sampler = build_generator(RolloutConfig(think={}), model, tokenizer, tok.eos_ids, tok.pad_id, 100, 8)
    finally:
        model.get_base_model().config.model_type = "llama"
    assert sampler.name == "hf"
    rollout = sampler.sample(model, [[5, 6]], 2, SamplingParams(max_new_tokens=3, think=ThinkPhase(temperature=0.5,
                                                                                                   starts_inside=True)), 0)
    assert rollout.temperature_BTc[rollout.completion_mask_BTc.bool()].unique().tolist() == [0.5]


def test_config_think_section():
    assert load_config(None, ["rollout.engine=hf", "rollout.think.temperature=0.6"]).rollout.think.temperature == 0.6
    with pytest.raises(UserError, match="rollout.think.temperature"):
        load_config(None, ["rollout.think.temperature=0"])
    cfg = load_config(None, ["rollout.think.temperature=0.6", "rollout.think.starts_inside=true",
                             "rollout.think.end=</reasoning>"])
    assert cfg.rollout.think_phase() == ThinkPhase(end="</reasoning>", temperature=0.6, starts_inside=True)
    assert load_config(None).rollout.think_phase() is None


# ---- entropy with gradient ------------------------------------------------------------------------------

def test_entropy_grad_chunked_equals_full(tiny_model_dir):
    tokenizer, tok, model = make_policy(tiny_model_dir)
    perturb_adapter(model, scale=0.2)
    micro = vary_lengths(sample(model, tokenizer, tok, seed=2), tok.pad_id).select(slice(0, 8))
    g = torch.Generator().manual_seed(0)
    micro.temperature_BTc = (0.5 + torch.rand(micro.completion_ids_BTc.shape, generator=g)) * micro.completion_mask_BTc
    mask = micro.completion_mask_BTc.bool()

    def entropy_and_grads(chunk):
        model.zero_grad(set_to_none=True)
        logp, entropy = completion_logprobs(model, micro, True, chunk, entropy_grad=True)
        (entropy * mask).sum().backward()
        return logp.detach(), entropy.detach(), torch.cat([p.grad.flatten() for p in trainable_parameters(model)])

    full_logp, full_entropy, full_grads = entropy_and_grads(0)
    assert full_grads.abs().max() > 0
    for chunk in (7, 1024):
        logp, entropy, grads = entropy_and_grads(chunk)
        assert (grads - full_grads).norm() <= 1e-5 * full_grads.norm(), chunk
        assert torch.allclose(entropy[mask], full_entropy[mask], atol=1e-5, rtol=0)
        assert torch.allclose(logp[mask], full_logp[mask], atol=1e-5, rtol=0)
        plain_logp, plain_entropy = completion_logprobs(model, micro, True, chunk)  # today's path: no graph
        assert not plain_entropy.requires_grad and plain_logp.requires_grad
        assert torch.equal(plain_entropy[mask], entropy[mask]) and torch.equal(plain_logp.detach()[mask], logp[mask])
