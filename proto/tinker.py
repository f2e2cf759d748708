"""The wire of Thinking Machines' Tinker API, the subset `asyncrl tinker` serves
(docs/architecture.md §13), as the `tinker` SDK **0.38.0** sends and reads it.

Checked against the SDK's source (`pip download --no-deps tinker==0.38.0`): `resources/*.py`
(routes), `types/*.py` (JSON bodies), `proto/tinker_public_pb2.py` (the protobuf schema: its
serialized descriptor, field by field), `proto/request_conv.py` and `proto/response_conv.py`
(how it encodes and decodes), `lib/api_future_impl.py` (the future protocol). The service is
the only side of this boundary in the repository; the client is the SDK itself.

JSON everywhere but three places, where the SDK insists on protobuf:
* `POST /api/v1/forward_backward` (forward and forward_backward) arrives as a
  `tinker_public.ForwardBackwardRequest` (`Content-Type: application/x-protobuf`);
  `decode_forward_backward` reads it. The SDK zstd-compresses it only when the client config
  says `proto_compress_fwdbwd`, which this service never does.
* The results of those calls and of a sample are fetched from `retrieve_future` with
  `Accept: application/x-protobuf`, and this SDK refuses a JSON answer for them
  (`PROTO_SUPPORTED_TYPES`): `encode_forward_backward_output` and `encode_sample_response`
  write them.

The codec is written here (protobuf's wire format is varints and length-prefixed fields), so
the service needs no protobuf runtime and no generated code; field numbers are the SDK's.
Unknown fields are skipped, as protobuf does. Provenance spans of a datum (fields 3 and 4) are
metadata for features this service does not have and are skipped too.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

TINKER_SDK_RELEASE = "0.38.0"
PROTOBUF = "application/x-protobuf"

# tinker_public.DType
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = 1, 2, 3, 4
NUMPY_OF_DTYPE = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}
# tinker_public.StopReason
STOP_REASONS = {"stop": 0, "length": 1}

# A checkpoint name (save_weights / save_weights_for_sampler `path`) and a model id in the
# backend: one path segment, never "." or "..", checked where the call arrives and again where
# the backend writes.
CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")

# The loss functions the SDK names (`types/loss_fn_type.py`).
SDK_LOSS_FNS = (
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "stable_reinforce",
    "custom",
)


class WireError(ValueError):
    """A body that is not what the SDK sends (a 400 naming the problem)."""


class Unsupported(WireError):
    """A well-formed request for something this service does not do (a 400 naming it)."""


# --- protobuf wire format ---------------------------------------------------------------------

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5
MAX_VARINT_BYTES = 10
# Cells a call's sparse (CSR) tensors may hold once made dense, all together: a CSR tensor of a
# few bytes may declare any shape, and the dense copy is allocated here, before any other check.
# 16M cells (64 MB of float32) is ~500x a max_tokens_per_call of 32768 top-1 targets.
MAX_DENSE_CELLS = 1 << 24


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    for i in range(MAX_VARINT_BYTES):
        if pos >= len(buf):
            raise WireError("protobuf body ends inside a varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        del i
    raise WireError("protobuf varint longer than 10 bytes")


def fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """The (field number, wire type, value) of a message, in order: an int for a varint, bytes
    for a length-delimited field, the raw 8 or 4 bytes of a fixed one."""
    out, pos = [], 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == VARINT:
            value, pos = _varint(buf, pos)
        elif wire == LENGTH:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise WireError("protobuf field runs past the end of the body")
            value, pos = buf[pos : pos + size], pos + size
        elif wire in (FIXED64, FIXED32):
            width = 8 if wire == FIXED64 else 4
            if pos + width > len(buf):
                raise WireError("protobuf field runs past the end of the body")
            value, pos = buf[pos : pos + width], pos + width
        else:
            raise WireError(f"protobuf wire type {wire} (groups) is not used by the tinker schema")
        out.append((number, wire, value))
    return out


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _ints(wire: int, value: Any) -> list[int]:
    """A repeated integer field's values: packed (one length-delimited run) or not."""
    if wire == VARINT:
        return [_signed64(value)]
    if wire != LENGTH:
        raise WireError(f"a repeated integer field has wire type {wire}")
    out, pos = [], 0
    while pos < len(value):
        v, pos = _varint(value, pos)
        out.append(_signed64(v))
    return out


