"""What a sample request may ask beside its samples (tinker's SampleRequest): the k most likely tokens at every prompt
position (`topk_prompt_logprobs`), the log-probs of named tokens at named prompt positions (`target_prompt_logprobs`,
dense or sparse CSR: how tinker-cookbook's decision recipe reads a choice's probability), k draws at every prompt
position (`prompt_alt_tokens_k`) and the k most likely tokens at every sampled position (`topk_sample_logprobs`).

`check_asks` refuses a malformed ask when the request arrives (a 400 that names it); the worker then computes every
prompt-side ask from one forward of the prompt (`score_prompt`) and the samples' top-k from one forward of the
samples (`sampled_topk`), the output layer a chunk of positions at a time, so no pass holds [positions, vocabulary]
logits whole. Prompt-side log-probs are at temperature 1, as the prompt log-probs; the draws and the samples' top-k
are at the request's temperature (temperature 0: the most likely token, log-probs at 1), as a sample's own log-probs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from rlora.models.loading import causal_lm
from rlora.models.logprobs import supports_chunked
from rlora.serve.logprobs import HEAD_CHUNK
from rlora.serve.state import ServeError
from rlora.tensors import position_ids_from_mask

MAX_K = 1024  # the most columns of any top-k, target or draw matrix (and at most the vocabulary for a top-k)
# topk_sample_logprobs entries of one request (8 bytes each: 128 MiB, well under protobuf's 2 GiB message)
MAX_SAMPLE_TOPK_CELLS = 1 << 24
SAMPLE_TOPK_TOKENS = 4096  # padded positions of one teacher-forced forward of samples (rows are split to stay under)
EMPTY_LOGPROB = -99999.0  # the SDK's empty cell of a top-k matrix (tinker.types.topk_logprobs MASK_LOGPROB, id 0)


@dataclass(frozen=True)
class TargetCells:
    """target_prompt_logprobs as asked: each value's row (row i scores prompt position i + 1) and token id (-1: a
    placeholder, answered 0.0), in the request's value order; CSR row pointers and columns where it was sparse (the
    answer keeps its layout)."""

    shape: tuple[int, int]
    rows_N: np.ndarray  # int64
    ids_N: np.ndarray  # int64
    crow: np.ndarray | None = None  # int64 [rows + 1]; None: dense, row-major
    col: np.ndarray | None = None  # int64 [N]


@dataclass(frozen=True)
class Draws:
    """prompt_alt_tokens_k: k draws at every prompt position after the first."""

    k: int
    temperature: float
    greedy: bool
    seed: int


@dataclass
class PromptScores:
    topk: tuple[np.ndarray, np.ndarray] | None = None  # token ids [N, k] int32, log-probs [N, k] float32
    target_values_N: np.ndarray | None = None  # float32, one per TargetCells value
    draws: tuple[np.ndarray, np.ndarray] | None = None  # token ids [N - 1, k] int64, log-probs [N - 1, k] float32


def parse_targets(tensor, prompt_length: int, vocab_size: int) -> TargetCells:
    """The request's TensorData (wire.TensorData) -> TargetCells, or a 400 that says what is wrong."""
    what = "asample: target_prompt_logprobs"
    rows = prompt_length - 1
    if tensor.dtype != "int64":
        raise ServeError(400, f"{what} must hold int64 token ids, not {tensor.dtype}")
    if tensor.shape is None or len(tensor.shape) != 2 or tensor.shape[0] != rows or not 1 <= tensor.shape[1] <= MAX_K:
        raise ServeError(400, f"{what} has shape {tensor.shape}: it must be [{rows}, K] (a row per prompt position after "
                              f"the first) with 1 <= K <= {MAX_K}")
    values_N = _float64(tensor.data, what)
    if not (values_N == np.round(values_N)).all():
        raise ServeError(400, f"{what} holds a value that is not a whole number: it holds token ids")
    bad = values_N[(values_N != -1) & ((values_N < 0) | (values_N >= vocab_size))]
    if len(bad):
        raise ServeError(400, f"{what}: token id {int(bad[0])} is outside the vocabulary (0 .. {vocab_size - 1}; -1 asks "
                              "nothing)")
    ids_N, width = values_N.astype(np.int64), tensor.shape[1]
    if tensor.sparse_crow_indices is None and tensor.sparse_col_indices is None:
        if len(ids_N) != rows * width:
            raise ServeError(400, f"{what}: {len(ids_N)} values for shape [{rows}, {width}]")
        return TargetCells((rows, width), np.repeat(np.arange(rows), width), ids_N)
    crow, col = _float64(tensor.sparse_crow_indices or [], what), _float64(tensor.sparse_col_indices or [], what)
    if not csr_fits(crow, col, len(ids_N), rows, width):
        raise ServeError(400, f"{what}: the sparse CSR indices do not describe {len(ids_N)} values of a "
                              f"[{rows}, {width}] tensor (sparse_crow_indices: {rows + 1} non-decreasing row pointers "
                              f"from 0 to the value count; sparse_col_indices: a column below {width} per value, "
                              "ascending and distinct within a row)")
    crow, col = crow.astype(np.int64), col.astype(np.int64)
    return TargetCells((rows, width), np.repeat(np.arange(rows), np.diff(crow)), ids_N, crow, col)


