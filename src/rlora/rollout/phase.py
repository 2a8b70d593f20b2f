"""Phase-aware sampling: which rows are inside a thinking span, and the settings they draw with.
ThinkTracker is pure bookkeeping on token ids and their decoded text (no tensors, no model), tested on
hand-written sequences; RowPhases applies it to the rows of a built-in sampler call.

A row starts inside when its ThinkPhase says `starts_inside`, enters after the token whose text completes
`start`, and leaves after the token that completes `end`. A token is drawn with the think settings iff
its row is inside when it is drawn: the token completing `end` still is, the next one is not. Markers are
looked for in the decoded text of the newest tokens (a marker may span several tokens), counting only
tokens after the last switch, so the marker that caused a switch cannot cause another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from rlora.rollout.sampling import RowParams
from rlora.types import SamplingParams, ThinkPhase


class ThinkTracker:
    """Per row: inside a thinking span or not. Rows whose phase is None never switch and cost nothing."""

    def __init__(self, decode: Callable[[list[int]], str], phases: Sequence[ThinkPhase | None]):
        self.decode, self.phases = decode, list(phases)
        self.inside = [p is not None and p.starts_inside for p in self.phases]
        self.since = [0] * len(self.phases)  # index of the first token after the row's last switch
        # a token decodes to >= 1 byte of text, so this many tokens always cover the longer marker
        # (as in StopStrings); only the newest token can complete a marker that was not there before
        self.tail = max((len(m.encode("utf-8")) for p in self.phases if p for m in (p.start, p.end)), default=0) + 2
        self.any = any(p is not None for p in self.phases)

    def update(self, row: int, tokens: list[int]) -> bool:
        """`tokens`: the row's completion so far, its newest token just drawn. Switches the row's phase if
        that token completed the marker it waits for -> whether the row is inside for the next token."""
        phase = self.phases[row]
        if phase is None:
            return False
        marker = phase.end if self.inside[row] else phase.start
        if marker in self.decode(tokens[max(self.since[row], len(tokens) - self.tail):]):
            self.inside[row] = not self.inside[row]
            self.since[row] = len(tokens)
        return self.inside[row]


def think_phases(params: Sequence[SamplingParams], n: int) -> list[ThinkPhase | None]:
    """One SamplingParams per prompt -> each row's think phase (prompt-major). Greedy rows get none: they
    take the argmax in either phase, and their log-probs stay at temperature 1."""
    return [None if p.greedy else p.think for p in params for _ in range(n)]


class RowPhases:
    """The thinking-span state of the B rows of one sampler call, built only when some row has a phase (rows
    without one keep their own settings). Records the temperature each token was drawn at."""

    def __init__(self, decode: Callable[[list[int]], str], phases: list[ThinkPhase | None], rows: RowParams,
                 max_new: int):
        self.phases, self.tracker = phases, ThinkTracker(decode, phases)
        device = rows.temperature_A.device
        has_B = torch.tensor([p is not None for p in phases], device=device)
        think_temperature_B = torch.tensor([p.temperature if p else 1.0 for p in phases], device=device)
        think_top_p_B = torch.tensor([p.top_p if p else 1.0 for p in phases], device=device)
        self.temperature_B = torch.where(has_B, think_temperature_B, rows.temperature_A)  # inside the span
        self.top_p_B = torch.where(has_B, think_top_p_B, rows.top_p_A)
        self.inside_B = torch.tensor(self.tracker.inside, device=device)
        self.temperature_BT = torch.zeros(len(phases), max_new)  # float32, 0 where no token was drawn

    def settings(self, rows_A: RowParams, active_A: torch.Tensor, t_A: torch.Tensor) -> RowParams:
        """The settings the active rows (rows_A = their own settings) draw their token t_A with."""
        inside_A = self.inside_B[active_A]
        temperature_A = torch.where(inside_A, self.temperature_B[active_A], rows_A.temperature_A)
        rows_A = replace(rows_A, temperature_A=temperature_A,
                         top_p_A=torch.where(inside_A, self.top_p_B[active_A], rows_A.top_p_A))
        self.temperature_BT[active_A.cpu(), t_A.cpu()] = rows_A.temperature_A.float().cpu()
        return rows_A

    def advance(self, tokens: dict[int, list[int]], active: list[int]) -> None:
        """The active rows each just drew a token, the last of tokens[row] (each row's tokens so far): switch the rows
        it took into or out of a span."""
        for row in active:
            if self.phases[row] is not None:
                self.tracker.update(row, tokens[row])
        self.inside_B = torch.tensor(self.tracker.inside, device=self.inside_B.device)