def _message(buf: bytes) -> dict[int, tuple[int, Any]]:
    """A message's fields by number, `(wire type, value)`, the last one winning (protobuf's rule
    for a field that is not repeated)."""
    return {number: (wire, value) for number, wire, value in fields(buf)}


def _part(message: dict[int, tuple[int, Any]], number: int, what: str) -> bytes:
    """Length-delimited field `number` (empty when absent); a field of another wire type is a
    WireError: the schema has it length-delimited."""
    wire, value = message.get(number, (LENGTH, b""))
    if wire != LENGTH:
        raise WireError(f"{what} has wire type {wire}, not a length-delimited field")
    return bytes(value)


def _double(message: dict[int, tuple[int, Any]], number: int, what: str) -> float:
    wire, value = message.get(number, (FIXED64, b"\0" * 8))
    if wire != FIXED64:
        raise WireError(f"{what} has wire type {wire}, not a double")
    return struct.unpack("<d", value)[0]


def _array(raw: bytes, dtype: Any, what: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise WireError(f"{what}: {len(raw)} bytes are not whole {np.dtype(dtype).name} values")
    return np.frombuffer(raw, dtype=dtype)


def _text(value: Any) -> str:
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("a protobuf string field is not UTF-8") from None


def _put_varint(out: bytearray, value: int) -> None:
    value &= (1 << 64) - 1
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def _put_key(out: bytearray, number: int, wire: int) -> None:
    _put_varint(out, number << 3 | wire)


def _put_bytes(out: bytearray, number: int, data: bytes) -> None:
    _put_key(out, number, LENGTH)
    _put_varint(out, len(data))
    out += data


def _put_int(out: bytearray, number: int, value: int) -> None:
    if value:
        _put_key(out, number, VARINT)
        _put_varint(out, value)


def _put_double(out: bytearray, number: int, value: float) -> None:
    _put_key(out, number, FIXED64)
    out += struct.pack("<d", value)


def _packed(values: list[int]) -> bytes:
    out = bytearray()
    for v in values:
        _put_varint(out, v)
    return bytes(out)


# --- forward / forward_backward requests ------------------------------------------------------


@dataclass
class WireDatum:
    """One datum: its tokens (the encoded_text chunks, concatenated) and loss inputs by name."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    data: list[WireDatum]
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)


@dataclass
class _Budget:
    """The dense cells a call's sparse tensors may still take (`MAX_DENSE_CELLS`)."""

    cells: int = MAX_DENSE_CELLS

    def take(self, cells: int, what: str) -> None:
        if cells > self.cells:
            raise WireError(
                f"{what} is {cells} cells once dense; a call's sparse tensors may take {MAX_DENSE_CELLS} "
                f"in all, {self.cells} are left"
            )
        self.cells -= cells


def _tensor(buf: bytes, name: str, budget: _Budget) -> np.ndarray:
    dense, csr, dtype, shape = None, None, 0, []
    for number, wire, value in fields(buf):
        if number == 1 and wire == LENGTH:
            dense = bytes(value)
        elif number == 2 and wire == LENGTH:
            csr = value
        elif number == 3 and wire == VARINT:
            dtype = value
        elif number == 4:
            shape += _ints(wire, value)
    np_dtype = NUMPY_OF_DTYPE.get(dtype)
    if np_dtype is None:
        raise WireError(f"loss_fn_inputs[{name!r}]: tensor dtype {dtype} is not float32, int64 or int32")
    if any(d < 0 for d in shape):
        raise WireError(f"loss_fn_inputs[{name!r}]: shape {shape} has a negative dimension")
    if csr is not None:
        return _densify(csr, np_dtype, shape, name, budget)
    data = _array(dense or b"", np_dtype, f"loss_fn_inputs[{name!r}]")
    if shape:
        if math.prod(shape) != data.size:
            raise WireError(f"loss_fn_inputs[{name!r}]: shape {shape} does not hold {data.size} values")
        data = data.reshape(shape)
    return data.astype(np.int64 if np_dtype is np.int32 else np_dtype)


def _densify(buf: bytes, np_dtype: Any, shape: list[int], name: str, budget: _Budget) -> np.ndarray:
    """A sparse CSR tensor made dense, unlisted cells 0 (the SDK's `to_numpy()` default)."""
    parts, what = _message(buf), f"loss_fn_inputs[{name!r}] (sparse CSR)"
    values = _array(_part(parts, 1, what), np_dtype, what)
    crow = _array(_part(parts, 2, what), np.int64, what)
    col = _array(_part(parts, 3, what), np.int64, what)
    if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
        raise WireError(f"loss_fn_inputs[{name!r}]: malformed sparse CSR tensor (shape {shape})")
    if (np.diff(crow) < 0).any() or crow[0] != 0 or crow[-1] != len(values):
        raise WireError(f"loss_fn_inputs[{name!r}]: sparse CSR row pointers are not monotone")
    if len(col) and (col.min() < 0 or col.max() >= shape[1]):
        raise WireError(f"loss_fn_inputs[{name!r}]: sparse CSR column index out of range")
    budget.take(math.prod(shape), f"loss_fn_inputs[{name!r}] of shape {shape}")
    dense = np.zeros(shape, dtype=np.int64 if np_dtype is np.int32 else np_dtype)
    rows = np.repeat(np.arange(shape[0]), np.diff(crow))
    dense[rows, col] = values
    return dense


def _datum(buf: bytes, budget: _Budget) -> WireDatum:
    tokens: list[int] = []
    inputs: dict[str, np.ndarray] = {}
    for number, wire, value in fields(buf):
        if number == 1 and wire == LENGTH:
            for chunk_field, chunk_wire, chunk in fields(value):
                if chunk_field == 1:
                    if chunk_wire != LENGTH:
                        raise WireError(f"a model_input chunk has wire type {chunk_wire}")
                    raw = _part(_message(chunk), 1, "an encoded_text chunk's tokens")
                    tokens += _array(raw, np.int32, "an encoded_text chunk's tokens").tolist()
                elif chunk_field == 2:
                    raise Unsupported("image chunks in model_input are not supported (text-only models)")
                elif chunk_field == 3:
                    raise Unsupported("dmel (audio) chunks in model_input are not supported")
        elif number == 2 and wire == LENGTH:
            entry = _message(value)
            name = _text(_part(entry, 1, "a loss_fn_inputs name"))
            inputs[name] = _tensor(_part(entry, 2, f"loss_fn_inputs[{name!r}]"), name, budget)
    return WireDatum(tokens, inputs)


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """A `tinker_public.ForwardBackwardRequest`; `WireError` names what is wrong with it."""
    model_id, seq_id, loss_fn, forward_only = "", 0, "", False
    data: list[WireDatum] = []
    legacy: dict[str, float | str] = {}
    config: dict[str, float | str] = {}
    budget = _Budget()
    for number, wire, value in fields(body):
        if number == 1 and wire == LENGTH:
            model_id = _text(value)
        elif number == 2 and wire == VARINT:
            seq_id = _signed64(value)
        elif number == 3 and wire == LENGTH:
            data.append(_datum(value, budget))
        elif number == 4 and wire == LENGTH:
            loss_fn = _text(value)
        elif number == 5 and wire == LENGTH:
            entry = _message(value)
            legacy[_text(_part(entry, 1, "a loss_fn_config key"))] = _double(
                entry, 2, "a loss_fn_config value"
            )
        elif number == 6 and wire == VARINT:
            forward_only = bool(value)
        elif number == 7 and wire == LENGTH:
            entry = _message(value)
            key = _text(_part(entry, 1, "a loss_fn_config key"))
            arm = _message(_part(entry, 2, f"loss_fn_config[{key!r}]"))
            what = f"loss_fn_config[{key!r}]"
            config[key] = _text(_part(arm, 2, what)) if 2 in arm else _double(arm, 1, what)
    if not model_id:
        raise WireError("forward_backward: model_id is missing")
    return ForwardBackwardCall(model_id, seq_id, loss_fn, forward_only, data, config or legacy)


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A `tinker_public.ForwardBackwardOutput`: one `ArrayRecord` holding every datum's
    outputs (each field a `BatchedTensor` of the datums' arrays end to end, with byte offsets)."""
    record = bytearray()
    _put_bytes(record, 1, b"ArrayRecord")
    names = list(outputs[0]) if outputs else []
    for name in names:
        arrays = [np.ascontiguousarray(out[name]) for out in outputs]
        is_float = arrays[0].dtype.kind == "f"
        arrays = [a.astype(np.float32 if is_float else np.int64, copy=False) for a in arrays]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        tensor = bytearray()
        _put_bytes(tensor, 1, b"".join(a.tobytes() for a in arrays))
        _put_bytes(tensor, 2, offsets.tobytes())
        _put_int(tensor, 3, DTYPE_FLOAT32 if is_float else DTYPE_INT64)
        trailing = list(arrays[0].shape[1:])
        if trailing:
            _put_bytes(tensor, 4, _packed(trailing))
        entry = bytearray()
        _put_bytes(entry, 1, name.encode())
        _put_bytes(entry, 2, bytes(tensor))
        _put_bytes(record, 2, bytes(entry))
    _put_int(record, 3, len(outputs))
    out = bytearray()
    _put_bytes(out, 1, b"ArrayRecord")
    _put_bytes(out, 2, bytes(record))
    for key, value in metrics.items():
        entry = bytearray()
        _put_bytes(entry, 1, key.encode())
        _put_double(entry, 2, float(value))
        _put_bytes(out, 3, bytes(entry))
    return bytes(out)


def encode_sample_response(
    sequences: list[dict], prompt_logprobs: list[float | None] | None, cached_tokens: int = 0
) -> bytes:
    """A `tinker_public.SampleResponse`. Each of `sequences` is `{"tokens", "logprobs",
    "stop_reason"}`; `prompt_logprobs` has one entry per prompt token, None where there is none
    (the first), written as NaN as the SDK reads it."""
    out = bytearray()
    for seq in sequences:
        body = bytearray()
        _put_int(body, 1, STOP_REASONS[seq["stop_reason"]])
        _put_bytes(body, 2, np.asarray(seq["tokens"], dtype=np.int32).tobytes())
        if seq.get("logprobs") is not None:
            _put_bytes(body, 3, np.asarray(seq["logprobs"], dtype=np.float32).tobytes())
        _put_bytes(out, 1, bytes(body))
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        _put_bytes(out, 2, np.asarray(values, dtype=np.float32).tobytes())
    _put_int(out, 4, cached_tokens)
    return bytes(out)


# --- JSON bodies --------------------------------------------------------------------------------


class Body(BaseModel):
    """A request body of the SDK. Unknown fields are ignored (a newer SDK may add optional
    ones); the fields that ask for something this service lacks are checked by name."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class ClientConfigRequest(Body):
    sdk_version: str = ""


class CreateSessionRequest(Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None


class SessionHeartbeatRequest(Body):
    session_id: str


class LoraConfig(Body):
    rank: int = Field(ge=1)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Body):
    type: str = "adamw"


class CreateModelRequest(Body):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = OptimizerConfig()


class GetInfoRequest(Body):
    model_id: str


class UnloadModelRequest(Body):
    model_id: str


class AdamParams(Body):
    """The SDK's `AdamParams` (its defaults); `type` is set only by other optimizer families."""

    learning_rate: float = Field(0.0001, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)
    type: str | None = None


class OptimStepRequest(Body):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None
    optim_params: AdamParams | None = None


class SaveWeightsRequest(Body):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveWeightsForSamplerRequest(Body):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class LoadWeightsRequest(Body):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None


class CreateSamplingSessionRequest(Body):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = None
    model_path: str | None = None


class Chunk(Body):
    type: str = "encoded_text"
    tokens: list[int] | None = None


class ModelInput(Body):
    chunks: list[Chunk]

    def tokens(self) -> list[int]:
        out: list[int] = []
        for chunk in self.chunks:
            if chunk.type != "encoded_text" or chunk.tokens is None:
                raise Unsupported(f"{chunk.type} chunks in a prompt are not supported (text-only models)")
            out += chunk.tokens
        return out


class SamplingParams(Body):
    max_tokens: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)


class SampleRequest(Body):
    num_samples: int = Field(1, ge=1)
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = Field(None, ge=1)
    record_stability_info: bool | None = None

    def refused(self) -> list[str]:
        """The features this request asks for that the service does not serve."""
        asks = {
            "topk_prompt_logprobs": self.topk_prompt_logprobs > 0,
            "topk_sample_logprobs": self.topk_sample_logprobs > 0,
            "target_prompt_logprobs": self.target_prompt_logprobs is not None,
            "prompt_alt_tokens_k": self.prompt_alt_tokens_k > 0,
            "record_stability_info": bool(self.record_stability_info),
        }
        return [name for name, asked in asks.items() if asked]


class FinishReason(Body):
    type: str = "unknown"


class SessionFinishRequest(Body):
    """`POST /api/v1/sessions/{id}/finish` (`ServiceClient.close`): `{"reason": {"type"}, "detail"}`."""

    reason: FinishReason | None = None
    detail: str | None = None


class FutureRetrieveRequest(Body):
    request_id: str
    allow_metadata_only: bool = False


class TelemetrySendRequest(Body):
    events: list[dict[str, Any]] = []
    session_id: str = ""


# --- JSON answers --------------------------------------------------------------------------------


class UntypedFuture(BaseModel):
    """What every call that runs later answers: the id `retrieve_future` takes."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None


class ClientConfigResponse(BaseModel):
    """The SDK's feature flags (`types/client_config_response.py`): API keys, not JWT; no zstd;
    one forward_backward request per call where it fits; futures polled one by one."""

    pjwt_auth_enabled: bool = False
    credential_default_source: str = "api_key"
    proto_compress_fwdbwd: bool = False
    parallel_fwdbwd_chunks: bool = True
    fwdbwd_max_chunk_len: int = 1024
    fwdbwd_max_chunk_bytes_count: int = 5_000_000
    use_pyqwest_transport: bool = False
    sample_use_retrieve_futures: bool = False
    custom_loss_server_side: bool = False
    sample_join_sampling_session: bool = False
    sample_max_concurrent_requests: int = 64


class ClientDynamicConfigResponse(BaseModel):
    refresh_interval_sec: int = 300
    sample_cancel_enabled: bool = False
    sample_cancel_max_batch_size: int = 64


class CreateSessionResponse(BaseModel):
    type: Literal["create_session"] = "create_session"
    session_id: str
    info_message: str | None = None


class SessionHeartbeatResponse(BaseModel):
    type: Literal["session_heartbeat"] = "session_heartbeat"


class SupportedModel(BaseModel):
    model_name: str
    max_context_length: int | None = None
    trainable: bool = True
    sampleable: bool = True


class ServerCapabilities(BaseModel):
    supported_models: list[SupportedModel]


class ModelData(BaseModel):
    arch: str | None = None
    model_name: str
    tokenizer_id: str | None = None


class GetInfoResponse(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    type: Literal["get_info"] = "get_info"
    model_data: ModelData
    model_id: str
    is_lora: bool
    lora_rank: int | None = None
    model_name: str


class CreateSamplingSessionResponse(BaseModel):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str


class SamplerInfo(BaseModel):
    """`GET /api/v1/samplers/{id}` (the SDK's `GetSamplerResponse`)."""

    sampler_id: str
    base_model: str
    model_path: str | None = None


class TelemetryResponse(BaseModel):
    status: Literal["accepted"] = "accepted"


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


def try_again(request_id: str) -> dict:
    """`retrieve_future`'s answer (with HTTP 408) while a call is still queued or running."""
    return {"type": "try_again", "request_id": request_id, "queue_state": "active"}


def request_failed(message: str, category: Literal["user", "server", "unknown"]) -> dict:
    """`retrieve_future`'s answer for a call that failed: the SDK raises `RequestFailedError`."""
    return {"error": message, "category": category}