def _float64(values: list, what: str) -> np.ndarray:
    """JSON numbers as float64 (exact for any index or token id; an int64 conversion of 10**30 would raise)."""
    try:
        return np.asarray(values, dtype=np.float64).reshape(-1)
    except OverflowError:  # an integer past float64's range (10**400): nothing a tensor index or token id can be
        raise ServeError(400, f"{what}: a number too large to be a token id or an index") from None


def csr_fits(crow: np.ndarray, col: np.ndarray, count: int, rows: int, width: int) -> bool:
    """Whether CSR row pointers and columns describe `count` values of a [rows, width] tensor: rows + 1 pointers from
    0 to count, non-decreasing (compared, never subtracted: an int64 difference can wrap around), a column below
    width per value, ascending and distinct within each row (torch's invariants, which the SDK's to_torch checks)."""
    if (len(crow) != rows + 1 or len(col) != count or ((crow < 0) | (crow > count)).any() or crow[0] != 0
            or crow[-1] != count or (crow[1:] < crow[:-1]).any() or (count and not 0 <= col.min() <= col.max() < width)):
        return False
    within = np.ones(max(count - 1, 0), dtype=bool)
    starts = crow[1:-1][(crow[1:-1] > 0) & (crow[1:-1] < count)].astype(np.int64)
    within[starts - 1] = False  # between the last column of one row and the first of the next
    return bool((np.diff(col)[within] > 0).all())


def check_asks(body, prompt_length: int, vocab_size: int) -> TargetCells | None:
    """The k's and the targets of a sample request, checked against its prompt and the vocabulary -> its targets."""
    top = min(MAX_K, vocab_size)
    for name, k, most in [("topk_prompt_logprobs", body.topk_prompt_logprobs, top),
                          ("topk_sample_logprobs", body.topk_sample_logprobs, top),
                          ("prompt_alt_tokens_k", body.prompt_alt_tokens_k, MAX_K)]:
        if not 0 <= k <= most:
            raise ServeError(400, f"asample: {name} {k} is outside 0 .. {most}")
    cells = body.topk_sample_logprobs * body.num_samples * body.sampling_params.max_tokens
    if cells > MAX_SAMPLE_TOPK_CELLS:
        raise ServeError(400, f"asample: topk_sample_logprobs {body.topk_sample_logprobs} x num_samples "
                              f"{body.num_samples} x max_tokens {body.sampling_params.max_tokens} = {cells} entries, "
                              f"over {MAX_SAMPLE_TOPK_CELLS}: ask for a smaller k or fewer samples or tokens")
    if body.target_prompt_logprobs is None:
        return None
    return parse_targets(body.target_prompt_logprobs, prompt_length, vocab_size)


def _position_logits(model: nn.Module, ids_BT: torch.Tensor, mask_BT: torch.Tensor, keep_BT: torch.Tensor
                     ) -> Iterator[tuple[int, torch.Tensor]]:
    """One forward of the rows -> (n, logits [C, V] float32) of the kept positions, in row-major order, C at a time
    (n: how many kept positions come before the chunk). Right padding; positions from the mask."""
    hf = causal_lm(model)
    position_ids = position_ids_from_mask(mask_BT)
    if not supports_chunked(model):  # a family whose output is not the output layer of the last hidden state
        logits = model(input_ids=ids_BT, attention_mask=mask_BT, position_ids=position_ids, use_cache=False).logits
        yield 0, logits[keep_BT].float()
        return
    hidden_NH = hf.get_decoder()(input_ids=ids_BT, attention_mask=mask_BT, position_ids=position_ids,
                                 use_cache=False).last_hidden_state[keep_BT]
    head = hf.get_output_embeddings()
    for lo in range(0, len(hidden_NH), HEAD_CHUNK):
        yield lo, head(hidden_NH[lo:lo + HEAD_CHUNK]).float()


