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

from rlora.serve.prompt_scores import PromptScores, TargetCells
from rlora.serve.state import ServeError

PROTO = "application/x-protobuf"
_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass
class Datum:
    """One sequence of a forward_backward: its input tokens and its loss inputs, each a 1-D array of the
    same length (position i of the input predicts target_tokens[i])."""

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


def _tensor(msg: pb.Tensor, name: str) -> np.ndarray:
    """A loss input: dense, 1-D ([n] or no shape). Anything else is refused before anything is allocated (a
    sparse tensor's declared shape could be any size)."""
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise ServeError(400, f"loss_fn_inputs['{name}']: dtype {msg.dtype} is not float32, int64 or int32")
    if msg.HasField("sparse_csr"):
        raise ServeError(400, f"loss_fn_inputs['{name}']: a sparse tensor; loss inputs are dense, one value per token")
    size, rest = divmod(len(msg.dense), np.dtype(dtype).itemsize)
    if rest:
        raise ServeError(400, f"loss_fn_inputs['{name}']: {len(msg.dense)} bytes are not whole {np.dtype(dtype).name} values")
    if list(msg.shape) not in ([], [size]):
        raise ServeError(400, f"loss_fn_inputs['{name}']: shape {list(msg.shape)}, not [{size}] (one value per input token)")
    return np.frombuffer(msg.dense, dtype=dtype)


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
    data = []
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
        inputs = {name: _tensor(tensor, name) for name, tensor in datum.loss_fn_inputs.items()}
        for name, array in inputs.items():
            if array.ndim != 1 or len(array) != len(tokens):
                raise ServeError(400, f"datum {i}: loss_fn_inputs['{name}'] has shape {list(array.shape)}, not "
                                      f"[{len(tokens)}] (one value per input token)")
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
    """The SDK's ForwardBackwardOutput: per datum {'logprobs': [N] float32}; metric names 'NAME:REDUCTION' (the
    SDK splits every key at ':' to combine chunks)."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(logprobs))
    record.fields["logprobs"].CopyFrom(_batched(logprobs, np.float32, pb.DTYPE_FLOAT32))
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    out.loss_fn_outputs.append(record)
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
