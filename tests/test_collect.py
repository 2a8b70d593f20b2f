"""Dynamic sampling (DAPO) and adaptive resampling (adaptive GRPO) with a scripted sampler: exact counts of
sampling rounds, which groups are resampled with which settings, what is kept, the advantage statistics, and the
slots that name the groups (the sampler keys and seeds of the int slots they replace)."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlora.algos.advantages import group_advantages, per_token
from rlora.config import AlgoConfig
from rlora.rewards.scoring import Scores
from rlora.train.collect import Collector, Group, assemble, fails, is_flat
from rlora.train.policies import row_policies
from rlora.train.slots import Slot, extra_round, first_round
from rlora.train.step_batch import _sampling_args
from rlora.types import Rollout, SamplingParams

G = 4
BASE = SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.95)


class ScriptedSampler:
    """Returns, call after call, the scripted rewards of each slot (a dict slot -> list of reward rows, consumed in
    order; plain ints name the slots: the Collector never looks inside one); completions are `length` tokens long.
    Records every call."""

    def __init__(self, script: dict[int, list[list[float]]], length: int = 3):
        self.script = {p: list(rows) for p, rows in script.items()}
        self.length = length
        self.calls = []

    def __call__(self, prompts, params, seed):
        self.calls.append((list(prompts), [(p.temperature, p.top_p) for p in params], seed))
        rewards = [r for p in prompts for r in self.script[p].pop(0)]
        B = len(rewards)
        rollout = Rollout(
            prompt_ids_BTp=torch.tensor([[p + 10] for p in prompts for _ in range(G)]),
            prompt_mask_BTp=torch.ones(B, 1, dtype=torch.long),
            completion_ids_BTc=torch.full((B, self.length), 3), completion_mask_BTc=torch.ones(B, self.length, dtype=torch.long),
            completions=[f"p{p}" for p in prompts for _ in range(G)], finish_reasons=["stop"] * B,
            temperature_B=torch.tensor([prm.temperature for prm in params for _ in range(G)]),
            sampling_logp_BTc=torch.zeros(B, self.length),
        )
        total = torch.tensor(rewards, dtype=torch.float64)
        return rollout, Scores(total, {"r": rewards}, torch.isnan(total))


def algo(**values) -> AlgoConfig:
    return AlgoConfig(**values)


def test_conditions():
    cfg = algo().adaptive
    assert fails(torch.tensor([0.0, 0.5, 0.0]), cfg) and not fails(torch.tensor([0.0, 1.0, 0.0]), cfg)
    assert is_flat(torch.tensor([1.0, 1.0, math.nan])) and not is_flat(torch.tensor([1.0, 0.0]))
    zero_var = cfg.model_copy(update={"condition": "zero_variance"})
    assert fails(torch.tensor([1.0, 1.0]), zero_var) and not fails(torch.tensor([0.0, 0.5]), zero_var)
    either = cfg.model_copy(update={"condition": "no_success_or_zero_variance"})
    assert fails(torch.tensor([1.0, 1.0]), either) and fails(torch.tensor([0.0, 0.5]), either)
    assert not fails(torch.tensor([1.0, 0.0]), either)


def test_without_resampling_one_round_with_the_step_seed():
    sampler = ScriptedSampler({0: [[1, 0, 0, 0]], 1: [[1, 1, 1, 1]]})
    collector = Collector(sampler, BASE, G, algo(), seed=123)
    groups = collector.collect([0, 1], lambda r: pytest.fail("no extra round expected"))
    assert [g.slot for g in groups] == [0, 1]
    assert sampler.calls == [([0, 1], [(0.7, 0.95)] * 2, 123)]
    assert collector.stats.sampling_rounds == 1 and collector.stats.zero_var_before == 1


def test_dynamic_sampling_drops_flat_groups_and_refills():
    # round 0: prompt 0 flat, prompt 1 mixed -> 1 kept; round 1 (prompts 2, 3): 2 flat, 3 mixed -> 2 kept: stop
    sampler = ScriptedSampler({0: [[1, 1, 1, 1]], 1: [[1, 0, 0, 1]], 2: [[0, 0, 0, 0]], 3: [[0, 0.5, 0, 0]]})
    collector = Collector(sampler, BASE, G, algo(dynamic_sampling=True, max_extra_rounds=3), seed=5)
    groups = collector.collect([0, 1], lambda r: {1: [2, 3]}[r])
    assert [g.slot for g in groups] == [1, 3]
    assert [c[0] for c in sampler.calls] == [[0, 1], [2, 3]]
    assert collector.stats.sampling_rounds == 2 and collector.stats.groups_dropped == 2
    assert len({c[2] for c in sampler.calls}) == 2  # each round draws with its own seed


def test_dynamic_sampling_keeps_only_a_full_batch():
    sampler = ScriptedSampler({0: [[1, 1, 1, 1]], 1: [[1, 0, 0, 1]], 2: [[0, 1, 0, 0]], 3: [[0, 0.5, 0, 0]]})
    collector = Collector(sampler, BASE, G, algo(dynamic_sampling=True), seed=5)
    groups = collector.collect([0, 1], lambda r: [2, 3])
    assert [g.slot for g in groups] == [1, 2]  # 3 was informative too, but the step is full


def test_dynamic_sampling_fills_each_owners_groups_as_alone():
    """Two owners (policies: slots 0-9 are owner 0's, 10-19 owner 1's). Round 0: owner 0 keeps 1 of 2, owner 1 keeps
    both; round 1 samples owner 0's extra prompts only (2 flat, 3 kept but owner 0 needs one: 4 is left out); owner 1
    needed no round. Each owner's groups, statistics and draws are those of a collector of that owner alone."""
    def script():
        return {0: [[1] * G], 1: [[1, 0, 0, 1]], 2: [[0] * G], 3: [[0, 1, 0, 0]], 4: [[1, 0, 0, 0]],
                10: [[0, 1, 1, 1]], 11: [[0, 0.5, 0, 0]], 12: [[0] * G], 13: [[1] * G], 14: [[0] * G]}

    cfg = algo(dynamic_sampling=True, max_extra_rounds=3)
    sampler = ScriptedSampler(script())
    collector = Collector(sampler, BASE, G, cfg, seed=5, owner=lambda slot: slot // 10)
    groups = collector.collect([0, 1, 10, 11], lambda r: {1: [2, 3, 4, 12, 13, 14]}[r])
    assert [g.slot for g in groups] == [1, 3, 10, 11]  # owner by owner, each in the order drawn
    assert [c[0] for c in sampler.calls] == [[0, 1, 10, 11], [2, 3, 4]]
    assert (collector.stats.sampling_rounds, collector.stats.groups_sampled, collector.stats.groups_dropped) == (2, 7, 2)
    own = collector.owner_stats
    assert [(own[k].sampling_rounds, own[k].groups_sampled, own[k].groups_dropped) for k in (0, 1)] == \
        [(2, 5, 2), (1, 2, 0)]
    for owner, slots, extra in ((0, [0, 1], [2, 3, 4]), (1, [10, 11], [12, 13, 14])):
        alone_sampler = ScriptedSampler(script())
        alone = Collector(alone_sampler, BASE, G, cfg, seed=5)
        assert [g.slot for g in alone.collect(slots, lambda r: {1: extra}[r])] == [g.slot for g in groups
                                                                               if g.slot // 10 == owner]
        assert alone.stats == own[owner]
        # the same seeds for the same slots
        assert [(c[0], c[2]) for c in alone_sampler.calls] == \
            [([p for p in c[0] if p // 10 == owner], c[2]) for c in sampler.calls if any(p // 10 == owner for p in c[0])]


def test_dynamic_sampling_stops_at_the_round_cap():
    script = {p: [[0.5] * G] for p in range(8)}
    sampler = ScriptedSampler(script)
    collector = Collector(sampler, BASE, G, algo(dynamic_sampling=True, max_extra_rounds=2), seed=0)
    groups = collector.collect([0, 1], lambda r: [2 * r, 2 * r + 1])
    assert groups == [] and len(sampler.calls) == 3  # the first round + 2 extra rounds, then train on nothing
    assert collector.stats.groups_dropped == 6


def test_adaptive_resamples_only_failing_groups_with_the_schedule():
    # group 0 has a success; 1 is rescued by retry 1 (temperature 1.0); 2 fails twice (retry 2 at 1.2, top-p 1.0)
    sampler = ScriptedSampler({
        0: [[1, 0, 0, 0]],
        1: [[0, 0, 0, 0], [0, 1, 0, 0]],
        2: [[0, 0.5, 0, 0], [0, 0, 0, 0], [0.5, 0.5, 0, 0]],
    })
    cfg = algo(adaptive={"enabled": True, "schedule": [{"temperature": 1.0}, {"temperature": 1.2, "top_p": 1.0}]})
    collector = Collector(sampler, BASE, G, cfg, seed=9)
    groups = collector.collect([0, 1, 2], lambda r: pytest.fail("no extra round"))
    assert [(c[0], c[1]) for c in sampler.calls] == [
        ([0, 1, 2], [(0.7, 0.95)] * 3), ([1, 2], [(1.0, 1.0)] * 2), ([2], [(1.2, 1.0)])]
    assert [g.retries for g in groups] == [0, 1, 2]
    assert collector.stats.resamples == 3 and collector.stats.rescued == 1
    # the kept rows are the last attempt's, and each row carries the temperature it was drawn at
    assert groups[1].scores.total_B.tolist() == [0, 1, 0, 0]
    assert groups[2].scores.total_B.tolist() == [0.5, 0.5, 0, 0]
    rollout, _, _ = assemble(groups, pad_id=0, adv_stats="kept")
    assert rollout.temperature_B.tolist() == pytest.approx([0.7] * 4 + [1.0] * 4 + [1.2] * 4)
    # zero-variance groups: 1 (group 1) at the first attempt, 0 after resampling
    assert collector.stats.zero_var_before == 1 and collector.stats.zero_var_after == 0


def test_adaptive_step_budget_caps_resamples():
    sampler = ScriptedSampler({0: [[0] * G, [0] * G, [0] * G], 1: [[0] * G, [0] * G]})
    cfg = algo(adaptive={"enabled": True, "max_retries": 3, "step_budget": 2})
    collector = Collector(sampler, BASE, G, cfg, seed=0)
    collector.collect([0, 1], lambda r: [])
    assert [c[0] for c in sampler.calls] == [[0, 1], [0, 1]]  # budget 2 spent by the first retry of both
    assert collector.stats.resamples == 2


def test_adaptive_with_dynamic_sampling_resamples_refill_rounds_too():
    sampler = ScriptedSampler({0: [[0] * G, [0] * G], 1: [[1, 0, 0, 0]], 2: [[0] * G, [0, 0, 1, 0]]})
    cfg = algo(dynamic_sampling=True, adaptive={"enabled": True, "max_retries": 1})
    collector = Collector(sampler, BASE, G, cfg, seed=0)
    groups = collector.collect([0, 1], lambda r: [2])
    assert [g.slot for g in groups] == [1, 2]
    assert [c[0] for c in sampler.calls] == [[0, 1], [0], [2], [2]]


def test_advantage_statistics_of_all_attempts():
    # prompt 0: first attempt all 0, retry [1, 0, 0, 0] kept. "kept": stats of the kept 4 only;
    # "all": stats of all 8 samples: mean 0.125, unbiased std sqrt(0.125) = 0.353553
    sampler = ScriptedSampler({0: [[0] * G, [1, 0, 0, 0]]})
    collector = Collector(sampler, BASE, G, algo(adaptive={"enabled": True}), seed=0)
    groups = collector.collect([0], lambda r: [])
    _, _, kept = assemble(groups, 0, "kept")
    _, _, every = assemble(groups, 0, "all")
    assert kept.shape == (1, 4) and every.shape == (1, 8)
    adv_all = group_advantages(every)[:, :G]
    std = math.sqrt(0.125)
    assert torch.allclose(adv_all, torch.tensor([[0.875, -0.125, -0.125, -0.125]]) / (std + 1e-4), atol=1e-5)
    adv_kept = group_advantages(kept)
    assert torch.allclose(adv_kept, torch.tensor([[0.75, -0.25, -0.25, -0.25]]) / (0.5 + 1e-4), atol=1e-5)


def test_overlong_shaping_enters_the_advantage_rewards_not_the_conditions():
    # length 9 of limit 10 with a buffer of 4: penalty -(9 - 6) / 4 = -0.75 on every row
    sampler = ScriptedSampler({0: [[1, 1, 1, 1]]}, length=9)
    collector = Collector(sampler, BASE, G, algo(dynamic_sampling=True, max_extra_rounds=0, overlong_buffer=4), seed=0)
    assert collector.collect([0], lambda r: []) == []  # still a flat group for dynamic sampling
    sampler = ScriptedSampler({0: [[1, 0, 1, 1]]}, length=9)
    groups = Collector(sampler, BASE, G, algo(overlong_buffer=4), seed=0).collect([0], lambda r: [])
    assert groups[0].rewards_G.tolist() == [0.25, -0.75, 0.25, 0.25]


def test_retried_rows_are_trained_at_the_temperature_they_were_drawn_at(tiny_model_dir):
    """Adaptive resampling on the real engine: the retried group's sampler log-probs (at temperature 1.6)
    equal the trainer's recomputed ones, which divide that row's logits by 1.6; recomputing at the base
    temperature instead would be off-policy by a wide margin."""
    from test_engine import policy

    from rlora.rollout.engine import BuiltinGenerator
    from rlora.train.update import batched_logprobs

    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id)

    def sample(indices, params, seed):
        rollout = engine.sample(model, [prompts[i] for i in indices], G, params, seed)
        # prompt 0 always "fails" at first, prompt 1 always succeeds
        total = torch.tensor([float(i == 1) * (j == 0) for i in indices for j in range(G)], dtype=torch.float64)
        if rollout.temperature_B[0] != BASE.temperature:
            total[::G] = 1.0
        return rollout, Scores(total, {"r": total.tolist()}, torch.zeros(len(total), dtype=torch.bool))

    cfg = algo(adaptive={"enabled": True, "schedule": [{"temperature": 1.6}]})
    groups = Collector(sample, SamplingParams(max_new_tokens=12, temperature=0.7), G, cfg, seed=0).collect([0, 1], lambda r: [])
    rollout, _, _ = assemble(groups, tok.pad_id, "kept")
    assert rollout.temperature_B.tolist() == pytest.approx([1.6] * G + [0.7] * G)
    mask = rollout.completion_mask_BTc.bool()
    trainer = batched_logprobs(model, rollout, micro_batch_size=4)
    gap = (trainer - rollout.sampling_logp_BTc)[mask].abs()
    assert gap.mean() < 1e-4 and gap.max() < 1e-3
    rollout.temperature_B = torch.full_like(rollout.temperature_B, 0.7)  # pretend every row was drawn at 0.7
    wrong = (batched_logprobs(model, rollout, micro_batch_size=4) - rollout.sampling_logp_BTc)[:G][mask[:G]].abs()
    assert wrong.mean() > 0.05


def test_loss_mask_and_behaviour_of_a_batch_with_replayed_groups():
    """Fresh rows: failed rewards and (with mask_truncated) truncated completions leave the loss; the bf16
    sampler's cap applies to fresh rows, replay.is_cap to replayed ones; without sampler_is_cap fresh rows
    are unweighted (NaN behaviour)."""
    from rlora.config import RLConfig
    from rlora.batching import concat_rollouts
    from rlora.train.replay import StoredGroup
    from rlora.train.step import behaviour, loss_mask
    from rlora.train.step_batch import Batch

    fresh, scores = ScriptedSampler({0: [[1.0, math.nan, 0.0, 0.0]]})([0], [BASE], 0)
    fresh.finish_reasons = ["stop", "stop", "length", "stop"]
    old, _ = ScriptedSampler({1: [[0, 1, 0, 0]]}, length=5)([1], [BASE], 0)  # another completion width
    stored = StoredGroup(old, per_token(torch.tensor([-0.5, 1.5, -0.5, -0.5]), old.completion_mask_BTc),
                         old.completion_mask_BTc, step=1)
    batch = Batch(concat_rollouts([fresh, old], 0), scores, torch.zeros(1, G), [], [stored])
    cfg = RLConfig.model_validate({"data": {"task": "chain_sum"}, "rewards": [{"fn": "gym"}],
                                   "algo": {"mask_truncated": True, "sampler_is_cap": 3.0, "replay": {"is_cap": 1.5}}})
    s = SimpleNamespace(cfg=cfg)
    mask = loss_mask(s, batch)
    assert mask.shape == (8, 5) and mask.sum(-1).tolist() == [3, 0, 0, 3, 5, 5, 5, 5]
    behaviour_BT, cap_B = behaviour(s, batch)
    assert cap_B.tolist() == [3.0] * 4 + [1.5] * 4 and not torch.isnan(behaviour_BT).any()
    s.cfg = cfg.model_copy(update={"algo": cfg.algo.model_copy(update={"sampler_is_cap": None})})
    behaviour_BT, cap_B = behaviour(s, batch)
    assert torch.isnan(behaviour_BT[:4]).all() and not torch.isnan(behaviour_BT[4:]).any()


@pytest.mark.parametrize("name", ["grpo", "reinforce_pp"])
def test_a_batch_with_replayed_groups_has_advantages_per_token(name):
    """advantages_of: the fresh rows' advantages from the algorithm, one per token (a group algorithm's broadcast
    to the completion's tokens, REINFORCE++'s per token and 0 on padding), then each replayed group's stored ones
    (per token, from another step, of another width) padded to the batch's width."""
    from types import SimpleNamespace

    from rlora.algos.advantages import reinforce_pp_advantages
    from rlora.algos.registry import get_algorithm
    from rlora.batching import concat_rollouts
    from rlora.config import RLConfig
    from rlora.train.distributed import World
    from rlora.train.replay import StoredGroup
    from rlora.train.step import advantages_of, loss_mask
    from rlora.train.step_batch import Batch

    fresh, scores = ScriptedSampler({0: [[1.0, 0.0, 0.5, 0.0]]})([0], [BASE], 0)  # 3 tokens
    old, _ = ScriptedSampler({1: [[0, 1, 0, 0]]}, length=5)([1], [BASE], 0)
    stored_GT = torch.arange(20.0).view(G, 5) * old.completion_mask_BTc  # what a REINFORCE++ step stored
    stored = StoredGroup(old, stored_GT, old.completion_mask_BTc, step=1)
    group = Group(Slot(0, 0, 0, prompt=0), fresh, scores, torch.zeros(G, dtype=torch.float64))
    batch = Batch(concat_rollouts([fresh, old], 0), scores, scores.total_B.view(1, G), [group], [stored])
    cfg = RLConfig.model_validate({"data": {"task": "chain_sum"}, "rewards": [{"fn": "gym"}], "algo": {"name": name},
                                   "rollout": {"num_generations": G}})
    s = SimpleNamespace(cfg=cfg, algo=get_algorithm(name), world=World(),
                        policies=[SimpleNamespace(index=0, beta=cfg.algo.beta)])
    mask = loss_mask(s, batch)
    advantages = advantages_of(s, batch, mask, None, None)
    assert advantages.shape == mask.shape == (8, 5) and torch.equal(advantages[G:], stored_GT)
    rewards = scores.total_B
    if name == "grpo":
        assert torch.equal(advantages[:G], group_advantages(rewards.view(1, G)).view(G, 1).expand(G, 5))
    else:
        expected = reinforce_pp_advantages(rewards, mask[:G], None, 0.0, cfg.algo.adv_eps)
        assert torch.equal(advantages[:G], expected.float())
        assert advantages[:G, 3:].abs().sum() == 0 and advantages[:G, :3].abs().sum() > 0


def test_extra_prompts_never_repeat_within_a_step_and_are_seeded():
    from rlora.train.step_batch import ExtraPrompts

    extra = ExtraPrompts(num_prompts=10, count=3, seed=0, step=4, first=[0, 1, 2])
    rounds = [extra(1), extra(2)]
    drawn = [p for r in rounds for p in r]
    assert len(drawn) == 6 and len(set(drawn)) == 6 and not set(drawn) & {0, 1, 2}
    again = ExtraPrompts(num_prompts=10, count=3, seed=0, step=4, first=[0, 1, 2])
    assert [again(1), again(2)] == rounds
    assert ExtraPrompts(10, 3, 0, 5, [0, 1, 2])(1) != rounds[0] or ExtraPrompts(10, 3, 0, 6, [0, 1, 2])(1) != rounds[0]


def test_replay_count_rounds_stochastically_to_the_expected_number():
    from rlora.train.step_batch import replay_count

    counts = [replay_count(0.5, seed=0, step=s) for s in range(400)]
    assert set(counts) == {0, 1} and abs(sum(counts) / 400 - 0.5) < 0.08
    assert [replay_count(2.0, 0, s) for s in range(5)] == [2] * 5
    assert replay_count(0.5, 0, 7) == replay_count(0.5, 0, 7)


def _int_slot_sampling_args(P: int, step: int, train_seed: int, policy_seeds: list[int] | None, slots: list[int],
                            seed: int):
    """The sampler's (seed or seeds, keys, policies) as the trainer derived them from int slots before
    train/slots.py: one policy, slot r * P + i (round r's position i) is the key; several, slot k * P + i is
    position i of policy k, with key i and policy k's step seed plus the Collector's offset."""
    if policy_seeds is None:
        return seed, slots, None
    offset = seed - (train_seed * 100_003 + step)
    return ([policy_seeds[slot // P] * 100_003 + step + offset for slot in slots], [slot % P for slot in slots],
            [slot // P for slot in slots])


def test_typed_slots_give_the_int_slots_keys_seeds_and_policies():
    P, step, train_seed, policy_seeds = 3, 5, 7, [4, 9]
    step_seed = train_seed * 100_003 + step

    def run(policies):  # None: a run of one policy (an adapter that serves one: the sampler's plain path)
        return SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(seed=train_seed, prompts_per_step=P)),
                               policies=[SimpleNamespace(seed=seed) for seed in policies or [train_seed]],
                               adapter=SimpleNamespace(sampler_policies=lambda rows: policies and list(rows)))

    # hand-computed keys: r x P + position, whatever the policy
    assert Slot(0, 0, 2, prompt=6).key(P) == 2 and Slot(0, 2, 1, prompt=0).key(P) == 7
    assert Slot(1, 0, 2, prompt=6).key(P) == 2  # policy 1 keys its slot as a run of policy 1 alone would
    step_prompts = [6, 0, 3]
    # one policy: round 0 (all positions, then one rank's share), dynamic sampling's rounds 1 and 2, retries
    for positions in ([0, 1, 2], [1]):
        assert [s.prompt for s in first_round(step_prompts, positions, 1)] == [step_prompts[i] for i in positions]
        for retry in (0, 1):
            seed = step_seed + 1_000_003 * retry  # Collector._seed of round 0
            assert _sampling_args(run(None), step, first_round(step_prompts, positions, 1), seed) == \
                _int_slot_sampling_args(P, step, train_seed, None, positions, seed)
    for round_index, drawn in ((1, [2, 5, 1]), (2, [4, 7])):
        slots = extra_round(round_index, drawn)
        assert [s.prompt for s in slots] == drawn
        for share in (slots, slots[1:]):  # every rank's list, and rank 1's share of a 3-rank world's
            seed = step_seed + 1_000_003 * (round_index * 64 + 1)  # its first retry
            old = [round_index * P + s.position for s in share]
            assert _sampling_args(run(None), step, share, seed) == \
                _int_slot_sampling_args(P, step, train_seed, None, old, seed)
    # two policies: each rank's slots policy by policy (the old rank_slots order k * P + i), with an offset too
    for positions in ([0, 1, 2], [2]):
        slots = first_round(step_prompts, positions, 2)
        old = [k * P + i for k in range(2) for i in positions]
        assert [s.prompt for s in slots] == [step_prompts[slot % P] for slot in old]
        for seed in (step_seed, step_seed + 1_000_003):
            assert _sampling_args(run(policy_seeds), step, slots, seed) == \
                _int_slot_sampling_args(P, step, train_seed, policy_seeds, old, seed)
        assert torch.equal(row_policies(slots, G), torch.tensor([slot // P for slot in old]).repeat_interleave(G))


def test_slots_of_different_policies_and_rounds_never_collide():
    P, step_prompts = 3, [6, 0, 3]
    rounds = [first_round(step_prompts, [0, 1, 2], 2)] + [extra_round(r, [1, 2, 4]) for r in (1, 2, 3)]
    slots = [s for r in rounds for s in r]
    # the int slots collided here: policy 1's position 0 and round 1's position 0 were both slot P
    assert len(set(slots)) == len(slots) == 2 * P + 3 * P
    by_policy = {}
    for s in slots:
        by_policy.setdefault(s.policy, []).append(s.key(P))
    assert all(len(set(keys)) == len(keys) for keys in by_policy.values())  # one policy's groups: distinct draws
    assert by_policy[1] == by_policy[0][:P]  # each policy keys the step's prompts as its own run would
