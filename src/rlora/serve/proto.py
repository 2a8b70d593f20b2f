"""The protobuf half of the wire: forward_backward requests in, forward_backward and sample results out.

tinker==0.38.0 always sends forward_backward as `application/x-protobuf` (tinker/proto/request_conv.py) and
refuses a JSON result for forward_backward and sample ("this SDK version only supports [them] as proto",
tinker/lib/api_future_impl.py), so these three payloads are protobuf whatever the server prefers. The message
classes are the SDK's own generated module (tinker/proto/tinker_public_pb2.py), so the field numbers are the
SDK's by construction. Tokens travel as int32 bytes, tensors as raw little-endian bytes with a dtype and shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from rlora.serve.prompt_scores import PromptScores, TargetCells, csr_fits
from rlora.serve.state import ServeError

PROTO = "application/x-protobuf"
_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass
class Datum:
    """One sequence of a forward_backward: its input tokens and its loss inputs, each an array of the same length
    ([n], or [n, K] for K targets per position; position i of the input predicts target_tokens[i])."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int | None  # the SDK's per-client request order; 0 on the wire is unset
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


MAX_COLUMNS = 1024  # K of a [n, K] loss input (several targets at a position: cross_entropy's target_tokens, weights)
# n x K of a request's [n, K] loss inputs together (a sparse one is made dense; its log-probs answer as [n, K] too)
MAX_COLUMN_CELLS = 1 << 24


class _CellBudget:
    """What is left of MAX_COLUMN_CELLS for a request's [n, K] loss inputs."""

    def __init__(self):
        self.left = MAX_COLUMN_CELLS

    def spend(self, cells: int, name: str) -> None:
        self.left -= cells
        if self.left < 0:
            raise ServeError(400, f"loss_fn_inputs['{name}']: the request's [n, K] loss inputs hold more than "
                                  f"{MAX_COLUMN_CELLS} values together: send fewer targets per token or fewer data")


def _tensor(msg: pb.Tensor, name: str, rows: int, budget: _CellBudget) -> np.ndarray:
    """A loss input of a datum of `rows` input tokens: dense [n] (or no shape), or [n, K] (K values at each
    position) dense or sparse CSR (what the SDK sends for a mostly-zero [n, K] tensor, e.g. forward_backward_custom's
    weights), densified with 0. A sparse tensor's declared shape is checked against the datum before anything is
    allocated (it could be any size)."""
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise ServeError(400, f"loss_fn_inputs['{name}']: dtype {msg.dtype} is not float32, int64 or int32")
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        if len(shape) != 2 or shape[0] != rows or not 1 <= shape[1] <= MAX_COLUMNS:
            raise ServeError(400, f"loss_fn_inputs['{name}']: a sparse tensor of shape {shape}: it must be [{rows}, K] "
                                  f"(K values per input token, 1 <= K <= {MAX_COLUMNS})")
        budget.spend(shape[0] * shape[1], name)  # before it is made dense
        return _dense_from_csr(msg.sparse_csr, dtype, shape, name)
    size, rest = divmod(len(msg.dense), np.dtype(dtype).itemsize)
    if rest:
        raise ServeError(400, f"loss_fn_inputs['{name}']: {len(msg.dense)} bytes are not whole {np.dtype(dtype).name} values")
    if len(shape) == 2 and 1 <= shape[1] <= MAX_COLUMNS and shape[0] * shape[1] == size:
        budget.spend(size, name)
        return np.frombuffer(msg.dense, dtype=dtype).reshape(shape)
    if shape not in ([], [size]):
        raise ServeError(400, f"loss_fn_inputs['{name}']: shape {shape} with {size} values: it must be [n] (a value per "
                              f"input token) or [n, K] (K values per input token, 1 <= K <= {MAX_COLUMNS})")
    return np.frombuffer(msg.dense, dtype=dtype)


