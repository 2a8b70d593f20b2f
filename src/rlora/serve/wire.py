"""The JSON payloads of the tinker SDK (tinker==0.38.0), as the server reads and writes them.

Read off the SDK's own request and response types (tinker/types/*.py) and the resources that send them
(tinker/resources/*.py). Requests ignore fields this server does not use (a newer SDK may send more), but a
field it uses must have the right type: a malformed payload is a 422 with pydantic's message, never a crash.
forward_backward requests and the results of forward_backward and sample travel as protobuf (serve/proto.py):
this SDK version sends and accepts nothing else for them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# the SDK's ClientConfigResponse: the flags that make it talk the simplest way this server speaks
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,  # no JWT exchange: the SDK sends its API key (X-API-Key) on every request
    "credential_default_source": "api_key",
    "use_pyqwest_transport": False,  # plain httpx
    "proto_compress_fwdbwd": False,  # no zstd bodies
    "parallel_fwdbwd_chunks": False,  # a call's chunks are submitted one after another: arrival order is seq order
    "sample_use_retrieve_futures": False,  # one retrieve_future per sample, no session-wide poller
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,  # forward_backward_custom runs the loss in the client (forward + cross_entropy)
}
DYNAMIC_CONFIG = {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


class Request(BaseModel):
    # no NaN or infinity in any number (JSON's Infinity, 1e999): a learning rate of inf would ruin an adapter
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)


class CreateSession(Request):
    tags: list[str] = []
    user_metadata: dict | None = None
    sdk_version: str = ""


class SessionHeartbeat(Request):
    session_id: str


class LoraSpec(Request):
    rank: int = Field(ge=1, le=1024)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Request):
    type: str = "adamw"


class CreateModel(Request):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    lora_config: LoraSpec | None = None
    optimizer_config: OptimizerConfig = OptimizerConfig()


class GetInfo(Request):
    model_id: str


class AdamParams(Request):
    """The SDK's AdamParams (torch.optim.AdamW semantics; its defaults)."""

    learning_rate: float = Field(1e-4, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)  # 0: no clipping


class OptimStep(Request):
    # the SDK renames optim_params to adam_params (Adam) or optimizer_params (other families) on the wire
    adam_params: AdamParams | None = None
    optimizer_params: dict | None = None
    model_id: str
    seq_id: int | None = None


class SaveWeightsForSampler(Request):
    model_id: str
    path: str | None = None  # a name; None: an unnamed snapshot answered with a sampling session id
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None  # a named one expires after this (None: never)


class SaveWeights(Request):
    model_id: str
    path: str | None = None  # the checkpoint's name
    seq_id: int | None = None
    overwrite: bool = False
    ttl_seconds: int | None = None  # the checkpoint expires after this (None: never)


class LoadWeights(Request):
    """Into an existing training client (model_id + seq_id), or a new one (session_id + model_seq_id:
    create_training_client_from_state)."""

    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = Field(None, ge=0)
    base_model: str | None = None
    optimizer_config: OptimizerConfig | None = None


class CreateSamplingSession(Request):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = None
    model_path: str | None = None


class EncodedTextChunk(Request):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[int]


class ModelInput(Request):
    chunks: list[EncodedTextChunk]

    def tokens(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.tokens]


class SamplingParams(Request):
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[int] | list[str] | None = None  # None: EOS; []: nothing stops a sample but max_tokens
    temperature: float = Field(1.0, ge=0)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)


class TensorData(Request):
    """tinker's TensorData: a flat list of values with a shape, dense or sparse CSR (the listed values only)."""
    data: list[int] | list[float]
    dtype: str
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class Sample(Request):
    num_samples: int = Field(1, ge=1)
    prompt: ModelInput
    sampling_params: SamplingParams
    sampling_session_id: str | None = None
    base_model: str | None = None
    model_path: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: TensorData | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None


class RetrieveFuture(Request):
    request_id: str
    allow_metadata_only: bool = False


class Finish(Request):
    reason: dict | None = None
    detail: str | None = None


def untyped_future(request_id: str, model_id: str | None = None, sequence_ids: list[str] | None = None) -> dict:
    """The SDK's UntypedAPIFuture: what every queued request is answered with at once."""
    out: dict = {"request_id": request_id}
    if model_id is not None:
        out["model_id"] = model_id
    if sequence_ids is not None:
        out["sample_sequence_ids"] = sequence_ids
    return out


def try_again(request_id: str) -> dict:
    return {"type": "try_again", "request_id": request_id, "queue_state": "active"}


def failed(message: str, user: bool) -> dict:
    """The SDK's RequestFailedResponse; category 'user' (the request was wrong) or 'server' (this server failed)."""
    return {"error": message, "category": "user" if user else "server"}


class Adam(BaseModel):
    """An optim_step's parameters as the worker applies them."""

    model_config = ConfigDict(frozen=True)
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    grad_clip_norm: float

    @classmethod
    def of(cls, params: AdamParams) -> Adam:
        return cls(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                   weight_decay=params.weight_decay, grad_clip_norm=params.grad_clip_norm)

