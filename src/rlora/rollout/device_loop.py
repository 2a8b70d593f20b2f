"""The decode loop that keeps every row's state on the device: no device-to-host sync per token.

The host loop (engine.BuiltinGenerator._sample_chunk) reads each drawn token back to the host to drop
finished rows from the next step, match stop strings, call on_token and follow think phases. On a GPU that
read waits for the step to finish, so the host cannot queue the next one while the device works. Where a
chunk needs none of those host-side checks and the step has fixed shapes ('static', 'graph'), this loop keeps
the tokens, log-probs, lengths and finished flags on the device, draws inside the step (inside the CUDA graph
where no row truncates its distribution: top-k/top-p decide per row whether a full sort is needed, which a
graph cannot branch on), and asks the device whether every row has finished once every CHECK_EVERY tokens.
Finished rows keep decoding (they feed what they draw; their own cache slots only) until that check; what
they draw is not recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlora.rollout.graphed import StaticDecoder

# tokens between two "has every row finished?" reads: at most CHECK_EVERY - 1 steps run after the last row ends
CHECK_EVERY = 8

Draw = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (logits_BV, t_1) -> token, logp


@dataclass
class RowsOnDevice:
    """What the rows have drawn so far, all on the device: tokens (pad after a row's end), their sampling
    log-probs (0 after the end), lengths (max_new until a row ends), whether a row stopped at EOS, finished."""

    tokens_BT: torch.Tensor
    logp_BT: torch.Tensor
    length_B: torch.Tensor
    stopped_B: torch.Tensor
    done_B: torch.Tensor

    @classmethod
    def empty(cls, B: int, max_new: int, pad_id: int, device) -> "RowsOnDevice":
        return cls(tokens_BT=torch.full((B, max_new), pad_id, dtype=torch.long, device=device),
                   logp_BT=torch.zeros(B, max_new, device=device),
                   length_B=torch.full((B,), max_new, dtype=torch.long, device=device),
                   stopped_B=torch.zeros(B, dtype=torch.bool, device=device),
                   done_B=torch.zeros(B, dtype=torch.bool, device=device))

    def record(self, token_B: torch.Tensor, logp_B: torch.Tensor, t: int, eos_V: torch.Tensor,
               max_new_B: torch.Tensor, pad_id: int) -> None:
        """Token t of every row that has not finished; a row ends at EOS or at its own max_new_tokens."""
        live_B = ~self.done_B
        self.tokens_BT[:, t] = torch.where(live_B, token_B, pad_id)
        self.logp_BT[:, t] = torch.where(live_B, logp_B.float(), 0.0)
        stopped_B = live_B & eos_V[token_B]
        ended_B = stopped_B | (live_B & (max_new_B <= t + 1))
        self.length_B = torch.where(ended_B, t + 1, self.length_B)
        self.stopped_B |= stopped_B
        self.done_B |= ended_B


def all_finished(rows: RowsOnDevice) -> bool:
    """The loop's only read back to the host (a sync on a GPU)."""
    return bool(rows.done_B.all())


def decode_on_device(static: StaticDecoder, first_logits_BV: torch.Tensor, draw: Draw, draws_in_step: bool,
                     prompt_len_B: torch.Tensor, max_new_B: torch.Tensor, max_new: int, eos_V: torch.Tensor,
                     pad_id: int) -> RowsOnDevice:
    """Draw token 0 from the prompts' logits, then step: feed token t, draw token t + 1 (in the step when
    draws_in_step, i.e. static was built with this draw; else right after it), until every row has finished."""
    device = first_logits_BV.device
    rows = RowsOnDevice.empty(first_logits_BV.shape[0], max_new, pad_id, device)
    t_1 = torch.zeros(1, dtype=torch.long, device=device)
    token_B, logp_B = draw(first_logits_BV, t_1)
    rows.record(token_B, logp_B, 0, eos_V, max_new_B, pad_id)
    for t in range(max_new - 1):
        if t % CHECK_EVERY == CHECK_EVERY - 1 and all_finished(rows):
            break
        out = static(token_B, prompt_len_B + t, t)
        if draws_in_step:
            token_B, logp_B = out
        else:
            t_1.fill_(t + 1)
            token_B, logp_B = draw(out, t_1)
        rows.record(token_B, logp_B, t + 1, eos_V, max_new_B, pad_id)
    return rows
