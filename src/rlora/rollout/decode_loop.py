"""The decode loop of the built-in sampler: slots, continuous batching, and rows' state kept on the device.

The call's P prompts wait in a queue; S slots (rows_that_fit // G) each decode one prompt's G rows. When every
row of a slot has finished, the slot takes the next prompt of the queue (its prefill runs then), so long,
ragged generations keep the batch full instead of waiting for the longest row of a fixed chunk. A row's
draws depend only on (seed, its key, t) (sampling.counter_uniform), so which slot a prompt lands in, and when,
never changes what it samples: a call with fewer slots samples what one with a slot per prompt samples.

Tokens, log-probs, lengths and finished flags live on the device, indexed by the call's rows. The host reads
them back in one of two ways:
- every token (`host=True`): the eager step drops finished rows from the next step, and stop strings, on_token
  callbacks and think phases (HostChecks) look at each drawn token;
- once every CHECK_EVERY tokens (the fixed-shape 'static'/'graph' step without those checks): the draw runs
  inside the step (inside the CUDA graph where no row truncates its distribution: top-k/top-p decide per row
  whether a full sort is needed, which a graph cannot branch on), and the host only asks which slots have
  finished (and at the step by which a slot surely has: its max_new_tokens). On a GPU a per-token read is a sync that keeps the host from queuing the next step while the
  device works. Finished rows keep decoding until that read (they feed what they draw into their own cache
  positions); what they draw is not recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlora.rollout.stops import StopStrings
from rlora.rollout.phase import RowPhases
from rlora.rollout.sampling import DrawPlan, RowParams, counter_uniform, sample_tokens

# steps between two reads of the finished flags: a slot that ends early (EOS) waits at most CHECK_EVERY - 1 steps;
# one that runs to its max_new_tokens is read the step it ends
CHECK_EVERY = 8


@dataclass
class RowsOnDevice:
    """What the call's B rows have drawn so far, on the device: tokens (pad after a row's end), their sampling
    log-probs (0 after the end), lengths (max_new until a row ends), whether a row stopped (EOS, stop string),
    finished."""

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

    def record(self, rows_A: torch.Tensor, token_A: torch.Tensor, logp_A: torch.Tensor, t_A: torch.Tensor,
               eos_V: torch.Tensor, max_new_A: torch.Tensor) -> None:
        """Token t_A[i] of row rows_A[i], for the rows that have not finished; a row ends at EOS or at its own
        max_new_tokens. Finished rows' entries are left as they are (t_A may then be past their end)."""
        live_A = ~self.done_B[rows_A]
        t_A = t_A.clamp(max=self.tokens_BT.shape[1] - 1)
        self.tokens_BT[rows_A, t_A] = torch.where(live_A, token_A, self.tokens_BT[rows_A, t_A])
        self.logp_BT[rows_A, t_A] = torch.where(live_A, logp_A.float(), self.logp_BT[rows_A, t_A])
        stopped_A = live_A & eos_V[token_A]
        ended_A = stopped_A | (live_A & (max_new_A <= t_A + 1))
        self.length_B[rows_A] = torch.where(ended_A, t_A + 1, self.length_B[rows_A])
        self.stopped_B[rows_A] |= stopped_A
        self.done_B[rows_A] |= ended_A

    def stop(self, row: int, t: int) -> None:
        """A host-side check (a stop string) ends the row after its token t."""
        self.length_B[row], self.stopped_B[row], self.done_B[row] = t + 1, True, True


