"""HTTP bodies of the rollout service (`POST/GET/DELETE /v1/rollouts`), shared by the service,
`asyncrl submit` and any client.

A job is a list of prompts; each prompt becomes one group of `group_size` completions. A
prompt is exactly one of `text` (tokenized by the service), `messages` (rendered with the
model's chat template) or `input_ids`. Sampling parameters are SGLang's own
(`proto.sglang.SamplingParams`), passed through to the engine; `n` must stay 1 because the
group size is the rollout service's business. The service refuses at submission what its
engines would refuse (the reference engine's unsupported params) and reward-spec arguments
the verifier's own spec model refuses (`services/rollout/intake.py`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncrl.proto.environments import MAX_TURNS
from asyncrl.proto.limits import MAX_GROUP_SIZE
from asyncrl.proto.rewards import RewardSpec
from asyncrl.proto.sglang import SamplingParams
from asyncrl.proto.states import JobState

MAX_PROMPTS_PER_JOB = 100_000
MAX_PROMPT_CHARS = 1_000_000


class ChatTurn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str = Field(min_length=1, max_length=64)
    content: str = Field(max_length=MAX_PROMPT_CHARS)


class RolloutPrompt(BaseModel):
    """One prompt: exactly one of `text`, `messages`, `input_ids`; optional own reward spec."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatTurn] | None = None
    input_ids: list[int] | None = None
    reward_spec: RewardSpec | None = None
    prompt_id: str | None = Field(default=None, min_length=1, max_length=128)

    @model_validator(mode="after")
    def _one_input(self) -> RolloutPrompt:
        given = [name for name in ("text", "messages", "input_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"a prompt needs exactly one of text, messages, input_ids (got {given or 'none'})"
            )
        if self.text is not None and not self.text.strip():
            raise ValueError("empty prompt text")
        if self.messages is not None and not self.messages:
            raise ValueError("empty messages list")
        if self.input_ids is not None:
            if not self.input_ids:
                raise ValueError("empty input_ids")
            if any(t < 0 or t > 2**31 - 1 for t in self.input_ids):
                raise ValueError("input_ids must be non-negative 32-bit integers")
        return self


class EpisodeSpec(BaseModel):
    """A job's episodes: each sample is an episode of up to `max_turns` policy turns
    with `environment` (served at the reward service, `proto/environments.py`) answering the
    tool calls in between. A turn ends at EOS, at its `max_new_tokens` or, in the `tagged`
    format, at a one-token `tool_close` marker; its text is parsed for a tool call:

    * `hermes` (chat models, Qwen/Hermes style): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`;
      the environment's answer enters the context as a `tool` message of the chat template;
    * `tagged` (any model, e.g. the CPU demo's character model): `{tool_open}NAME ARGS{tool_close}`
      (`tool_close` empty: to the end of the turn; NAME empty: `default_tool`); the answer enters
      as `observation_template` with `{observation}` filled in.

    A turn without a tool call is the final answer. The episode's reward is the environment's
    (the sum of its turn rewards) when it judges, else the job's `reward_spec` verifier's on the
    final answer. `tools = false` runs the same task with no tool call parsed (one turn): the
    baseline that shows what the tool is worth.

    `kind = "openenv"`: `environment` names an OpenEnv server of the rollout's configuration
    (`[rollout.openenv.NAME]`, never a URL from the job), driven over its own protocol
    (`proto/openenv.py`); its one tool is its action. With a `messages` prompt, the
    environment's first observation (the task) enters as a user message of the chat template."""

    model_config = ConfigDict(extra="forbid")

    environment: str = Field(min_length=1, max_length=64)
    kind: Literal["asyncrl", "openenv"] = Field(
        default="asyncrl",
        description="asyncrl: the environment protocol (proto/environments.py) at environments_url; "
        "openenv: a configured OpenEnv server",
    )
    max_turns: int = Field(default=4, ge=1, le=MAX_TURNS)
    tool_format: Literal["hermes", "tagged"] = "hermes"
    tool_open: str = Field(
        default="", max_length=64, description="default: <tool_call> (hermes), <tool> (tagged)"
    )
    tool_close: str | None = Field(default=None, max_length=64, description="default: </tool_call>, </tool>")
    default_tool: str = Field(default="", max_length=128)
    observation_template: str = Field(default="{observation}", max_length=4096)
    env_args: dict[str, Any] = Field(default_factory=dict)
    max_episode_tokens: int | None = Field(
        default=None, ge=1, description="completion + observations; default: the context"
    )
    retries: int = Field(
        default=2, ge=0, le=10, description="times a failed episode starts again before its group fails"
    )
    tools: bool = True

    @field_validator("observation_template")
    @classmethod
    def _has_slot(cls, value: str) -> str:
        if "{observation}" not in value:
            raise ValueError("observation_template needs an {observation} slot")
        return value


class RolloutRequest(BaseModel):
    """Body of `POST /v1/rollouts`."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[RolloutPrompt] = Field(min_length=1, max_length=MAX_PROMPTS_PER_JOB)
    group_size: int | None = Field(
        default=None, ge=1, le=MAX_GROUP_SIZE, description="default: the service's"
    )
    sampling_params: SamplingParams | None = None
    reward_spec: RewardSpec | None = Field(default=None, description="for prompts without their own")
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256)
    episode: EpisodeSpec | None = Field(default=None, description="multi-turn episodes with an environment")

    @field_validator("sampling_params")
    @classmethod
    def _single_sample(cls, value: SamplingParams | None) -> SamplingParams | None:
        if value is not None and value.n != 1:
            raise ValueError("sampling_params.n must be 1; use group_size for several completions")
        return value

    @model_validator(mode="after")
    def _every_prompt_has_a_spec(self) -> RolloutRequest:
        if self.reward_spec is None and self.episode is None:  # (an episode may be judged by its environment)
            missing = [i for i, p in enumerate(self.prompts) if p.reward_spec is None]
            if missing:
                raise ValueError(f"prompts {missing[:10]} have no reward_spec and the job gives none")
        return self


class RolloutAccepted(BaseModel):
    """Answer of `POST /v1/rollouts` (202)."""

    job_id: str
    groups: int = Field(description="prompt groups in the job")
    duplicate: bool = Field(False, description="true when the idempotency key named an existing job")


class RolloutProgress(BaseModel):
    """Answer of `GET /v1/rollouts/{id}`: where each group of the job is, one count per
    `proto.states.GroupState`.

    `queued + generating + scoring + buffered + failed + cancelled == groups`; `trained`,
    `dropped`, `withheld`, `zero_spread` and `dead_lettered` count what the trainer did with
    buffered groups (`other`: any other way they left the buffer, e.g. `lost`). A group is
    `trained` from the optimizer step that used it; `checkpointed` of them are durable (acked by
    the checkpoint after that step: a trainer crash before it redelivers the rest, which are
    trained again or leave another way, and are counted once either way).
    `unscored` counts the buffered groups in which no sample was scored (every reward came back
    `timeout`, `error` or `invalid_input`): they are in the buffer, and the trainer may ack
    them (`trained`), but they carry no reward. A finished job reads `failed` when no group
    produced a scored sample (all `failed` or `unscored`), `done` otherwise; `failed`,
    `unscored`, `unscored_samples` and `errors` say how much of a `done` job went wrong.
    """

    job_id: str
    state: JobState
    groups: int
    queued: int
    generating: int
    scoring: int
    buffered: int
    failed: int
    cancelled: int
    trained: int
    checkpointed: int = Field(0, description="trained groups whose update a checkpoint has made durable")
    dropped: int
    withheld: int
    zero_spread: int
    dead_lettered: int = Field(
        0, description="buffered groups whose record did not decode (dead-letter stream)"
    )
    in_buffer: int = Field(description="buffered groups the trainer has not consumed yet")
    created_at: float
    cancel_requested: bool = False
    unscored: int = Field(0, description="buffered groups with no scored sample")
    unscored_samples: dict[str, int] = Field(
        default_factory=dict,
        description="samples of buffered groups that were not scored, by reward status",
    )
    other: dict[str, Any] = Field(default_factory=dict, description="other trainer exit reasons, by name")
    errors: dict[str, str] = Field(
        default_factory=dict, description="why groups failed or went unscored, by group id (first 10)"
    )


class ErrorBody(BaseModel):
    detail: str | list[Any]
