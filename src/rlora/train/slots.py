"""A group's slot in one RL step: which policy samples which prompt, in which sampling round, at which place.

A step samples in rounds. Round 0 holds the step's P prompts, each drawn by every policy when the run trains
several (train/policies.py); dynamic sampling's round r = 1, 2, ... holds up to P extra prompts (step_batch.ExtraPrompts).
A group is named by its slot, not by its dataset prompt: a prompt that fills two slots of a step gets two groups,
and the sampler's random key comes from the slot, so a group's samples do not depend on which rank or which
sampler call draws it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    policy: int  # the policy that samples it (0 unless the run trains several)
    round: int  # 0: the step's prompts; r: dynamic sampling's r-th round of extra prompts
    position: int  # its place in its round's list of prompts
    prompt: int  # the training prompt it samples (index into the run's training prompts)

    def key(self, prompts_per_step: int) -> int:
        """The sampler's random key (rollout/engine.py): round r's prompts follow the earlier rounds' at
        r x P + position (a round holds at most P), so no two slots of one policy share a key. The policy is not
        in it: a policy's slot draws with the key that a run of that policy alone would use."""
        return self.round * prompts_per_step + self.position


def first_round(step_prompts: list[int], positions: list[int], policies: int) -> list[Slot]:
    """Round 0's slots at these positions of the step's prompts, for each of the `policies` policies in turn (the
    row order of the batch and of samples.jsonl)."""
    return [Slot(policy, 0, i, step_prompts[i]) for policy in range(policies) for i in positions]


def extra_round(round_index: int, drawn: list[int], policy: int = 0) -> list[Slot]:
    """The slots of dynamic sampling's round `round_index`, in which `policy` draws these prompts (each policy of a
    run of several that still needs groups draws the same list, as a run of it alone would)."""
    return [Slot(policy, round_index, i, prompt) for i, prompt in enumerate(drawn)]
