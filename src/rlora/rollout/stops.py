"""Stop strings: where a row's text, decoded from its newest tokens, contains one of its stop strings. Shared by
both samplers (the engine's host loop, generate's draw: rollout/generate_draw.py)."""

from __future__ import annotations


class StopStrings:
    """Finds each row's stop strings in the text of its newest tokens (decoding only a short tail)."""

    def __init__(self, tokenizer, stops_per_row: list[tuple[str, ...]]):
        self.tokenizer = tokenizer
        self.stops = [[s for s in stops if s] for stops in stops_per_row]
        # a token decodes to >= 1 byte of text, so this many tokens always cover the longest stop string
        self.tail = max((len(s.encode("utf-8")) for stops in self.stops for s in stops), default=0) + 2
        self.any = any(self.stops)

    def hit(self, row: int, tokens: list[int]) -> bool:
        if not self.stops[row]:
            return False
        text = self.tokenizer.decode(tokens[-self.tail:], skip_special_tokens=False)
        return any(s in text for s in self.stops[row])