@dataclass
class CallRows:
    """The call's rows (prompt-major: row b belongs to prompt b // G): their settings and random streams."""

    params: RowParams  # [B]
    keys_B: torch.Tensor
    seed: int | torch.Tensor  # one for all rows, or int64 [B]
    eos_V: torch.Tensor  # bool [V]
    G: int
    plan: DrawPlan | None  # None: decided per draw from the drawing rows (host loop)

    def draw(self, logits_AV: torch.Tensor, rows_A: torch.Tensor, t_A: torch.Tensor,
             settings: RowParams | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Token t_A of rows rows_A from their logits; settings: the rows' own unless given (think phases)."""
        params = self.params.select(rows_A) if settings is None else settings
        banned_A = params.min_new_A > t_A if self.plan is None or self.plan.banned else None
        seed = self.seed if isinstance(self.seed, int) else self.seed[rows_A]
        u_A = counter_uniform(seed, self.keys_B[rows_A], t_A)
        return sample_tokens(logits_AV, params, u_A, banned_A, self.eos_V, self.plan)


class HostHooks:
    """What looks at every drawn token on the host: on_token(row, token) callbacks, stop strings (a hit ends the
    row, reason 'stop') and think phases (the settings a row draws with inside a span). Any of them may be off."""

    def __init__(self, call: CallRows, stops: StopStrings | None, on_token: Callable[[int, int], None] | None,
                 phases: RowPhases | None):
        self.call, self.stops, self.on_token, self.phases = call, stops, on_token, phases
        self.tokens: dict[int, list[int]] = {}  # each call row's tokens so far, on the host

    def settings(self, rows_A: torch.Tensor, t_A: torch.Tensor) -> RowParams | None:
        """The settings rows_A draw token t_A with: None (their own) unless they have think phases."""
        return None if self.phases is None else self.phases.settings(self.call.params.select(rows_A), rows_A, t_A)

    def seen(self, rows_A: torch.Tensor, t_A: torch.Tensor, rows: RowsOnDevice) -> None:
        """Token t_A[i] of row rows_A[i] was just recorded. Reads back those tokens only and keeps each row's
        tokens on the host (`self.tokens`), so a step costs O(rows) however long the rows have grown."""
        if self.on_token is None and self.stops is None and self.phases is None:
            return
        rows_list, t_list = rows_A.tolist(), t_A.tolist()
        new_tokens = rows.tokens_BT[rows_A, t_A.clamp(max=rows.tokens_BT.shape[1] - 1)].tolist()
        for row, t, token in zip(rows_list, t_list, new_tokens):
            tokens = self.tokens.setdefault(row, [])
            del tokens[t:]  # a row's tokens arrive in order from t = 0 (a new call's rows start again)
            tokens.append(token)
            if self.on_token is not None:
                self.on_token(row, token)
            if self.stops is not None and self.stops.hit(row, tokens):
                rows.stop(row, t)
        if self.phases is not None:
            self.phases.advance(self.tokens, rows_list)


def all_finished(done_B: torch.Tensor) -> list[bool]:
    """Which slots have finished (done_B [S, G] of their rows): the loop's read back to the host (a GPU sync)."""
    return done_B.all(-1).tolist()


class Slots:
    """Which prompt each of S slots decodes (host), the call row of each slot row and each slot's step (device)."""

    def __init__(self, S: int, G: int, device):
        self.S, self.G = S, G
        self.prompt_S: list[int | None] = [None] * S
        self.rows_B = torch.zeros(S * G, dtype=torch.long, device=device)  # the call row each slot row decodes
        self.t_S = torch.zeros(S, dtype=torch.long, device=device)
        self.prompt_len_B = torch.zeros(S * G, dtype=torch.long, device=device)
        self.token_B = torch.zeros(S * G, dtype=torch.long, device=device)  # what each slot row feeds next

    def slot_rows(self, slots: list[int]) -> torch.Tensor:
        """The slot rows (s * G + g) of these slots."""
        return (torch.tensor(slots, dtype=torch.long)[:, None] * self.G + torch.arange(self.G)).reshape(-1).to(self.rows_B.device)

    def place(self, slots: list[int], prompts: list[int], prompt_len_n: torch.Tensor) -> torch.Tensor:
        """Prompts into slots (their step back to 0) -> the slot rows they take."""
        slot_rows = self.slot_rows(slots)
        prompts_n = torch.tensor(prompts, dtype=torch.long, device=slot_rows.device)
        self.rows_B[slot_rows] = (prompts_n[:, None] * self.G + torch.arange(self.G, device=slot_rows.device)).reshape(-1)
        self.prompt_len_B[slot_rows] = prompt_len_n.repeat_interleave(self.G)
        self.t_S[torch.tensor(slots, device=slot_rows.device)] = 0
        for slot, prompt in zip(slots, prompts):
            self.prompt_S[slot] = prompt
        return slot_rows


# admit(slots, prompts) -> the prompts' next-token logits [n, V]: prefill them into those slots (and route them)
Admit = Callable[[list[int], list[int]], torch.Tensor]
# step(slots, live_rows) -> the (token, logp) drawn by the slot rows it ran, and which slot rows those are.
# live_rows: the slot rows that have not finished, given in the host loop (which runs only those)
Step = Callable[[Slots, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def advance(call: CallRows, slots: Slots, step: Step, rows: RowsOnDevice, host: HostHooks | None) -> None:
    """One step of every slot: draw each row's next token, record it, move the live slots on. Without host hooks
    this is all device work: no read back to the host."""
    live_rows_B = None if host is None else (~rows.done_B[slots.rows_B]).nonzero().squeeze(-1)
    token_A, logp_A, ran_A = step(slots, live_rows_B)
    t_next_A = (slots.t_S + 1).repeat_interleave(call.G)[ran_A]
    call_rows_A = slots.rows_B[ran_A]
    rows.record(call_rows_A, token_A, logp_A, t_next_A, call.eos_V, call.params.max_new_A[call_rows_A])
    if host is not None:  # the step ran the live rows only
        host.seen(call_rows_A, t_next_A, rows)
    slots.token_B[ran_A] = token_A
    # every slot moves on, a finished one too: the fixed-shape step still feeds it (its rows' last tokens), and each
    # feed must land past what its rows keep (slot_row_caches: positions before a row's last token), never on it;
    # the generated cache ends at position max_new - 1, which is past every row's kept positions
    slots.t_S.add_(1).clamp_(max=rows.tokens_BT.shape[1] - 1)


def decode(call: CallRows, slots: Slots, num_prompts: int, admit: Admit, step: Step, rows: RowsOnDevice,
           host: HostHooks | None, release: Callable[[int], None] | None = None, continuous: bool = True) -> RowsOnDevice:
    """Decode every prompt's G rows: fill the slots, step, refill finished slots from the queue, until all rows of
    all prompts have finished. host: read each token back (HostHooks), else read the finished flags once every
    CHECK_EVERY steps. release(slot): called before a finished slot is reused or at the end (its caches).
    continuous=False refills only when every slot has finished (fixed chunks of S prompts: the baseline)."""
    G, queue = call.G, list(range(num_prompts))
    live_S = [False] * slots.S
    # the step by which a slot has surely finished (its rows' max_new_tokens): a read then refills it at once
    max_new_P = call.params.max_new_A.view(num_prompts, G).amax(-1).tolist()
    deadline_S = [0] * slots.S

    def refill(free: list[int]) -> None:
        taken, queue[:] = queue[:len(free)], queue[len(free):]
        if not taken:
            return
        free = free[:len(taken)]
        for slot in free:
            if release is not None and slots.prompt_S[slot] is not None:
                release(slot)
        logits_nV = admit(free, taken)
        slot_rows = slots.slot_rows(free)
        call_rows = slots.rows_B[slot_rows]
        zeros = torch.zeros_like(call_rows)
        settings = None if host is None else host.settings(call_rows, zeros)
        token, logp = call.draw(logits_nV.repeat_interleave(G, dim=0), call_rows, zeros, settings)
        rows.record(call_rows, token, logp, zeros, call.eos_V, call.params.max_new_A[call_rows])
        if host is not None:
            host.seen(call_rows, zeros, rows)
        slots.token_B[slot_rows] = token
        for slot, prompt in zip(free, taken):
            live_S[slot], deadline_S[slot] = True, steps + max_new_P[prompt] - 1

    steps = 0
    refill(list(range(slots.S)))
    while True:
        due = min((deadline_S[s] for s in range(slots.S) if live_S[s]), default=steps)
        if host is not None or (steps > 0 and steps % CHECK_EVERY == 0) or steps >= due:
            while True:  # again after a refill: a new prompt's rows may all end at their first token
                finished = all_finished(rows.done_B[slots.rows_B].view(slots.S, G))
                free = [s for s in range(slots.S) if finished[s]]
                for s in free:
                    live_S[s] = False
                if not (free and queue and (continuous or len(free) == slots.S)):
                    break
                refill(free)
            if not any(live_S):
                break
        advance(call, slots, step, rows, host)
        steps += 1
    if release is not None:
        for slot in range(slots.S):
            if slots.prompt_S[slot] is not None:
                release(slot)
    return rows
