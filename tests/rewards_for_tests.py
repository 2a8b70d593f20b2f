"""Reward functions imported by dotted path in the CLI tests."""

CALLS = {"n": 0}


def count_a(prompts, completions, **columns):
    """Share of the letter 'a' in the completion: a dense reward a random tiny model gets some signal from."""
    return [c.count("a") / max(len(c), 1) for c in completions]


def always_raises(prompts, completions, **columns):
    raise RuntimeError("reward server unreachable")


def raises_on_first(prompts, completions, **columns):
    """Fails for the first completion of each batch only (when called one by one, only on index 0 of the batch)."""
    CALLS["n"] += 1
    if len(completions) > 1:
        raise ValueError("batch contains a bad sample")
    if completions[0] == "BAD":
        raise ValueError("bad sample")
    return [1.0]


def wrong_length(prompts, completions, **columns):
    return [1.0]


def fails_on_even_prompts(prompts, completions, answer, **columns):
    """Raises for samples whose answer is a multiple of 4 (the fixture's prompts 0, 2, 4, 6)."""
    if any(int(a) % 4 == 0 for a in answer) and len(completions) > 1:
        raise ValueError("batch has an even prompt")
    if int(answer[0]) % 4 == 0:
        raise ValueError("even prompt")
    return [0.0] * len(completions)


def has_a(prompts, completions, **columns):
    """1 if the completion contains the letter 'a', else 0: a binary reward, so some groups are all equal."""
    return [float("a" in c) for c in completions]


def constant(prompts, completions, **columns):
    """The same reward for every completion: every group has zero variance."""
    return [1.0 for _ in completions]


def hangs(prompts, completions, **columns):
    """Never returns (until interrupted): a reward server that stopped answering."""
    import time

    while True:
        time.sleep(0.01)


def flat_for_zero(prompts, completions, answer, **columns):
    """The same reward for every completion of the problem whose answer is 0 (a zero-variance group),
    count_a for the others."""
    return [1.0 if str(a) == "0" else c.count("a") / max(len(c), 1) for c, a in zip(completions, answer)]


def flat_for_answers(prompts, completions, answer, flat=(), **columns):
    """The same reward for every completion of a problem whose answer is in `flat` (a zero-variance group); for the
    others a number of the completion's characters, equal for two completions only by chance (a tiny random model's
    completions may well hold no 'a': count_a would leave their groups flat too)."""
    return [1.0 if str(a) in flat else sum(map(ord, c)) % 97 / 97 for c, a in zip(completions, answer)]


def char_count(prompts, completions, **columns):
    """The completion's length in characters: a reward the test can recompute from the logged completion text."""
    return [float(len(c)) for c in completions]


def chance_binary(prompts, completions, share=0.5, **columns):
    """1 for a completion whose characters' code sum falls in the lowest `share` of its residues mod 97, else 0: a
    binary reward whose groups are flat (all 1 or all 0) by chance, depending on their samples."""
    return [float(sum(map(ord, c)) % 97 < share * 97) for c in completions]