def _top(logp_CV: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    top = logp_CV.topk(k, dim=-1)
    return top.indices.cpu().numpy().astype(np.int32), top.values.cpu().numpy()


@torch.no_grad()
def score_prompt(model: nn.Module, prompt: list[int], topk: int = 0, targets: TargetCells | None = None,
                 draws: Draws | None = None) -> PromptScores:
    """Every prompt-side ask of one request from one forward of prompt[:-1] under the model as it is switched now.
    Top-k: position 0, which nothing precedes, is the empty cell."""
    n = len(prompt)
    scores = PromptScores()
    if topk:
        scores.topk = (np.zeros((n, topk), dtype=np.int32), np.full((n, topk), EMPTY_LOGPROB, dtype=np.float32))
    if targets is not None:
        scores.target_values_N = np.zeros(len(targets.ids_N), dtype=np.float32)
    if draws is not None:
        scores.draws = (np.zeros((n - 1, draws.k), dtype=np.int64), np.zeros((n - 1, draws.k), dtype=np.float32))
        generator = torch.Generator().manual_seed(draws.seed)  # on the CPU: the same draws on any device
    if n < 2 or not (topk or targets is not None or draws is not None):
        return scores
    ids = torch.tensor([prompt[:-1]], device=next(model.parameters()).device)
    ones = torch.ones_like(ids)
    for lo, logits_CV in _position_logits(model, ids, ones, ones.bool()):
        hi = lo + len(logits_CV)
        logp_CV = torch.log_softmax(logits_CV, dim=-1)
        if topk:
            ids_CK, logp_CK = _top(logp_CV, topk)
            scores.topk[0][1 + lo:1 + hi], scores.topk[1][1 + lo:1 + hi] = ids_CK, logp_CK
        if targets is not None:
            here = np.nonzero((targets.rows_N >= lo) & (targets.rows_N < hi) & (targets.ids_N >= 0))[0]
            rows = torch.as_tensor(targets.rows_N[here] - lo, device=logp_CV.device)
            cols = torch.as_tensor(targets.ids_N[here], device=logp_CV.device)
            scores.target_values_N[here] = logp_CV[rows, cols].cpu().numpy()
        if draws is not None:
            scaled_CV = logp_CV if draws.greedy or draws.temperature == 1 else torch.log_softmax(
                logits_CV / draws.temperature, dim=-1)
            if draws.greedy:
                tokens_CK = scaled_CV.argmax(-1, keepdim=True).expand(-1, draws.k)
            else:
                tokens_CK = torch.multinomial(scaled_CV.exp().cpu(), draws.k, replacement=True, generator=generator)
                tokens_CK = tokens_CK.to(scaled_CV.device)
            scores.draws[0][lo:hi] = tokens_CK.cpu().numpy()
            scores.draws[1][lo:hi] = scaled_CV.gather(-1, tokens_CK).cpu().numpy()
    return scores


@torch.no_grad()
def sampled_topk(model: nn.Module, prompt: list[int], samples: list[list[int]], temperature: float, k: int
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
    """The k most likely tokens at every position of each sample (its tokens teacher-forced after the prompt,
    padded forwards of up to SAMPLE_TOPK_TOKENS positions), log-probs at `temperature` as the sample's own -> per
    sample (ids [n, k] int32, log-probs [n, k] float32)."""
    width = len(prompt) + max(map(len, samples)) - 1
    per_pass = max(1, SAMPLE_TOPK_TOKENS // width)
    return [top for lo in range(0, len(samples), per_pass)
            for top in _sampled_topk(model, prompt, samples[lo:lo + per_pass], temperature, k)]


def _sampled_topk(model, prompt, samples, temperature, k):
    device = next(model.parameters()).device
    rows = [prompt + sample[:-1] for sample in samples]
    width = max(map(len, rows))
    ids_BT = torch.zeros((len(rows), width), dtype=torch.long)
    mask_BT = torch.zeros((len(rows), width), dtype=torch.long)
    keep_BT = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, (row, sample) in enumerate(zip(rows, samples)):
        ids_BT[b, :len(row)], mask_BT[b, :len(row)] = torch.tensor(row), 1
        # the positions that predict the sample's tokens (none for an empty sample)
        keep_BT[b, len(prompt) - 1:len(prompt) - 1 + len(sample)] = True
    ids_parts, logp_parts = [np.zeros((0, k), np.int32)], [np.zeros((0, k), np.float32)]
    for _, logits_CV in _position_logits(model, ids_BT.to(device), mask_BT.to(device), keep_BT.to(device)):
        ids_CK, logp_CK = _top(torch.log_softmax(logits_CV / temperature, dim=-1), k)
        ids_parts.append(ids_CK)
        logp_parts.append(logp_CK)
    ids_NK, logp_NK = np.concatenate(ids_parts), np.concatenate(logp_parts)
    bounds = np.cumsum([0] + [len(sample) for sample in samples])
    return [(ids_NK[a:b], logp_NK[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def only_last(n: int, logprobs: list[float] | None, top: tuple[np.ndarray, np.ndarray] | None):
    """Prompt log-probs and top-k with only the last n positions scored (prompt_logprobs_last_n): the earlier ones
    NaN and the empty cell, as the first position is. The whole prompt is scored all the same (no prefix cache)."""
    if logprobs is not None:
        logprobs = [math.nan] * (len(logprobs) - n) + logprobs[len(logprobs) - n:]
    if top is not None:
        ids_NK, logp_NK = top[0].copy(), top[1].copy()
        ids_NK[:len(ids_NK) - n], logp_NK[:len(ids_NK) - n] = 0, EMPTY_LOGPROB
        top = (ids_NK, logp_NK)
    return logprobs, top
