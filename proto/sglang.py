"""HTTP bodies of SGLang's native API, the subset asyncrl speaks (docs/architecture.md §7).

Both sides import these: the reference engine (`services/engine`) validates requests with
them, and the rollout service's engine client builds requests and parses responses with them,
so a real SGLang server, `sglang-router` or the reference engine are interchangeable.

Checked against the SGLang **0.5.23** wheel (`pip download --no-deps sglang==0.5.23`), read
file by file: `sglang/srt/entrypoints/http_server.py` (routes), `sglang/srt/managers/io_struct.py`
(`GenerateReqInput`, `AbortReq`, `UpdateWeightFromDiskReqInput`, `InitWeightsUpdateGroupReqInput`,
`UpdateWeightsFromDistributedReqInput`, `BeginWeightUpdateReqInput`, `EndWeightUpdateReqInput`,
`PauseGenerationReqInput`, `ContinueGenerationReqInput`, `LoadLoRAAdapterReqInput`,
`UnloadLoRAAdapterReqInput`, `LoRAUpdateOutput`),
`sglang/srt/sampling/sampling_params.py`, `sglang/srt/utils/weight_versions.py` (per-token
version spans) and `sglang/api/v1/api_types.py`, the generated schema `/generate` checks every
body with (`api_contract.generate_contract_error`): unknown top-level keys are ignored, unknown
keys inside `sampling_params` are refused with a 400. The names this module may send are
vendored in `tests/data/sglang_0_5_23_contract.json` (extracted from those files) and a unit
test holds our models to them; `tests/integration/rollout/test_sglang_schema.py` runs the
bodies the engine client sends through the wheel's own `api_types.py`. Not modelled (so not
requestable through the rollout): 0.5.23's `stop_regex`, `structural_tag`, `custom_params`,
`beam_width`, `watermark`, `choice`, `stream_interval`. Response shapes follow `TokenizerManager` (`{"text",
"output_ids", "meta_info"}`, `finish_reason` from `BaseFinishReason.to_json()`,
`output_token_logprobs` as `[logprob, token_id, text|None]`, `weight_versions` as
`[{"version", "start", "end"}]` spans over the output tokens, `weight_version` the last span's).

Routes: 0.5.23 names `/model_info` and `/server_info`; `/get_model_info` and `/get_server_info`
still answer but are deprecated, and servers before them know only the old names. `ROUTES`
maps each new name to its old one; clients try the new one and fall back on a 404.

LoRA: `/load_lora_adapter` and `/unload_lora_adapter` (`LoRAUpdateOutput`, 200 or 400), and
`/generate`'s `lora_path`, the name of a loaded adapter per item. Not modelled: `lora_id`
(0.5.23's tokenizer manager sets it; a client does not) and `/load_lora_adapter_from_tensors`.

Limits of this subset, stated rather than silently ignored: `stream`, `n > 1`, penalties,
grammars (`regex`, `json_schema`, `ebnf`), `logit_bias`, `top_logprobs_num > 0` and
multimodal inputs are refused with a 4xx by the reference engine (a real SGLang accepts
them; the models below still carry the fields so a client can send them to SGLang).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

SGLANG_RELEASE = "0.5.23"  # the release this module is checked against (docstring)

# Current route -> the deprecated name older servers (and 0.5.23, with a warning) answer.
ROUTES = {"/model_info": "/get_model_info", "/server_info": "/get_server_info"}

# Sanity bounds on sampling values: anything outside is a client bug, not a preference.
MAX_TEMPERATURE = 100.0
MAX_TOKEN_ID = 2**31 - 1


def check_unicode(value: Any) -> Any:
    """Refuse a lone UTF-16 surrogate (a JSON "\\ud800" escape): it is not text, the tokenizer
    cannot take it and UTF-8 cannot encode it back into an answer."""
    for text in value if isinstance(value, list) else [value]:
        if isinstance(text, str) and not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("contains a lone UTF-16 surrogate, which is not valid Unicode") from None
    return value


class SamplingParams(BaseModel):
    """SGLang `SamplingParams` (same names and defaults). `temperature = 0` is greedy."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    max_new_tokens: int = Field(default=128, ge=0)
    min_new_tokens: int = Field(default=0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(default=1, ge=1)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None
    # SGLang's name is `sampling_seed`; `seed` (the OpenAI name) is accepted as an alias.
    sampling_seed: int | None = Field(
        default=None, ge=0, validation_alias=AliasChoices("sampling_seed", "seed")
    )

    @field_validator("temperature", "top_p", "min_p")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(not 0 <= t <= MAX_TOKEN_ID for t in value):
            raise ValueError("token ids must be non-negative 32-bit integers")
        return value


def _aliases() -> dict[str, str]:
    """Each accepted alias of a `SamplingParams` field -> SGLang's own name for it."""
    out = {}
    for name, info in SamplingParams.model_fields.items():
        if isinstance(info.validation_alias, AliasChoices):
            out.update({a: name for a in info.validation_alias.choices if isinstance(a, str) and a != name})
    return out


# `seed` -> `sampling_seed`: accepted by our validation, refused by 0.5.23's schema.
SAMPLING_ALIASES: dict[str, str] = _aliases()


def wire_sampling_params(params: dict) -> dict:
    """`params` with every alias our validation accepts renamed to SGLang's field (the name
    wins where both are given, as pydantic's `populate_by_name` does). SGLang 0.5.23 refuses
    an unknown key inside `sampling_params`, so nothing else may reach the wire."""
    if not SAMPLING_ALIASES.keys() & params.keys():
        return params  # the usual case: no copy
    out = {k: v for k, v in params.items() if k not in SAMPLING_ALIASES}
    for alias, name in SAMPLING_ALIASES.items():
        if alias in params and name not in out:
            out[name] = params[alias]
    return out


# What the reference engine cannot do, per sampling field: (how its refusal names it, whether
# `params` asks for it). One list for the engine, which refuses these, and the rollout service,
# which refuses them at its door when its engines are reference engines.
REFERENCE_ENGINE_REFUSES: dict[str, tuple[str, Callable[[SamplingParams], bool]]] = {
    "min_new_tokens": ("min_new_tokens", lambda p: p.min_new_tokens != 0),
    "frequency_penalty": ("frequency_penalty", lambda p: p.frequency_penalty != 0.0),
    "presence_penalty": ("presence_penalty", lambda p: p.presence_penalty != 0.0),
    "repetition_penalty": ("repetition_penalty", lambda p: p.repetition_penalty != 1.0),
    "regex": ("constrained decoding (regex)", lambda p: bool(p.regex)),
    "json_schema": ("constrained decoding (json_schema)", lambda p: bool(p.json_schema)),
    "ebnf": ("constrained decoding (ebnf)", lambda p: bool(p.ebnf)),
    "logit_bias": ("logit_bias", lambda p: bool(p.logit_bias)),
}


def refused_by_reference_engine(params: SamplingParams) -> dict[str, str]:
    """Field name -> label of each sampling feature in `params` the reference engine refuses."""
    return {name: label for name, (label, asks) in REFERENCE_ENGINE_REFUSES.items() if asks(params)}


class GenerateReqInput(BaseModel):
    """Body of `POST /generate`: one prompt, or a batch when `text`/`input_ids` is a list of them."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    # The LoRA adapter of each item, by the name it was loaded under (`/load_lora_adapter`):
    # one name for every item, or one per item of a batch; None (or a None item) is the base model.
    lora_path: str | list[str | None] | None = None
    # Fields sglang-router (0.3.x) re-sends on every request with their defaults. They are
    # accepted at those defaults; asking for what this engine does not do is refused below.
    model: str | None = None
    return_hidden_states: bool | list[bool] = False
    return_entropy: bool = False
    return_bytes: bool = False
    background: bool = False
    no_logs: bool = False

    _unicode = field_validator("text", "rid", "lora_path")(check_unicode)

    @model_validator(mode="after")
    def _one_input(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of `text` or `input_ids` must be given")
        unsupported = [
            name
            for name in ("return_hidden_states", "return_entropy", "return_bytes", "background")
            if any(getattr(self, name) if isinstance(getattr(self, name), list) else [getattr(self, name)])
        ]
        if unsupported:
            raise ValueError(f"not supported by the reference engine: {', '.join(unsupported)}")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def batch_size(self) -> int:
        if not self.is_batch:
            return 1
        return len(self.text if self.text is not None else self.input_ids)  # type: ignore[arg-type]

    def item(self, i: int) -> GenerateItem:
        """The i-th request of a (possibly single) body, with per-item fields resolved."""
        n = self.batch_size
        batch = self.is_batch

        def pick(value: Any, default: Any) -> Any:
            if value is None:
                return default
            if isinstance(value, list):
                if not batch or len(value) != n:
                    raise ValueError(
                        f"a per-item list has {len(value)} entries for a batch of {n if batch else 'one'}"
                    )
                return value[i]
            return value

        rid = self.rid
        if isinstance(rid, str) and batch:
            rid = f"{rid}_{i}"
        elif isinstance(rid, list):
            if not batch or len(rid) != n:
                raise ValueError("`rid` as a list needs a batch of the same length")
            rid = rid[i]
        params = self.sampling_params
        if isinstance(params, list):
            if not batch or len(params) != n:
                raise ValueError("`sampling_params` as a list needs a batch of the same length")
            params = params[i]
        lora_path = self.lora_path
        if isinstance(lora_path, list) and not batch:
            raise ValueError("`lora_path` as a list needs a batch; a single request names one adapter")
        if isinstance(lora_path, list) and len(lora_path) != n:
            raise ValueError(f"lora_path list length ({len(lora_path)}) must match batch size ({n})")
        logprob_start_len = int(pick(self.logprob_start_len, -1))
        if logprob_start_len < -1:  # -1 is SGLang's default (no prompt logprobs); below it means nothing
            raise ValueError(f"logprob_start_len must be -1 or a prompt position, got {logprob_start_len}")
        return GenerateItem(
            text=(self.text[i] if batch else self.text) if self.text is not None else None,  # type: ignore[index]
            input_ids=(self.input_ids[i] if batch else self.input_ids)
            if self.input_ids is not None
            else None,  # type: ignore[index,arg-type]
            sampling_params=params or SamplingParams(),
            rid=rid,
            return_logprob=bool(pick(self.return_logprob, False)),
            logprob_start_len=logprob_start_len,
            top_logprobs_num=int(pick(self.top_logprobs_num, 0)),
            lora_path=lora_path[i] if isinstance(lora_path, list) else lora_path,
        )


@dataclass(slots=True)
class GenerateItem:
    """One normalised request of a `/generate` body (not on the wire: built from a checked
    `GenerateReqInput`, so a plain dataclass; a model per item was a fifth of the engine's
    request handling)."""

    text: str | None
    input_ids: list[int] | None
    sampling_params: SamplingParams
    rid: str | None
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    lora_path: str | None = None  # the adapter's name; None: the base model


FinishType = Literal["stop", "length", "abort"]


class FinishReasonInfo(BaseModel):
    """`BaseFinishReason.to_json()`: `{"type": "stop", "matched": <token id>}`,
    `{"type": "length", "length": <n>}` or `{"type": "abort", "message": ...}`."""

    model_config = ConfigDict(extra="allow")

    type: FinishType
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class WeightVersionSpan(BaseModel):
    """`meta_info.weight_versions[i]`: output tokens `[start, end)` were sampled under `version`
    (SGLang 0.5.23 `utils/weight_versions.py`; spans are contiguous from 0 and in order)."""

    model_config = ConfigDict(extra="allow")

    version: str
    start: int = Field(ge=0)
    end: int = Field(ge=0)


class MetaInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: FinishReasonInfo
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    weight_version: str | None = None
    # Per-token versions (0.5.23): one span per weight version the output tokens were sampled under.
    weight_versions: list[WeightVersionSpan] | None = None
    e2e_latency: float | None = None
    # Present when `return_logprob`: one `[logprob, token_id, text_or_None]` per output token.
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None
    # Present when `return_logprob`: prompt tokens from `logprob_start_len`; the first
    # prompt token has no logprob (None), as in SGLang.
    input_token_logprobs: list[tuple[float | None, int, str | None]] | None = None


class GenerateResponse(BaseModel):
    """One item of a `/generate` response (a batch request answers a list of these)."""

    model_config = ConfigDict(extra="allow")

    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class AbortReq(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str = ""
    abort_all: bool = False
    abort_message: str | None = None


class UpdateWeightFromDiskReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1)
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True


class UpdateWeightFromDiskReqOutput(BaseModel):
    success: bool
    message: str
    num_paused_requests: int = 0


class InitWeightsUpdateGroupReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    master_address: str = Field(min_length=1)
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=1)  # rank 0 is the trainer
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"

    @model_validator(mode="after")
    def _rank_in_world(self) -> InitWeightsUpdateGroupReqInput:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be below world_size {self.world_size}")
        return self


class UpdateWeightsFromDistributedReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False

    @model_validator(mode="after")
    def _same_lengths(self) -> UpdateWeightsFromDistributedReqInput:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        if any(d < 0 for shape in self.shapes for d in shape):
            raise ValueError("shapes must be non-negative")
        return self


class BeginWeightUpdateReqInput(BaseModel):
    """Body of `/begin_weight_update` (0.5.23): opens the session every
    `/update_weights_from_distributed` must run in; `/end_weight_update` (no body) closes it."""

    model_config = ConfigDict(extra="forbid")

    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BroadcastDelta(BaseModel):
    """asyncrl's extension of `/update_weights_from_distributed`, not SGLang's: the bucket is
    part of a delta version (services/transport/weights/broadcast.py). Only the reference
    engine is sent it; 0.5.23's request model drops unknown keys without a word, so SGLang
    would load the tensors unchecked."""

    model_config = ConfigDict(extra="forbid")

    base: str = Field(min_length=1)  # the weight_version the delta applies to, exactly that one
    sha256: dict[str, str]  # each tensor of the bucket → sha256 of its bytes as sent


class ReferenceUpdateWeightsFromDistributedReqInput(UpdateWeightsFromDistributedReqInput):
    """What the reference engine reads on `/update_weights_from_distributed`: SGLang's body,
    plus `delta` when the sender knows the engine is a reference engine."""

    delta: BroadcastDelta | None = None


class WeightUpdateOutput(BaseModel):
    """Answer of `/init_weights_update_group` and `/update_weights_from_distributed`."""

    success: bool
    message: str


class PauseGenerationReqInput(BaseModel):
    """`abort`: abort and return running requests; `in_place`: freeze them with their KV;
    `retract`: freeze them and drop their KV (recomputed on continue)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(BaseModel):
    """Body of `/continue_generation` (0.5.23; older servers take none and ignore one)."""

    model_config = ConfigDict(extra="forbid")

    torch_empty_cache: bool = True  # SGLang empties the CUDA allocator cache before resuming


class ModelInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    model_path: str
    tokenizer_path: str | None
    is_generation: bool = True
    preferred_sampling_params: str | None = None
    weight_version: str | None = None
    model_type: str | None = None
    architectures: list[str] | None = None


class LoadLoRAAdapterReqInput(BaseModel):
    """Body of `POST /load_lora_adapter` (0.5.23 `io_struct.LoadLoRAAdapterReqInput`): load the
    PEFT adapter directory `lora_path` (`adapter_config.json`, `adapter_model.safetensors`)
    under `lora_name`, the name `/generate`'s `lora_path` then names. `pinned`: never evicted
    to make room for another (an explicit unload still removes it)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False

    _unicode = field_validator("lora_name", "lora_path")(check_unicode)


class UnloadLoRAAdapterReqInput(BaseModel):
    """Body of `POST /unload_lora_adapter` (0.5.23 `io_struct.UnloadLoRAAdapterReqInput`)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)

    _unicode = field_validator("lora_name")(check_unicode)


# SGLang 0.5.23's refusal of a `/generate` that names an adapter it does not hold (a 400, before
# any token): the names follow this prefix, comma-separated, up to the first ". " or newline.
# The reference engine writes it; the rollout reads it to tell "the engine lost my adapter"
# (restarted, or evicted it) from any other refusal.
LORA_NOT_LOADED = "The following requested LoRA adapters are not loaded: "


def lora_not_loaded(message: str) -> list[str]:
    """The adapter names a `LORA_NOT_LOADED` refusal lists (empty for any other message)."""
    _, found, rest = message.partition(LORA_NOT_LOADED)
    if not found:
        return []
    names = rest.split("\n", 1)[0].split(". ", 1)[0].rstrip(".")
    return [n.strip() for n in names.split(",") if n.strip()]


class LoRAUpdateOutput(BaseModel):
    """Answer of `/load_lora_adapter` and `/unload_lora_adapter` (0.5.23 `io_struct.LoRAUpdateOutput`;
    200 when `success`, else 400). `loaded_adapters`: name → path of every adapter loaded after
    the call; None when the call was refused before reaching the adapters (SGLang's shape)."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None