def _dense_from_csr(csr: pb.SparseCsr, dtype, shape: list[int], name: str) -> np.ndarray:
    rows, width = shape
    item = np.dtype(dtype).itemsize
    if len(csr.values) % item or len(csr.crow_indices) % 8 or len(csr.col_indices) % 8:
        raise ServeError(400, f"loss_fn_inputs['{name}']: sparse values or indices are not whole values")
    values = np.frombuffer(csr.values, dtype=dtype)
    crow, col = np.frombuffer(csr.crow_indices, dtype=np.int64), np.frombuffer(csr.col_indices, dtype=np.int64)
    if not csr_fits(crow, col, len(values), rows, width):
        raise ServeError(400, f"loss_fn_inputs['{name}']: the sparse CSR indices do not describe {len(values)} values of "
                              f"a [{rows}, {width}] tensor (crow_indices: {rows + 1} non-decreasing row pointers from 0 "
                              f"to the value count; col_indices: a column below {width} per value, ascending within a row)")
    dense = np.zeros((rows, width), dtype=dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense


def parse_forward_backward(body: bytes) -> ForwardBackward:
    """A forward_backward body -> its requests, checked for shape (not yet against the model or the loss)."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as err:
        raise ServeError(400, f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({err})") from None
    if not msg.model_id:
        raise ServeError(400, "forward_backward: no model_id")
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():  # the newer map wins where both are set
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data, budget = [], _CellBudget()
    for i, datum in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise ServeError(400, f"datum {i}: a {chunk.WhichOneof('chunk')} chunk; rlora serve takes token chunks only")
            raw = chunk.encoded_text.tokens
            if len(raw) % 4:
                raise ServeError(400, f"datum {i}: {len(raw)} bytes of tokens are not whole int32 values")
            tokens.extend(np.frombuffer(raw, dtype=np.int32).tolist())
        if not tokens:
            raise ServeError(400, f"datum {i}: no input tokens")
        inputs = {name: _tensor(tensor, name, len(tokens), budget) for name, tensor in datum.loss_fn_inputs.items()}
        for name, array in inputs.items():
            if len(array) != len(tokens):
                raise ServeError(400, f"datum {i}: loss_fn_inputs['{name}'] has shape {list(array.shape)}, not "
                                      f"[{len(tokens)}] or [{len(tokens)}, K] (values per input token)")
        data.append(Datum(tokens, inputs))
    if not data:
        raise ServeError(400, "forward_backward: no data")
    return ForwardBackward(msg.model_id, msg.seq_id or None, msg.loss_fn, config, msg.forward_only, data)


def _batched(arrays: list[np.ndarray], dtype: np.dtype, proto_dtype) -> pb.BatchedTensor:
    """Per-datum 1-D arrays -> one BatchedTensor: the bytes end to end, byte offsets of each datum."""
    parts = [np.asarray(a, dtype=dtype) for a in arrays]
    offsets = np.cumsum([0] + [p.nbytes for p in parts]).astype(np.int64)
    return pb.BatchedTensor(data=b"".join(p.tobytes() for p in parts), offsets=offsets.tobytes(), dtype=proto_dtype)


def forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """The SDK's ForwardBackwardOutput: per datum {'logprobs': [N] or [N, K] float32}, one ArrayRecord per run of
    consecutive data with the same trailing shape (the SDK joins the records in order); metric names
    'NAME:REDUCTION' (the SDK splits every key at ':' to combine chunks)."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    start = 0
    while start < len(logprobs):
        end = start + 1
        while end < len(logprobs) and logprobs[end].shape[1:] == logprobs[start].shape[1:]:
            end += 1
        record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=end - start)
        field = _batched(logprobs[start:end], np.float32, pb.DTYPE_FLOAT32)
        field.trailing_shape.extend(logprobs[start].shape[1:])
        record.fields["logprobs"].CopyFrom(field)
        out.loss_fn_outputs.append(record)
        start = end
    return out.SerializeToString()


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop: bool  # False: it ran to max_tokens
    topk: tuple[np.ndarray, np.ndarray] | None = None  # topk_sample_logprobs: ids [n, k] int32, log-probs [n, k]


def _topk(ids_NK: np.ndarray, logp_NK: np.ndarray) -> pb.TopkLogprobs:
    return pb.TopkLogprobs(token_ids=np.ascontiguousarray(ids_NK, dtype=np.int32).tobytes(),
                           logprobs=np.ascontiguousarray(logp_NK, dtype=np.float32).tobytes(), k=ids_NK.shape[1],
                           length=ids_NK.shape[0])


def _dense(array: np.ndarray, dtype) -> pb.Tensor:
    return pb.Tensor(dense=np.ascontiguousarray(array).tobytes(), dtype=dtype, shape=list(array.shape))


def _targets(cells: TargetCells, values_N: np.ndarray) -> pb.Tensor:
    """The target log-probs in the request's layout: dense row-major, or CSR with the request's indices."""
    if cells.crow is None:
        return _dense(values_N.astype(np.float32).reshape(cells.shape), pb.DTYPE_FLOAT32)
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(cells.shape), sparse_csr=pb.SparseCsr(
        values=values_N.astype(np.float32).tobytes(), crow_indices=cells.crow.astype(np.int64).tobytes(),
        col_indices=cells.col.astype(np.int64).tobytes()))


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None,
                    scores: PromptScores | None = None, targets: TargetCells | None = None) -> bytes:
    """scores: what the request asked of its prompt beside its log-probs (prompt_scores.py): the top-k of every
    prompt position (the SDK's empty cell, token 0 and log-prob -99999.0, where nothing is scored), the targets'
    log-probs (in `targets`' layout), the draws."""
    out = pb.SampleResponse()
    for seq in sequences:
        out.sequences.add(stop_reason=pb.STOP_REASON_STOP if seq.stop else pb.STOP_REASON_LENGTH,
                          tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
                          logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes(),
                          topk_sampled_logprobs=None if seq.topk is None else _topk(*seq.topk))
    if prompt_logprobs is not None:  # NaN where nothing is scored (the first prompt token)
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    scores = scores or PromptScores()
    if scores.topk is not None:
        out.topk_prompt_logprobs.CopyFrom(_topk(*scores.topk))
    if scores.target_values_N is not None:
        out.target_prompt_logprobs.CopyFrom(_targets(targets, scores.target_values_N))
    if scores.draws is not None:
        tokens, logprobs = scores.draws
        out.prompt_alt_tokens.CopyFrom(pb.PromptAltTokens(tokens=_dense(tokens.astype(np.int64), pb.DTYPE_INT64),
                                                          logprobs=_dense(logprobs.astype(np.float32), pb.DTYPE_FLOAT32)))
    return out.SerializeToString()
